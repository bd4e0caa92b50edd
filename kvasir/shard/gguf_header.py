"""The one GGUF (v2/v3) header parser: a bounded, sans-IO cursor.

:class:`HeaderCursor` is fed bytes in order and answers either the parsed :class:`GGUFHeader` or
:class:`NeedBytes`: "buffer at least ``at_least`` bytes; the header ends after at least ``header_ends_after``". A
file reader (:func:`kvasir.shard.gguf_io.read_gguf`) feeds it from disk in large reads; the HTTP Range fetcher
(:mod:`kvasir.shard.fetch`) asks for exactly ``[buffered, header_ends_after)`` so no request reaches past the header.

The header is untrusted input (a market source may be hostile), so every length and count is checked against
:class:`HeaderLimits` before anything is buffered or allocated for it, and every value the rest of Kvasir relies on
(alignment, dims, tensor types, offsets) is checked too. Every defect is one :class:`ModelFileError` line.
Format reference: ggml's ``docs/gguf.md``; the value checks follow llama.cpp's ``gguf.cpp``.
"""

from __future__ import annotations

import struct
from collections.abc import Generator
from typing import Any

import attrs
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from kvasir.core.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
#: ggml's GGML_MAX_DIMS.
MAX_DIMS = 4
#: Bytes of the fixed preamble: magic, version, tensor count, KV count.
PREAMBLE_BYTES = 24
_INT64_MAX = (1 << 63) - 1

SCALAR_STRUCTS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_INTEGER = frozenset(
    {
        GGUFValueType.UINT8,
        GGUFValueType.INT8,
        GGUFValueType.UINT16,
        GGUFValueType.INT16,
        GGUFValueType.UINT32,
        GGUFValueType.INT32,
        GGUFValueType.UINT64,
        GGUFValueType.INT64,
    }
)
_STRING, _ARRAY = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
#: Smallest encodings, for lower bounds of the header's end: key length + type + one byte of value; name length +
#: n_dims + type + offset.
_KV_MIN = 8 + 4 + 1
_TENSOR_MIN = 8 + 4 + 4 + 8
#: Arrays longer than this keep only their raw bytes (vocabularies); their value is decoded on demand.
DECODE_LIMIT = 4096


@attrs.frozen
class HeaderLimits:
    """Caps on what a header may claim, checked before anything is buffered or allocated for it."""

    #: Magic to the end of the tensor infos. Gemma 3's 262k-token vocabulary needs about 6 MiB.
    max_header_bytes: int = 64 << 20
    #: One string (a key, a value, a tensor name); whole tokenizer JSONs have been stored as one string.
    max_string_bytes: int = 16 << 20
    max_array_len: int = 1 << 24
    max_kvs: int = 1 << 16
    max_tensors: int = 1 << 20


DEFAULT_LIMITS = HeaderLimits()


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
        return int(_U64.unpack_from(self.raw, 8)[0])

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
class GGUFHeader:
    """A parsed header: everything before the tensor data."""

    version: int
    kvs: dict[str, KV]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    #: End of the tensor infos: the bytes a fetch needs.
    header_end: int
    #: ``header_end`` rounded up to ``alignment``: where tensor data starts.
    data_offset: int


@attrs.frozen
class NeedBytes:
    """The cursor cannot go on until ``at_least`` bytes are buffered; the header ends after ``header_ends_after``."""

    at_least: int
    header_ends_after: int


def tensor_nbytes(shape: tuple[int, ...] | list[int], qtype: GGMLQuantizationType) -> int:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= int(d)
    if shape and int(shape[0]) % block:
        raise ValueError(f"row length {shape[0]} is not a multiple of the {qtype.name} block size {block}")
    return n // block * type_size


def decode_array(kv: KV) -> list[Any]:
    """The elements of an array value kept as raw bytes only (longer than :data:`DECODE_LIMIT`)."""
    raw = kv.raw
    sub, n = int(_U32.unpack_from(raw, 4)[0]), int(_U64.unpack_from(raw, 8)[0])
    if sub != _STRING:
        return list(struct.unpack_from(f"<{n}{SCALAR_STRUCTS[sub].format[1:]}", raw, 16))
    out: list[Any] = []
    pos = 16
    try:
        for _ in range(n):
            (size,) = _U64.unpack_from(raw, pos)
            out.append(raw[pos + 8 : pos + 8 + size].decode("utf-8"))
            pos += 8 + size
    except UnicodeDecodeError:
        raise ModelFileError(f"{kv.key}: corrupt GGUF (invalid UTF-8 in a string)") from None
    return out


class HeaderCursor:
    """Parse a GGUF header from bytes fed in order; see the module docstring.

    ``name`` prefixes every error (a path or a URL). ``file_size``, when known, rejects a header or tensor that
    claims to reach past the end of the file as soon as the claim is read.
    """

    def __init__(self, name: str, *, limits: HeaderLimits = DEFAULT_LIMITS, file_size: int | None = None) -> None:
        self.name = name
        self.limits = limits
        self.file_size = file_size
        self._buf = bytearray()
        self._steps = self._parse()
        self._step: GGUFHeader | NeedBytes | None = None
        self._failed: ModelFileError | None = None

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> GGUFHeader | NeedBytes:
        """Append ``data`` and parse as far as it goes (bytes past the cap are dropped: no header reaches them)."""
        if self._failed is not None:
            raise self._failed
        if isinstance(self._step, GGUFHeader):
            return self._step
        self._buf += memoryview(data)[: max(self.limits.max_header_bytes - len(self._buf), 0)]
        if isinstance(self._step, NeedBytes) and len(self._buf) < self._step.at_least:
            return self._step
        try:
            self._step = next(self._steps)
        except StopIteration as stop:
            self._step = stop.value
        except ModelFileError as exc:
            self._failed = exc
            raise
        assert self._step is not None
        return self._step

    # -------------------------------------------------------------------------------------------- the parse

    def _fail(self, what: str) -> ModelFileError:
        return ModelFileError(f"{self.name}: {what}")

    def _need(self, at_least: int, header_ends_after: int) -> NeedBytes:
        """What to ask for next, after checking that the header may still be that long."""
        if header_ends_after > self.limits.max_header_bytes:
            raise self._fail(
                f"GGUF header too large (at least {header_ends_after:,} bytes, the cap is "
                f"{self.limits.max_header_bytes:,})"
            )
        if self.file_size is not None and header_ends_after > self.file_size:
            raise self._fail(
                f"truncated GGUF header (it needs at least {header_ends_after:,} bytes, the file has "
                f"{self.file_size:,})"
            )
        return NeedBytes(at_least, max(at_least, header_ends_after))

    def _check_end(self, end: int) -> int:
        """``end``, once it is known that the header may reach that far (the cap, the file's size)."""
        if end > self.limits.max_header_bytes or (self.file_size is not None and end > self.file_size):
            self._need(end, end)  # raises
        return end

    def _string_end(self, n: int, start: int) -> int:
        if n > self.limits.max_string_bytes:
            raise self._fail(f"corrupt GGUF (a string of {n:,} bytes, the cap is {self.limits.max_string_bytes:,})")
        return self._check_end(start + n)

    def _text(self, start: int, end: int) -> str:
        try:
            return self._buf[start:end].decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail("corrupt GGUF (invalid UTF-8 in a string)") from None

    def _parse(self) -> Generator[NeedBytes, None, GGUFHeader]:
        buf, lim, u64, u32 = self._buf, self.limits, _U64.unpack_from, _U32.unpack_from
        while len(buf) < PREAMBLE_BYTES:
            yield self._need(PREAMBLE_BYTES, PREAMBLE_BYTES)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise self._fail(f"not a GGUF file (bad magic {bytes(buf[:4])!r})")
        (version,) = u32(buf, 4)
        if version not in (2, 3):
            raise self._fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = u64(buf, 8)[0], u64(buf, 16)[0]
        if n_kv > lim.max_kvs or n_tensors > lim.max_tensors:
            raise self._fail(
                f"corrupt GGUF ({n_kv:,} keys and {n_tensors:,} tensors, the caps are {lim.max_kvs:,} and "
                f"{lim.max_tensors:,})"
            )
        pos = PREAMBLE_BYTES
        tail = n_tensors * _TENSOR_MIN  # the tensor infos still to come
        kvs: dict[str, KV] = {}
        for k in range(n_kv):
            rest = (n_kv - k - 1) * _KV_MIN + tail
            while len(buf) < pos + 8:
                yield self._need(pos + 8, pos + _KV_MIN + rest)
            key_end = self._string_end(u64(buf, pos)[0], pos + 8)
            while len(buf) < key_end + 4:
                yield self._need(key_end + 4, key_end + 5 + rest)
            key = self._text(pos + 8, key_end)
            if key in kvs:
                raise self._fail(f"corrupt GGUF (key {key!r} appears twice)")
            start = key_end
            vtype = u32(buf, start)[0]
            pos = start + 4
            value: Any = None
            sub: int | None = None
            if vtype in SCALAR_STRUCTS:
                fmt = SCALAR_STRUCTS[vtype]
                while len(buf) < pos + fmt.size:
                    yield self._need(pos + fmt.size, pos + fmt.size + rest)
                value = fmt.unpack_from(buf, pos)[0]
                pos += fmt.size
            elif vtype == _STRING:
                while len(buf) < pos + 8:
                    yield self._need(pos + 8, pos + 8 + rest)
                end = self._string_end(u64(buf, pos)[0], pos + 8)
                while len(buf) < end:
                    yield self._need(end, end + rest)
                value = self._text(pos + 8, end)
                pos = end
            elif vtype == _ARRAY:
                while len(buf) < pos + 12:
                    yield self._need(pos + 12, pos + 12 + rest)
                sub, n = u32(buf, pos)[0], u64(buf, pos + 4)[0]
                pos += 12
                if n > lim.max_array_len:
                    raise self._fail(f"corrupt GGUF (an array of {n:,} elements, the cap is {lim.max_array_len:,})")
                if sub in SCALAR_STRUCTS:
                    fmt = SCALAR_STRUCTS[sub]
                    end = self._check_end(pos + n * fmt.size)
                    while len(buf) < end:
                        yield self._need(end, end + rest)
                    if n <= DECODE_LIMIT:
                        value = list(struct.unpack_from(f"<{n}{fmt.format[1:]}", buf, pos))
                    pos = end
                elif sub == _STRING:
                    max_header, max_string = lim.max_header_bytes, lim.max_string_bytes
                    self._check_end(pos + 8 * n)
                    decode = n <= DECODE_LIMIT
                    strings: list[str] = []
                    for i in range(n):
                        while len(buf) < pos + 8:
                            yield self._need(pos + 8, pos + 8 * (n - i) + rest)
                        size = u64(buf, pos)[0]
                        if size > max_string:
                            self._string_end(size, pos)
                        pos += 8 + size
                        if pos > max_header:
                            self._need(pos, pos)
                        if decode:
                            while len(buf) < pos:
                                yield self._need(pos, pos + 8 * (n - i - 1) + rest)
                            strings.append(self._text(pos - size, pos))
                    while len(buf) < pos:
                        yield self._need(pos, pos + rest)
                    value = strings if decode else None
                elif sub == _ARRAY:
                    raise self._fail("corrupt GGUF (nested arrays are not supported)")
                else:
                    raise self._fail(f"corrupt GGUF (an array of unknown value type {sub})")
            else:
                raise self._fail(f"corrupt GGUF (unknown value type {vtype})")
            kvs[key] = KV(
                key,
                GGUFValueType(vtype),
                bytes(buf[start:pos]),
                value,
                GGUFValueType(sub) if sub is not None else None,
            )
        alignment = self._alignment(kvs.get("general.alignment"))

        raw_tensors: list[tuple[str, tuple[int, ...], int, int]] = []
        names: set[str] = set()
        for t in range(n_tensors):
            rest = (n_tensors - t - 1) * _TENSOR_MIN
            while len(buf) < pos + 8:
                yield self._need(pos + 8, pos + _TENSOR_MIN + rest)
            name_end = self._string_end(u64(buf, pos)[0], pos + 8)
            while len(buf) < name_end + 4:
                yield self._need(name_end + 4, name_end + 16 + rest)
            name = self._text(pos + 8, name_end)
            if name in names:
                raise self._fail(f"corrupt GGUF (tensor {name} appears twice)")
            names.add(name)
            n_dims = u32(buf, name_end)[0]
            if n_dims > MAX_DIMS:
                raise self._fail(f"corrupt GGUF (tensor {name} has {n_dims} dims, at most {MAX_DIMS})")
            pos = name_end + 4
            end = self._check_end(pos + 8 * n_dims + 4 + 8)
            while len(buf) < end:
                yield self._need(end, end + rest)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            ggml_type, rel = u32(buf, end - 12)[0], u64(buf, end - 8)[0]
            pos = end
            raw_tensors.append((name, shape, ggml_type, rel))
        header_end = pos
        data_offset = header_end + (-header_end) % alignment
        tensors = tuple(self._tensor(*raw, alignment, data_offset) for raw in raw_tensors)
        return GGUFHeader(int(version), kvs, tensors, alignment, header_end, data_offset)

    def _alignment(self, kv: KV | None) -> int:
        if kv is None:
            return DEFAULT_ALIGNMENT
        if kv.vtype not in _INTEGER:
            raise self._fail(f"corrupt GGUF (general.alignment is a {kv.vtype.name}, not an integer)")
        alignment = int(kv.value)
        if alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 30:
            raise self._fail(f"corrupt GGUF (general.alignment {alignment} is not a power of two up to 2^30)")
        return alignment

    def _tensor(
        self, name: str, shape: tuple[int, ...], ggml_type: int, rel: int, alignment: int, data_offset: int
    ) -> TensorInfo:
        elements = 1
        for d in shape:
            if d <= 0 or d > _INT64_MAX:
                raise self._fail(f"corrupt GGUF (tensor {name} has dimension {d})")
            elements *= d
        if elements > _INT64_MAX:
            raise self._fail(f"corrupt GGUF (tensor {name} has {elements:,} elements)")
        try:
            qtype = GGMLQuantizationType(ggml_type)
            nbytes = tensor_nbytes(shape, qtype)
        except (ValueError, KeyError):
            raise self._fail(f"corrupt GGUF (tensor {name} has bad type {ggml_type} or shape {shape})") from None
        if rel % alignment:
            raise self._fail(f"corrupt GGUF (tensor {name} at offset {rel} is not aligned to {alignment})")
        offset = data_offset + rel
        if self.file_size is not None and offset + nbytes > self.file_size:
            raise self._fail(f"truncated GGUF (tensor {name} ends past the end of the file)")
        return TensorInfo(name, tuple(int(d) for d in shape), qtype, offset, nbytes)
