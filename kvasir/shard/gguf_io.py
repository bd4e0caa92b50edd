"""A small, fast GGUF (v2/v3) reader and writer that copies metadata and tensor bytes verbatim.

``gguf.GGUFReader`` turns every string of a 262k-token vocabulary into numpy objects (seconds per open); slicing
only needs the byte spans of each key/value and tensor, so this module parses the header once with ``struct`` and
copies everything else as raw bytes. Format reference: ggml's ``docs/gguf.md``.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvasir.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
#: Arrays longer than this keep only their raw bytes (vocabularies); their value is decoded on demand.
_DECODE_LIMIT = 4096


@attrs.frozen
class KV:
    key: str
    vtype: GGUFValueType
    #: The encoded value (type tag included), ready to be written after the key.
    raw: bytes
    value: Any
    sub_type: GGUFValueType | None = None

    @property
    def length(self) -> int:
        """Number of elements of an array value (1 for scalars)."""
        if self.vtype != GGUFValueType.ARRAY:
            return 1
        return int(struct.unpack_from("<Q", self.raw, 8)[0])

    def renamed(self, key: str) -> KV:
        return attrs.evolve(self, key=key)


@attrs.frozen
class TensorInfo:
    name: str
    #: ggml order: ne[0] is the row length.
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    #: Absolute offset of the tensor's bytes in the file.
    offset: int
    nbytes: int


@attrs.frozen
class GGUFFile:
    path: Path
    version: int
    kvs: dict[str, KV]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kvs.get(key)
        if kv is None:
            return default
        if kv.value is None and kv.vtype == GGUFValueType.ARRAY:
            return decode_array(kv)
        return kv.value


def tensor_nbytes(shape: Sequence[int], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= int(d)
    if shape and int(shape[0]) % block:
        raise ValueError(f"row length {shape[0]} is not a multiple of the {qtype.name} block size {block}")
    return n // block * type_size


class _Cursor:
    def __init__(self, buf: bytes | mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ModelFileError(f"{self.path}: truncated GGUF header")
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if n > len(self.buf) - self.pos:
            raise ModelFileError(f"{self.path}: corrupt GGUF (string length {n} past the end)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelFileError(f"{self.path}: corrupt GGUF (invalid UTF-8 in a string)") from None

    def skip_string(self) -> None:
        n = self.take("<Q")
        if n > len(self.buf) - self.pos:
            raise ModelFileError(f"{self.path}: corrupt GGUF (string length {n} past the end)")
        self.pos += n

    def value(self, vtype: GGUFValueType) -> tuple[Any, GGUFValueType | None]:
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype]), None
        if vtype == GGUFValueType.STRING:
            return self.string(), None
        if vtype == GGUFValueType.ARRAY:
            sub = _vtype(self.take("<I"), self.path)
            n = self.take("<Q")
            if sub == GGUFValueType.STRING:
                if n > _DECODE_LIMIT:
                    for _ in range(n):
                        self.skip_string()
                    return None, sub
                return [self.string() for _ in range(n)], sub
            if sub == GGUFValueType.ARRAY:
                raise ModelFileError(f"{self.path}: nested GGUF arrays are not supported")
            fmt = _SCALAR[sub]
            size = struct.calcsize(fmt)
            if n * size > len(self.buf) - self.pos:
                raise ModelFileError(f"{self.path}: corrupt GGUF (array of {n} past the end)")
            start = self.pos
            self.pos += n * size
            if n > _DECODE_LIMIT:
                return None, sub
            return list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, start)), sub
        raise ModelFileError(f"{self.path}: corrupt GGUF (unknown value type {vtype})")


def _vtype(v: int, path: Path) -> GGUFValueType:
    try:
        return GGUFValueType(v)
    except ValueError:
        raise ModelFileError(f"{path}: corrupt GGUF (unknown value type {v})") from None


def decode_array(kv: KV) -> list[Any]:
    cur = _Cursor(kv.raw, Path(kv.key))
    cur.take("<I")
    sub = _vtype(cur.take("<I"), Path(kv.key))
    n = cur.take("<Q")
    if sub == GGUFValueType.STRING:
        return [cur.string() for _ in range(n)]
    fmt = _SCALAR[sub]
    return list(struct.unpack_from(f"<{n}{fmt[1]}", kv.raw, cur.pos))


def read_gguf(path: Path) -> GGUFFile:
    """Parse the header of ``path``; every defect becomes one :class:`ModelFileError` line."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        if size < 24:
            raise ModelFileError(f"{path}: not a GGUF file (only {size} bytes)")
        with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if mm[:4] != GGUF_MAGIC:
                raise ModelFileError(f"{path}: not a GGUF file (bad magic {mm[:4]!r})")
            cur = _Cursor(mm, path)
            cur.pos = 4
            version = cur.take("<I")
            if version not in (2, 3):
                raise ModelFileError(f"{path}: unsupported GGUF version {version}")
            n_tensors = cur.take("<Q")
            n_kv = cur.take("<Q")
            if n_tensors > 1 << 24 or n_kv > 1 << 24:
                raise ModelFileError(f"{path}: corrupt GGUF (absurd counts)")
            kvs = _read_kvs(cur, n_kv)
            tensors_raw = [_read_tensor_info(cur) for _ in range(n_tensors)]
            header_end = cur.pos
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read ({exc.strerror})") from None
    alignment = int(kvs["general.alignment"].value) if "general.alignment" in kvs else DEFAULT_ALIGNMENT
    data_offset = header_end + (-header_end) % alignment
    tensors: list[TensorInfo] = []
    for name, shape, t, rel in tensors_raw:
        try:
            qtype = GGMLQuantizationType(t)
            nbytes = tensor_nbytes(shape, qtype)
        except (ValueError, KeyError):
            raise ModelFileError(f"{path}: corrupt GGUF (tensor {name} has bad type {t} or shape)") from None
        info = TensorInfo(name, shape, qtype, data_offset + rel, nbytes)
        if info.offset + nbytes > size:
            raise ModelFileError(f"{path}: truncated GGUF (tensor {name} ends past the end of the file)")
        tensors.append(info)
    return GGUFFile(path, version, kvs, tuple(tensors), alignment, data_offset, size)


def _read_kvs(cur: _Cursor, n_kv: int) -> dict[str, KV]:
    kvs: dict[str, KV] = {}
    for _ in range(n_kv):
        key = cur.string()
        start = cur.pos
        vtype = _vtype(cur.take("<I"), cur.path)
        value, sub = cur.value(vtype)
        kvs[key] = KV(key, vtype, bytes(cur.buf[start : cur.pos]), value, sub)
    return kvs


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.take("<I")
    if n_dims > 4:
        raise ModelFileError(f"{cur.path}: corrupt GGUF (tensor {name} has {n_dims} dims)")
    shape = tuple(cur.take("<Q") for _ in range(n_dims))
    t = cur.take("<I")
    offset = cur.take("<Q")
    return name, shape, t, offset


# ---------------------------------------------------------------------------------------------------- writing


def encode_kv(key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> KV:
    out = bytearray(struct.pack("<I", vtype))
    if vtype in _SCALAR:
        out += struct.pack(_SCALAR[vtype], value)
    elif vtype == GGUFValueType.STRING:
        out += _encode_string(value)
    elif vtype == GGUFValueType.ARRAY:
        assert sub_type is not None
        out += struct.pack("<IQ", sub_type, len(value))
        for v in value:
            out += _encode_string(v) if sub_type == GGUFValueType.STRING else struct.pack(_SCALAR[sub_type], v)
    else:  # pragma: no cover
        raise ValueError(f"cannot encode GGUF type {vtype}")
    return KV(key, vtype, bytes(out), value, sub_type)


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


@attrs.frozen
class TensorSource:
    """A tensor to write: its bytes come from ``(path, offset)`` of a file, or are all zero."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    nbytes: int
    path: Path | None = None
    offset: int = 0
    data: bytes | None = None


def write_gguf(
    out: BinaryIO, kvs: Iterable[KV], tensors: Sequence[TensorSource], alignment: int = DEFAULT_ALIGNMENT
) -> None:
    """Write a GGUF v3 file to ``out``; tensor bytes are streamed from their sources (zeros when no source)."""
    kv_list = list(kvs)
    out.write(GGUF_MAGIC + struct.pack("<IQQ", 3, len(tensors), len(kv_list)))
    for kv in kv_list:
        out.write(_encode_string(kv.key) + kv.raw)
    rel = 0
    for t in tensors:
        out.write(_encode_string(t.name) + struct.pack("<I", len(t.shape)))
        out.write(struct.pack(f"<{len(t.shape)}Q", *t.shape) + struct.pack("<IQ", t.ggml_type, rel))
        rel += t.nbytes + (-t.nbytes) % alignment
    _pad(out, alignment)
    for t in tensors:
        if t.data is not None:
            out.write(t.data)
        elif t.path is None:
            _write_zeros(out, t.nbytes)
        else:
            copy_range(t.path, t.offset, t.nbytes, out)
        _pad(out, alignment)


def _pad(out: BinaryIO, alignment: int) -> None:
    out.write(b"\0" * ((-out.tell()) % alignment))


def _write_zeros(out: BinaryIO, n: int) -> None:
    chunk = b"\0" * min(n, 1 << 20)
    while n > 0:
        out.write(chunk[: min(n, len(chunk))])
        n -= min(n, len(chunk))


def copy_range(path: Path, offset: int, nbytes: int, out: BinaryIO) -> None:
    with path.open("rb") as src:
        src.seek(offset)
        remaining = nbytes
        while remaining:
            block = src.read(min(remaining, 8 << 20))
            if not block:
                raise ModelFileError(f"{path}: truncated GGUF (tensor data ends early)")
            out.write(block)
            remaining -= len(block)


def fsync_close(fh: BinaryIO) -> None:
    fh.flush()
    os.fsync(fh.fileno())
