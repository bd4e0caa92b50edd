"""The one GGUF header parser (kvasir.shard.gguf_header): hostile bytes and values give a parsed header or one
ModelFileError, never another exception, a hang or an allocation the bytes do not pay for; fed in any chunks, it
parses what read_gguf parses."""

from __future__ import annotations

import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvasir.core.errors import ModelFileError
from kvasir.shard.gguf_header import GGUFHeader, HeaderCursor, HeaderLimits, NeedBytes
from kvasir.shard.gguf_io import GGUFFile, read_gguf

#: Per example: wall time and peak traced allocation. The fuzzed files are a few KiB, so a parser that allocated
#: for what a header *claims* (2^40 elements) instead of what it holds would blow through this by far.
TIME_GUARD_S = 0.5
ALLOC_GUARD = 1 << 20

F32 = int(GGMLQuantizationType.F32)
Q8_0 = int(GGMLQuantizationType.Q8_0)


# ------------------------------------------------------------------------------------------- building headers


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + payload


def u32(key: str, v: int) -> bytes:
    return kv(key, GGUFValueType.UINT32, struct.pack("<I", v))


def tensor(name: str, dims: list[int], ggml_type: int = F32, offset: int = 0) -> bytes:
    return s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


def gguf(
    kvs: list[bytes],
    tensors: list[bytes],
    *,
    data: int = 0,
    alignment: int = 32,
    n_kv: int | None = None,
    n_tensors: int | None = None,
) -> bytes:
    """A whole file: header, padding to ``alignment`` and ``data`` zero bytes of tensor data."""
    n_kv = len(kvs) if n_kv is None else n_kv
    n_tensors = len(tensors) if n_tensors is None else n_tensors
    head = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)
    return head + b"\0" * ((-len(head)) % alignment) + b"\0" * data


def parse(
    data: bytes, chunk: int = 1 << 30, limits: HeaderLimits | None = None, file_size: int | None = None
) -> GGUFHeader | NeedBytes:
    """Feed ``data`` in chunks. When it is the whole file (``file_size`` None), the answer is a header or a
    ModelFileError; when the file goes on, the cursor may ask for more."""
    size = len(data) if file_size is None else file_size
    cursor = HeaderCursor("test.gguf", limits=limits or HeaderLimits(), file_size=size)
    step = cursor.feed(b"")
    for at in range(0, len(data), chunk):
        step = cursor.feed(data[at : at + chunk])
        if isinstance(step, GGUFHeader):
            return step
    assert not (isinstance(step, NeedBytes) and size == len(data)), f"asked for more than the whole file: {step}"
    return step


def header_of(data: bytes, limits: HeaderLimits | None = None, file_size: int | None = None) -> GGUFHeader:
    step = parse(data, limits=limits, file_size=file_size)
    assert isinstance(step, GGUFHeader)
    return step


@contextmanager
def guarded() -> Iterator[None]:
    tracemalloc.start()
    began = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - began
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert elapsed < TIME_GUARD_S, f"took {elapsed:.3f} s"
        assert peak < ALLOC_GUARD, f"allocated {peak:,} bytes"


def outcome(
    data: bytes, chunk: int = 1 << 30, limits: HeaderLimits | None = None, file_size: int | None = None
) -> GGUFHeader | NeedBytes | ModelFileError:
    """Parse under the time and allocation guards; any exception but ModelFileError fails the test."""
    with guarded():
        try:
            return parse(data, chunk, limits, file_size)
        except ModelFileError as exc:
            assert "\n" not in str(exc)
            return exc


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def valid_header(tiny_model: Callable[..., Path]) -> tuple[bytes, int]:
    """A real header (gemma3: tokenizer arrays, chat template, per-layer tensors) and its file's size."""
    model = tiny_model("gemma3", "f32")
    gg = read_gguf(model)
    return model.read_bytes()[: gg.data_offset], gg.file_size


# ------------------------------------------------------------------------------------------------- fuzzing


@FUZZ
@given(st.binary(max_size=2048))
def test_random_bytes(data: bytes) -> None:
    assert isinstance(outcome(data), ModelFileError | GGUFHeader)


@FUZZ
@given(st.binary(max_size=2048), st.integers(1, 64))
def test_random_bytes_after_a_valid_preamble(tail: bytes, chunk: int) -> None:
    assert isinstance(outcome(b"GGUF" + struct.pack("<I", 3) + tail, chunk), ModelFileError | GGUFHeader)


@FUZZ
@given(data=st.data())
def test_mutated_real_headers(valid_header: tuple[bytes, int], data: st.DataObject) -> None:
    header, file_size = valid_header
    b = bytearray(header)
    flips = data.draw(st.integers(0, 6), label="flips")
    for _ in range(flips):
        b[data.draw(st.integers(4, len(b) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(b)), label="truncate at")
    chunk = data.draw(st.sampled_from([7, 4096, 1 << 30]), label="chunk")
    whole = cut == len(b)  # else the file ends at the cut
    result = outcome(bytes(b[:cut]), chunk, file_size=file_size if whole else None)
    assert isinstance(result, ModelFileError | GGUFHeader | NeedBytes)
    if flips == 0:  # the whole header parses, a cut one is an error
        assert isinstance(result, GGUFHeader) if whole else isinstance(result, ModelFileError)


@FUZZ
@given(st.integers(0, (1 << 32) - 1))
def test_alignment_must_be_a_power_of_two(alignment: int) -> None:
    data = gguf([u32("general.alignment", alignment)], [tensor("t", [8])], data=32, alignment=1)
    result = outcome(data)
    if alignment and not alignment & (alignment - 1) and alignment <= 1 << 30:
        # Valid, but the data padding this file has may not fit: then it says so, as a ModelFileError.
        assert isinstance(result, GGUFHeader) or "past the end" in str(result)
    else:
        assert isinstance(result, ModelFileError) and "power of two" in str(result)


@FUZZ
@given(st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=4), st.integers(0, 4096))
def test_dims_must_be_positive_and_fit_the_file(dims: list[int], data_bytes: int) -> None:
    result = outcome(gguf([], [tensor("t", dims)], data=data_bytes))
    elements = 1
    for d in dims:
        elements *= d
    if all(0 < d < 1 << 63 for d in dims) and elements * 4 <= data_bytes:
        assert isinstance(result, GGUFHeader) and result.tensors[0].nbytes == elements * 4
    else:
        assert isinstance(result, ModelFileError)


@FUZZ
@given(
    st.sampled_from(["n_kv", "n_tensors", "string", "u8 array", "string array", "key"]),
    st.integers(1 << 20, (1 << 64) - 1),
)
def test_huge_claims_allocate_nothing(field: str, n: int) -> None:
    """A count or length the bytes do not back fails under the allocation guard, even with every count cap off."""
    no_count_caps = HeaderLimits(max_string_bytes=1 << 62, max_array_len=1 << 62, max_kvs=1 << 62, max_tensors=1 << 62)
    arr = GGUFValueType.ARRAY
    cases = {
        "n_kv": gguf([], [], n_kv=n),
        "n_tensors": gguf([], [], n_tensors=n),
        "string": kv("k", GGUFValueType.STRING, struct.pack("<Q", n)),
        "u8 array": kv("k", arr, struct.pack("<IQ", GGUFValueType.UINT8, n)),
        "string array": kv("k", arr, struct.pack("<IQ", GGUFValueType.STRING, n) + s("a") * 3),
        "key": struct.pack("<Q", n) + b"k",
    }
    data = cases[field]
    if not data.startswith(b"GGUF"):
        data = gguf([data], [])
    for limits in (None, no_count_caps):
        assert isinstance(outcome(data, limits=limits), ModelFileError)


def test_claimed_2_40_element_arrays_fail_without_allocating() -> None:
    arr = GGUFValueType.ARRAY
    for sub in (GGUFValueType.UINT8, GGUFValueType.FLOAT64, GGUFValueType.STRING):
        data = gguf([kv("k", arr, struct.pack("<IQ", sub, 1 << 40))], [])
        for limits in (None, HeaderLimits(max_array_len=1 << 62)):
            result = outcome(data, 4096, limits)
            assert isinstance(result, ModelFileError)
            assert ("cap" if limits is None else "too large") in str(result)


# --------------------------------------------------------------------------------------------- value cases


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (gguf([u32("general.alignment", 0)], []), "power of two"),
        (gguf([u32("general.alignment", 3)], []), "power of two"),
        (gguf([kv("general.alignment", GGUFValueType.STRING, s("32"))], []), "not an integer"),
        (gguf([], [tensor("t", [0])], data=64), "dimension 0"),
        (gguf([], [tensor("t", [1 << 63])], data=64), "dimension"),
        (gguf([], [tensor("t", [1 << 32, 1 << 32])], data=64), "elements"),
        (gguf([], [tensor("t", [1 << 31, 1 << 31])], data=64), "past the end"),
        (gguf([], [tensor("t", [8], offset=8)], data=64), "not aligned"),
        (gguf([], [tensor("t", [8], offset=1 << 40)], data=64), "past the end"),
        (gguf([], [tensor("t", [1, 1, 1, 1, 1])], data=64), "5 dims"),
        (gguf([], [tensor("t", [8], ggml_type=999)], data=64), "bad type 999"),
        (gguf([], [tensor("t", [33], ggml_type=Q8_0)], data=64), "bad type"),
        (gguf([], [tensor("t", [8]), tensor("t", [8], offset=32)], data=64), "appears twice"),
        (gguf([u32("a", 1), u32("a", 2)], []), "appears twice"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + u32("a", 1), "truncated"),
        (gguf([kv(b"\xff\xfe", GGUFValueType.UINT32, b"\0" * 4)], []), "UTF-8"),
        (gguf([kv("a", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.ARRAY, 1))], []), "nested"),
        (gguf([kv("a", 77, b"")], []), "unknown value type 77"),
        (b"GGUF" + struct.pack("<IQQ", 4, 0, 0), "version 4"),
        (b"GGML" + struct.pack("<IQQ", 3, 0, 0), "bad magic"),
    ],
)
def test_bad_values_are_one_line_errors(data: bytes, message: str) -> None:
    result = outcome(data)
    assert isinstance(result, ModelFileError), result
    assert message in str(result)


def test_alignment_sets_the_data_offset() -> None:
    data = gguf([u32("general.alignment", 64)], [tensor("a", [8]), tensor("b", [8], offset=64)], data=96, alignment=64)
    header = header_of(data)
    assert header.alignment == 64 and header.data_offset % 64 == 0
    assert [t.offset - header.data_offset for t in header.tensors] == [0, 64]


def test_header_cap(valid_header: tuple[bytes, int]) -> None:
    header, file_size = valid_header
    end = header_of(header, file_size=file_size).header_end
    assert header_of(header, file_size=file_size, limits=HeaderLimits(max_header_bytes=end)).header_end == end
    with pytest.raises(ModelFileError, match="header too large"):
        parse(header, file_size=file_size, limits=HeaderLimits(max_header_bytes=end - 1))


def test_a_failed_cursor_stays_failed() -> None:
    cursor = HeaderCursor("x")
    with pytest.raises(ModelFileError, match="bad magic"):
        cursor.feed(b"GGML" + bytes(20))
    with pytest.raises(ModelFileError, match="bad magic"):
        cursor.feed(b"more")


# ----------------------------------------------------------------------------------------- against read_gguf


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35moe"])
def test_any_chunking_parses_what_read_gguf_parses(arch: str, tiny_model: Callable[..., Path]) -> None:
    model = tiny_model(arch, "f32")
    want = read_gguf(model)
    raw = model.read_bytes()
    for chunk in (1, 7, 4096):
        cursor = HeaderCursor(str(model), file_size=len(raw))
        step: GGUFHeader | NeedBytes = cursor.feed(b"")
        at = 0
        while isinstance(step, NeedBytes):
            step = cursor.feed(raw[at : at + chunk])
            at += chunk
        assert at - chunk < want.data_offset  # it answered as soon as it had the header
        assert GGUFFile.from_header(model, step, len(raw)) == want
    assert isinstance(want.get("tokenizer.ggml.tokens"), list)


def test_read_gguf_on_hostile_files(tmp_path: Path) -> None:
    target = tmp_path / "bad.gguf"
    target.write_bytes(gguf([u32("general.alignment", 0)], []))
    with pytest.raises(ModelFileError, match=f"{target}: corrupt GGUF .*power of two"):
        read_gguf(target)
    target.write_bytes(gguf([kv("k", GGUFValueType.ARRAY, struct.pack("<IQ", GGUFValueType.UINT8, 1 << 40))], []))
    with guarded(), pytest.raises(ModelFileError):
        read_gguf(target)


def test_the_cursor_never_buffers_past_the_cap() -> None:
    limits = HeaderLimits(max_header_bytes=100)
    cursor = HeaderCursor("x", limits=limits)
    data = gguf([kv("k", GGUFValueType.STRING, s("v" * 50))], [])
    assert len(data) < 100
    assert isinstance(cursor.feed(data + bytes(10_000)), GGUFHeader) and cursor.buffered == 100
    cursor = HeaderCursor("x", limits=limits)
    with pytest.raises(ModelFileError, match="header too large"):
        cursor.feed(gguf([kv("k", GGUFValueType.STRING, s("v" * 100))], []) + bytes(10_000))
    assert cursor.buffered == 100
