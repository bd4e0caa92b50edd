"""A small, fast GGUF (v2/v3) reader and writer that copies metadata and tensor bytes verbatim.

``gguf.GGUFReader`` turns every string of a 262k-token vocabulary into numpy objects (seconds per open); slicing
only needs the byte spans of each key/value and tensor, so the header is parsed once with ``struct`` by the bounded
cursor of :mod:`kvasir.shard.gguf_header` (the one parser, shared with the Range fetcher) and everything else is
copied as raw bytes. Format reference: ggml's ``docs/gguf.md``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs
from gguf import GGMLQuantizationType, GGUFValueType

from kvasir.core.errors import ModelFileError
from kvasir.shard.gguf_header import (
    DEFAULT_ALIGNMENT,
    DEFAULT_LIMITS,
    GGUF_MAGIC,
    KV,
    PREAMBLE_BYTES,
    SCALAR_STRUCTS,
    GGUFHeader,
    HeaderCursor,
    HeaderLimits,
    NeedBytes,
    TensorInfo,
    decode_array,
    tensor_nbytes,
)

__all__ = [
    "DEFAULT_ALIGNMENT",
    "GGUF_MAGIC",
    "KV",
    "GGUFFile",
    "TensorInfo",
    "TensorSource",
    "copy_range",
    "decode_array",
    "encode_kv",
    "read_gguf",
    "tensor_nbytes",
    "write_gguf",
]

#: First read of a header; later reads grow geometrically toward the cursor's lower bound of the header's end.
_FIRST_READ = 1 << 20


@attrs.frozen
class GGUFFile:
    path: Path
    version: int
    kvs: dict[str, KV]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    file_size: int

    @classmethod
    def from_header(cls, path: Path, header: GGUFHeader, file_size: int) -> GGUFFile:
        return cls(path, header.version, header.kvs, header.tensors, header.alignment, header.data_offset, file_size)

    def get(self, key: str, default: Any = None) -> Any:
        kv = self.kvs.get(key)
        if kv is None:
            return default
        if kv.value is None and kv.vtype == GGUFValueType.ARRAY:
            return decode_array(kv)
        return kv.value

    def get_int(self, key: str, default: int, *, low: int = 0, high: int = 1 << 62) -> int:
        """An integer metadata value in [low, high]; any other type or value is a corrupt file, not a crash later."""
        value = self.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ModelFileError(f"{self.path}: GGUF {key} is {str(value)[:40]}, not an integer in [{low}, {high}]")
        return value


def read_gguf(path: Path, *, limits: HeaderLimits = DEFAULT_LIMITS) -> GGUFFile:
    """Parse the header of ``path`` (only the header is read); every defect becomes one :class:`ModelFileError`."""
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if not path.is_file():
        raise ModelFileError(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        if size < PREAMBLE_BYTES:
            raise ModelFileError(f"{path}: not a GGUF file (only {size} bytes)")
        cursor = HeaderCursor(str(path), limits=limits, file_size=size)
        with path.open("rb") as fh:
            step = cursor.feed(fh.read(min(size, _FIRST_READ)))
            while isinstance(step, NeedBytes):
                have = cursor.buffered
                # Reading past the header's end costs nothing here (unlike over HTTP): read in doubling steps,
                # never past the cap (the cursor refuses a header that needs more).
                want = min(max(step.header_ends_after, 2 * have), limits.max_header_bytes) - have
                chunk = fh.read(max(want, step.at_least - have))
                if not chunk:
                    raise ModelFileError(f"{path}: truncated GGUF header")
                step = cursor.feed(chunk)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read ({exc.strerror})") from None
    return GGUFFile.from_header(path, step, size)


# ---------------------------------------------------------------------------------------------------- writing


def encode_kv(key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> KV:
    out = bytearray(struct.pack("<I", vtype))
    if vtype in SCALAR_STRUCTS:
        out += SCALAR_STRUCTS[vtype].pack(value)
    elif vtype == GGUFValueType.STRING:
        out += _encode_string(value)
    elif vtype == GGUFValueType.ARRAY:
        assert sub_type is not None
        out += struct.pack("<IQ", sub_type, len(value))
        for v in value:
            out += _encode_string(v) if sub_type == GGUFValueType.STRING else SCALAR_STRUCTS[sub_type].pack(v)
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
