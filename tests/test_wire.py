"""Wire protocol: round trips, exact boundaries, and every malformed frame refused with ProtocolError."""

from __future__ import annotations

import math
import random
import re
import struct
from collections.abc import Callable

import attrs
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir.core.errors import InputError, ProtocolError, RingError, ShapeError
from kvasir.core.sampling import SamplingError
from kvasir.wire import (
    CHAIN_BYTES,
    FLAG_CHAIN,
    FLAG_DRAFTS,
    FLAG_FINAL,
    FLAG_PARAMS,
    HEADER_SIZE,
    MAX_BOUNDARY_TOKENS,
    MAX_DRAFTS,
    MAX_ERROR_MESSAGE_BYTES,
    MAX_FRAME_BYTES,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MIN_FRAME_LIMIT,
    PARAMS_BYTES,
    PROTOCOL_VERSION,
    Boundary,
    BoundaryDType,
    Cancel,
    End,
    EndReason,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameReader,
    FrameType,
    Hello,
    Keepalive,
    SamplingParams,
    Side,
    StartRequest,
    Token,
    check_neighbour,
    choose_dtype,
    decode_boundary,
    decode_frame,
    decode_header,
    encode_boundary,
    max_chunk_tokens,
    measure_divergence,
    neighbour_problem,
    prompt_digest,
    request_params_hash,
)
from kvasir.wire.stream import READ_CHUNK

HYPO = settings(max_examples=60, deadline=None)

# ------------------------------------------------------------------------------------------------ strategies

ids = st.text(alphabet="abcdefABCDEF0123456789-_.:é☃", min_size=1, max_size=40)
request_ids = st.integers(1, 2**64 - 1)
latest = st.integers(-1, 2**31 - 1)
token_ids = st.integers(0, 2**31 - 1)
ranks = st.integers(0, 4095)
utf8_text = st.text(st.characters(codec="utf-8"), max_size=60)

sampling_params = st.builds(
    SamplingParams,
    temperature=st.floats(0, 100),
    top_k=st.integers(0, 2**31 - 1),
    top_p=st.floats(0, 1, exclude_min=True),
    min_p=st.floats(0, 1),
    repeat_penalty=st.floats(0, 100, exclude_min=True),
    repeat_last_n=st.integers(-1, 4096),
    seed=st.none() | st.integers(0, 2**32 - 2),
)


@st.composite
def hellos(draw: st.DrawFn) -> Hello:
    ring_size = draw(st.integers(1, 64))
    n_layers = draw(st.integers(1, 200))
    start = draw(st.integers(0, n_layers - 1))
    return Hello(
        node_id=draw(ids),
        model_id=draw(ids),
        rank=draw(st.integers(0, ring_size - 1)),
        ring_size=ring_size,
        window_start=start,
        window_end=draw(st.integers(start + 1, n_layers)),
        n_layers=n_layers,
        n_embd=draw(st.integers(1, 65536)),
        max_frame_bytes=draw(st.integers(MIN_FRAME_LIMIT, 2**32 - 1)),
        dtypes=frozenset({BoundaryDType.F32}) | draw(st.frozensets(st.sampled_from(BoundaryDType))),
    )


starts = st.builds(
    StartRequest,
    request_id=request_ids,
    prompt=st.lists(token_ids, min_size=1, max_size=50),
    max_tokens=st.integers(1, 1 << 20),
    entry_rank=ranks,
    entry_node_id=ids,
    sampling=sampling_params,
    stop=st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=40), max_size=MAX_STOP_STRINGS),
    speculate=st.integers(0, MAX_DRAFTS),
)


@st.composite
def boundaries(draw: st.DrawFn) -> Boundary:
    dtype = draw(st.sampled_from(BoundaryDType))
    n_tokens = draw(st.integers(1, 6))
    n_embd = draw(st.integers(1, 24))
    payload = draw(st.binary(min_size=n_tokens * n_embd * dtype.itemsize, max_size=n_tokens * n_embd * dtype.itemsize))
    chain = draw(st.binary(min_size=CHAIN_BYTES, max_size=CHAIN_BYTES)) if draw(st.booleans()) else b""
    if n_tokens == 1 and draw(st.booleans()):  # a row of a speculative verify batch, which carries the drafts
        drafts = draw(st.lists(token_ids, min_size=1, max_size=MAX_DRAFTS))
        row = draw(st.integers(0, len(drafts)))
        return Boundary(
            draw(request_ids), draw(st.integers(0, 2**31 - 2 - row)), n_tokens, n_embd, dtype, payload,
            final=True, latest_token=draw(token_ids), drafts=tuple(drafts), chain=chain, row=row,
        )  # fmt: skip
    return Boundary(
        request_id=draw(request_ids),
        first_position=draw(st.integers(0, 2**31 - 1 - n_tokens)),
        n_tokens=n_tokens,
        n_embd=n_embd,
        dtype=dtype,
        payload=payload,
        final=draw(st.booleans()),
        latest_token=draw(latest),
        chain=chain,
    )


frames: st.SearchStrategy[Frame] = st.one_of(
    hellos(),
    starts,
    boundaries(),
    st.builds(Token, request_id=request_ids, position=st.integers(0, 2**31 - 2), token_id=token_ids),
    st.builds(
        Token,
        request_id=request_ids,
        position=st.integers(0, 2**31 - 2 - MAX_DRAFTS),
        token_id=token_ids,
        drafts=st.lists(token_ids, max_size=MAX_DRAFTS).map(tuple),
    ),
    st.builds(
        End,
        request_id=request_ids,
        reason=st.sampled_from(EndReason),
        prompt_tokens=st.integers(0, 1 << 20),
        generated_tokens=st.integers(0, 1 << 20),
        origin_rank=ranks,
        latest_token=latest,
    ),
    st.builds(Cancel, request_id=request_ids, origin_rank=ranks, latest_token=latest),
    st.builds(
        Error,
        code=st.sampled_from(ErrorCode),
        message=utf8_text,
        origin_rank=ranks,
        request_id=st.integers(0, 2**64 - 1),
        latest_token=latest,
    ),
    st.just(Keepalive()),
)

# ------------------------------------------------------------------------------------------------ round trips


@HYPO
@given(frames)
def test_every_frame_round_trips(frame: Frame) -> None:
    wire = frame.to_wire()
    assert decode_frame(wire) == frame
    assert type(frame).from_wire(wire) == frame
    header = decode_header(wire)
    assert header.type is frame.TYPE
    assert header.frame_length == len(wire)
    assert header.request_id == frame.request_id
    assert header.latest_token == frame.latest_token


@HYPO
@given(st.lists(frames, min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_decoder_reassembles_any_fragmentation(sent: list[Frame], rnd: random.Random) -> None:
    wire = b"".join(f.to_wire() for f in sent)
    decoder = FrameDecoder()
    got: list[Frame] = []
    pos = 0
    while pos < len(wire):
        step = rnd.randint(1, 64)
        got += decoder.feed(wire[pos : pos + step])
        pos += step
    decoder.eof()
    assert got == sent
    assert decoder.buffered == 0


def test_from_wire_refuses_another_frame_type() -> None:
    with pytest.raises(ProtocolError, match="expected a TOKEN frame, got CANCEL"):
        Token.from_wire(Cancel(1, 0).to_wire())


def test_token_header_carries_the_token() -> None:
    assert decode_header(Token(5, 12, 777).to_wire()).latest_token == 777


def test_single_token_frames_keep_their_bytes() -> None:
    """Frames without speculation are byte for byte what a node that knows nothing of it sends and accepts."""
    assert Token(5, 12, 777).to_wire() == raw(
        FrameType.TOKEN, struct.pack("<Ii", 12, 777), request_id=5, latest_token=777
    )
    assert Token(5, 12, 777, drafts=(1, 2)).to_wire()[HEADER_SIZE:] == struct.pack("<Iiii", 12, 777, 1, 2)
    plain = Boundary(5, 3, 1, 1, BoundaryDType.F32, b"\0" * 4, final=True, latest_token=9).to_wire()
    assert plain[4:6] == struct.pack("<H", FLAG_FINAL)
    verify = Boundary(5, 3, 1, 1, BoundaryDType.F32, b"\0" * 4, final=True, latest_token=9, drafts=(4, 6), row=2)
    assert verify.to_wire()[4:6] == struct.pack("<H", FLAG_FINAL | FLAG_DRAFTS)
    assert verify.to_wire()[HEADER_SIZE + 16 :] == b"\0" * 4 + struct.pack("<Iii", 2, 4, 6)  # payload, row, drafts
    assert verify.position == 5 and Boundary.from_wire(verify.to_wire()) == verify
    assert b"".join(Boundary.from_wire(f).to_wire()[4:6] for f in (plain, verify.to_wire())) == struct.pack(
        "<HH", FLAG_FINAL, FLAG_FINAL | FLAG_DRAFTS
    )  # no chain head: nothing after the payload and drafts
    start = StartRequest(1, [1, 2], 3, 0, "n")
    assert start.to_wire()[HEADER_SIZE + 13 : HEADER_SIZE + 16] == b"\0\0\0"  # speculate 0: as the reserved bytes were
    assert StartRequest.from_wire(attrs.evolve(start, speculate=5).to_wire()).speculate == 5


def test_a_chain_head_follows_the_payload_and_the_drafts() -> None:
    """FLAG_CHAIN: 32 bytes after everything else; the same frame without it keeps its exact bytes."""
    head = bytes(range(CHAIN_BYTES))
    plain = Boundary(5, 3, 1, 2, BoundaryDType.F32, b"\1" * 8, final=True, latest_token=9)
    chained = attrs.evolve(plain, chain=head)
    wire = chained.to_wire()
    assert wire[4:6] == struct.pack("<H", FLAG_FINAL | FLAG_CHAIN)
    assert wire[HEADER_SIZE + 16 : HEADER_SIZE + 24] == b"\1" * 8 and wire.endswith(head)
    assert len(wire) == len(plain.to_wire()) + CHAIN_BYTES
    assert decode_header(wire).body_length == 16 + 8 + CHAIN_BYTES
    assert Boundary.from_wire(wire) == chained and Boundary.from_wire(wire).chain == head
    assert Boundary.from_wire(plain.to_wire()).chain == b""
    verify = Boundary(5, 3, 1, 1, BoundaryDType.F32, b"\0" * 4, final=True, latest_token=9, drafts=(4, 6), chain=head)
    assert verify.to_wire().endswith(struct.pack("<Iii", 0, 4, 6) + head)
    assert Boundary.from_wire(verify.to_wire()) == verify


def test_a_parameters_hash_commits_to_every_field_a_node_acts_on() -> None:
    """FLAG_PARAMS (issue 24, N8): the hash covers sampling, seed, max_tokens, stops, speculate, the prompt and who
    streams it; a withheld START carries the prompt's sha256 instead of its ids and hashes the same; the tail is the
    only difference on the wire, and END echoes it (with the last rank's chain head after it)."""
    start = StartRequest(5, (1, 2, 3), 4, 0, "node-a", SamplingParams(temperature=0.0), ("x",))
    committed = attrs.evolve(start, params_hash=request_params_hash(start))
    withheld = committed.withheld()
    assert len(committed.params_hash) == PARAMS_BYTES and withheld.prompt_sha256 == prompt_digest((1, 2, 3))
    assert request_params_hash(withheld) == committed.params_hash
    assert request_params_hash(start.withheld()) == b""  # no hash, no prompt digest: nothing to check by
    for frame in (committed, withheld):
        wire = frame.to_wire()
        assert wire[4:6] == struct.pack("<H", FLAG_PARAMS | (0x0002 if frame.withheld_length else 0))
        assert wire.endswith(committed.params_hash) and StartRequest.from_wire(wire) == frame
    assert len(committed.to_wire()) == len(start.to_wire()) + PARAMS_BYTES
    assert len(withheld.to_wire()) == len(start.withheld().to_wire()) + 2 * PARAMS_BYTES
    altered = [
        attrs.evolve(start, max_tokens=40),
        attrs.evolve(start, sampling=SamplingParams(temperature=1.5, seed=3)),
        attrs.evolve(start, stop=()),
        attrs.evolve(start, speculate=4),
        attrs.evolve(start, prompt=(1, 2, 4)),
        attrs.evolve(start, entry_rank=1),
        attrs.evolve(start, entry_node_id="node-b"),
        attrs.evolve(start, request_id=7),
    ]
    assert all(request_params_hash(a) != committed.params_hash for a in altered)
    head = bytes(range(CHAIN_BYTES))
    for end in (
        End(5, EndReason.EOG, 3, 1, 2, 7, committed.params_hash, head),
        End(5, EndReason.STOP, 3, 1, 2, 7, b"", head),
    ):
        assert End.from_wire(end.to_wire()) == end
    echo = End(5, EndReason.MAX_TOKENS, 3, 4, 2, 7, committed.params_hash)
    assert echo.to_wire()[4:6] == struct.pack("<H", FLAG_PARAMS) and End.from_wire(echo.to_wire()) == echo
    with pytest.raises(ProtocolError, match="prompt's sha256 must be 32 bytes"):
        attrs.evolve(withheld, prompt_sha256=b"")
    with pytest.raises(ProtocolError, match="32 bytes after the fields, expected 64"):
        End.from_wire(_rebody(echo, 0, flags=FLAG_PARAMS | FLAG_CHAIN))


def test_a_withheld_start_with_a_one_byte_entry_id_decodes() -> None:
    """Review 2, N21: a withheld START whose entry node id is under 5 bytes encoded to a 67-70 byte body that every
    decoder refused (``body length 70 invalid``), so a member injecting one made an honest node close the link it
    forwarded it on. The smallest withheld body is 67 bytes now; one with token ids still needs one id."""
    start = StartRequest(5, (1, 2), 4, 0, "x", SamplingParams(temperature=0.0)).withheld()
    assert decode_header(start.to_wire()).body_length == 67
    assert StartRequest.from_wire(start.to_wire()) == start
    with pytest.raises(ProtocolError, match="body"):
        decode_frame(_rebody(attrs.evolve(start, withheld_length=0, prompt=(1,)), -4, flags=0))


def test_chunk_size_leaves_room_for_a_chain_head() -> None:
    n = max_chunk_tokens(MIN_FRAME_LIMIT, 1, BoundaryDType.F32)
    longest = attrs.evolve(Boundary.from_array(1, 0, _hidden(n, 1)), chain=b"\0" * CHAIN_BYTES)
    assert len(longest.to_wire()) <= MIN_FRAME_LIMIT < len(longest.to_wire()) + 4  # one more row would not fit


# ------------------------------------------------------------------------------------------------ boundaries


def _hidden(n_tokens: int = 7, n_embd: int = 64, scale: float = 40.0, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n_tokens, n_embd)) * scale).astype(np.float32)


def test_f32_boundary_is_bit_exact() -> None:
    array = _hidden()
    # Awkward values too: signed zero, subnormals, infinities, a NaN with a payload.
    specials = np.array([-0.0, 1e-45, -1e-40, np.inf, -np.inf, 3.4028235e38], dtype=np.float32)
    array[0, : len(specials)] = specials
    array.view(np.uint32)[1, 0] = 0x7FC0_1234
    frame = decode_frame(Boundary.from_array(9, 100, array, final=True, latest_token=5).to_wire())
    assert isinstance(frame, Boundary)
    assert frame.final and frame.first_position == 100 and frame.latest_token == 5
    out = frame.to_array()
    assert out.dtype == np.float32 and out.shape == array.shape
    assert out.tobytes() == array.tobytes()


@HYPO
@given(st.lists(st.floats(-60000, 60000, width=32), min_size=1, max_size=64))
def test_f16_error_is_bounded(values: list[float]) -> None:
    array = np.array([values], dtype=np.float32)
    out = decode_boundary(encode_boundary(array, BoundaryDType.F16), 1, len(values), BoundaryDType.F16)
    # Half of an f16 ulp: relative 2**-11 for normals, absolute 2**-25 below the normal range.
    bound = np.maximum(np.abs(array) * 2.0**-11, 2.0**-25)
    assert np.all(np.abs(out.astype(np.float64) - array) <= bound)


@HYPO
@given(st.lists(st.floats(-(2.0**126), 2.0**126, width=32), min_size=1, max_size=64))
def test_bf16_error_is_bounded(values: list[float]) -> None:
    array = np.array([values], dtype=np.float32)
    out = decode_boundary(encode_boundary(array, BoundaryDType.BF16), 1, len(values), BoundaryDType.BF16)
    bound = np.maximum(np.abs(array.astype(np.float64)) * 2.0**-8, 2.0**-134)
    assert np.all(np.abs(out.astype(np.float64) - array) <= bound)


def test_bf16_rounds_to_nearest_even_and_keeps_specials() -> None:
    bits = np.array(
        [
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x7F7F_FFFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7F80_0001,
            0x8000_0000,
        ],
        dtype=np.uint32,
    )
    out = np.frombuffer(encode_boundary(bits.view(np.float32).reshape(1, -1), BoundaryDType.BF16), "<u2")
    # tie to even down, tie to even up, above the tie, overflow to inf, +inf, -inf, NaN stays NaN, -0.
    assert out[:6].tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x7F80, 0xFF80]
    assert out[6] & 0x7F80 == 0x7F80 and out[6] & 0x007F  # still a NaN
    assert out[7] == 0x8000


def test_f16_refuses_values_it_cannot_hold() -> None:
    array = _hidden()
    array[2, 3] = 70000.0
    with pytest.raises(ProtocolError, match="exceeds the f16 range"):
        encode_boundary(array, BoundaryDType.F16)
    assert measure_divergence(array, BoundaryDType.F16).overflowed == 1
    assert math.isinf(measure_divergence(array, BoundaryDType.F16).max_abs)
    encode_boundary(array, BoundaryDType.BF16)  # bf16 has f32's range


def test_measure_divergence_reports_each_dtype() -> None:
    array = _hidden(n_tokens=16, n_embd=256)
    assert measure_divergence(array, BoundaryDType.F32).max_abs == 0.0
    f16 = measure_divergence(array, BoundaryDType.F16)
    bf16 = measure_divergence(array, BoundaryDType.BF16)
    assert 0 < f16.max_abs < bf16.max_abs
    assert bf16.max_rel <= 2.0**-8 and f16.max_rel <= 2.0**-11
    assert bf16.max_value == float(np.max(np.abs(array)))


@pytest.mark.parametrize(
    "array",
    [np.zeros((2, 3), np.float64), np.zeros(6, np.float32), np.zeros((0, 3), np.float32)],
    ids=["float64", "1-D", "empty"],
)
def test_encode_refuses_wrong_arrays(array: np.ndarray) -> None:
    with pytest.raises(ShapeError):
        encode_boundary(array)


def test_chunk_size_fits_the_receivers_limit() -> None:
    n = max_chunk_tokens(MIN_FRAME_LIMIT, 640, BoundaryDType.F32)
    assert len(Boundary.from_array(1, 0, _hidden(n, 640)).to_wire()) <= MIN_FRAME_LIMIT
    assert len(Boundary.from_array(1, 0, _hidden(n + 1, 640)).to_wire()) > MIN_FRAME_LIMIT
    assert max_chunk_tokens(MAX_FRAME_BYTES, 1, BoundaryDType.F16) == MAX_BOUNDARY_TOKENS
    assert max_chunk_tokens(MIN_FRAME_LIMIT, 65536, BoundaryDType.F32) == 0


# ------------------------------------------------------------------------------------------------ malformed


def raw(
    ftype: int,
    body: bytes = b"",
    *,
    request_id: int = 1,
    latest_token: int = -1,
    flags: int = 0,
    reserved: int = 0,
    version: int = PROTOCOL_VERSION,
    magic: bytes = b"KV",
    body_length: int | None = None,
) -> bytes:
    length = len(body) if body_length is None else body_length
    return struct.pack("<2sBBHHQiI", magic, version, ftype, flags, reserved, request_id, latest_token, length) + body


def patched(frame: Frame, offset: int, fmt: str, value: float) -> bytes:
    data = bytearray(frame.to_wire())
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def _rebody(frame: Frame, cut: int, *, flags: int | None = None) -> bytes:
    """``frame``'s bytes with ``cut`` bytes off its body's end (the header's length follows) and other flags."""
    data = frame.to_wire()
    body = data[HEADER_SIZE : len(data) + cut] if cut else data[HEADER_SIZE:]
    header = decode_header(data)
    return raw(
        header.type, body, request_id=header.request_id, latest_token=header.latest_token,
        flags=header.flags if flags is None else flags,
    )  # fmt: skip


HELLO = Hello("node-a", "ab" * 32, 0, 2, 0, 9, 18, 640)
START = StartRequest(7, (1, 2, 3), 16, 0, "node-a", SamplingParams(seed=3), ("</s>", "\n\n"))
BOUNDARY = Boundary.from_array(7, 0, _hidden(2, 4), final=True)
VERIFY_ROW = Boundary.from_array(7, 4, _hidden(1, 4), final=True, latest_token=3, drafts=(5, 6), row=1)
H = HEADER_SIZE
_SAMPLING_AT = H + 16  # START body: 16 fixed bytes, then the 48-byte sampling block

MALFORMED: dict[str, tuple[bytes, str]] = {
    "bad magic": (raw(FrameType.KEEPALIVE, request_id=0, magic=b"HT"), "bad magic"),
    "wrong version": (raw(FrameType.KEEPALIVE, request_id=0, version=2), "unsupported protocol version 2"),
    "unknown type": (raw(99), "unknown frame type 99"),
    "type zero": (raw(0), "unknown frame type 0"),
    "reserved header bits": (raw(FrameType.CANCEL, b"\0" * 4, reserved=1), "reserved header field"),
    "undefined flag": (raw(FrameType.CANCEL, b"\0" * 4, flags=0x8000), "undefined flag bits"),
    "final flag off a boundary": (raw(FrameType.CANCEL, b"\0" * 4, flags=FLAG_FINAL), "undefined flag bits"),
    "oversize length": (raw(FrameType.BOUNDARY, body_length=2**32 - 1), "exceeds the limit"),
    "truncated header": (raw(FrameType.CANCEL, b"\0" * 4)[:10], "header truncated"),
    "truncated body": (Cancel(1, 2).to_wire()[:-1], "message is 27 bytes, header says 28"),
    "trailing bytes": (Cancel(1, 2).to_wire() + b"\0", "header says 28"),
    "fixed body too long": (raw(FrameType.CANCEL, b"\0" * 5), "body length 5 invalid"),
    "token drafts ragged": (raw(FrameType.TOKEN, b"\0" * 9, latest_token=0), "not a whole number of token ids"),
    "token too many drafts": (raw(FrameType.TOKEN, b"\0" * (8 + 4 * 17), latest_token=0), "body length 76 invalid"),
    "verify flag on two rows": (
        patched(attrs.evolve(BOUNDARY, latest_token=3), 4, "<H", FLAG_FINAL | FLAG_DRAFTS),
        "a verify row (drafts flag) carries one row, not 2",
    ),
    "verify row without drafts": (
        _rebody(attrs.evolve(VERIFY_ROW, drafts=(5,), row=1), -4),
        "4 bytes after the 16-byte payload are no row index and 1 to 16 drafts",
    ),
    "verify row past its batch": (
        patched(VERIFY_ROW, H + 16 + 16, "<I", 3),
        "row 3 of a verify batch of 3 rows",
    ),
    "keepalive with body": (raw(FrameType.KEEPALIVE, b"\0", request_id=0), "expected exactly 0"),
    "request id zero": (raw(FrameType.CANCEL, b"\0" * 4, request_id=0), "request id 0 is reserved"),
    "hello with request id": (patched(HELLO, 8, "<Q", 5), "must carry request id 0"),
    "latest token below -1": (
        raw(FrameType.CANCEL, b"\0" * 4, latest_token=-2),
        "latest token -2 is negative",
    ),
    "hello trailing byte in body": (
        patched(HELLO, 20, "<I", len(HELLO.to_wire()) - H + 1) + b"\0",
        "unexpected trailing bytes",
    ),
    "hello window outside model": (patched(HELLO, H + 12, "<I", 19), "window end 19 outside"),
    "hello rank outside ring": (patched(HELLO, H, "<I", 2), "rank 2 outside [0, 1]"),
    "hello without f32": (patched(HELLO, H + 28, "<B", 0b100), "must accept f32"),
    "hello undefined dtype bit": (patched(HELLO, H + 28, "<B", 0b1001), "undefined dtype bits"),
    "hello reserved bytes": (patched(HELLO, H + 29, "<B", 1), "must be zero"),
    "hello node id not utf-8": (patched(HELLO, H + 34, "<B", 0xFF), "node id is not valid UTF-8"),
    "hello node id with space": (patched(HELLO, H + 34, "<B", 0x20), "printable with no whitespace"),
    "hello id length overrun": (patched(HELLO, H + 32, "<H", 200), "node id is 200 bytes"),
    "payload size mismatch": (patched(BOUNDARY, H + 8, "<I", 5), "payload is 32 bytes, expected 2x5x4 = 40"),
    "absurd n_tokens": (patched(BOUNDARY, H + 4, "<I", 2**31), "n_tokens 2147483648 outside"),
    "zero n_embd": (patched(BOUNDARY, H + 8, "<I", 0), "n_embd 0 outside"),
    "unknown dtype": (patched(BOUNDARY, H + 12, "<B", 3), "unknown dtype 3"),
    "position overflow": (patched(BOUNDARY, H, "<I", 2**31 - 2), "first position"),
    "start latest token": (patched(START, 16, "<i", 5), "latest token must be -1"),
    "start zero prompt": (patched(START, H + 8, "<I", 0), "prompt length 0 outside"),
    "start absurd prompt": (patched(START, H + 8, "<I", 2**32 - 1), "prompt length 4294967295 outside"),
    "start prompt overruns body": (patched(START, H + 8, "<I", 1000), "body truncated reading prompt"),
    "start too many stops": (patched(START, H + 12, "<B", MAX_STOP_STRINGS + 1), "stop count 17 exceeds"),
    "start negative token": (patched(START, H + 16 + 48 + 2 + 6, "<i", -4), "prompt[0] = -4 is negative"),
    "start zero max tokens": (patched(START, H + 4, "<I", 0), "max tokens 0 outside"),
    "start NaN temperature": (patched(START, _SAMPLING_AT, "<d", math.nan), "temperature must be in"),
    "start negative top_k": (patched(START, _SAMPLING_AT + 8, "<i", -1), "top_k must be"),
    "start repeat_last_n below -1": (patched(START, _SAMPLING_AT + 36, "<i", -2), "repeat_last_n must be"),
    "start sampling flag": (patched(START, _SAMPLING_AT + 44, "<B", 2), "undefined sampling flag bits"),
    "start stop not utf-8": (
        START.to_wire()[:-1] + b"\xc3",
        "stop[1] is not valid UTF-8",
    ),
    "start stop too long": (
        raw(FrameType.START, START.to_wire()[H:-4] + struct.pack("<H", MAX_STOP_BYTES + 1)),
        "stop[1] is 257 bytes",
    ),
    "token differs from header": (patched(Token(1, 2, 3), 16, "<i", 4), "differs from the header"),
    "negative token id": (raw(FrameType.TOKEN, struct.pack("<Ii", 0, -1), latest_token=-1), "token id -1"),
    "unknown end reason": (patched(End(1, EndReason.EOG, 1, 1, 0), H, "<B", 9), "unknown reason 9"),
    "end reserved": (
        patched(End(1, EndReason.EOG, 1, 1, 0), H + 1, "<B", 1),
        "reserved bytes 010000 must be zero",
    ),
    "boundary reserved": (patched(BOUNDARY, H + 15, "<B", 7), "must be zero"),
    "chain flag without a head": (
        patched(BOUNDARY, 4, "<H", FLAG_FINAL | FLAG_CHAIN),
        "payload is 0 bytes, expected 2x4x4 = 32 (then 32 bytes of chain head)",
    ),
    "chain head cut short": (
        _rebody(attrs.evolve(BOUNDARY, chain=b"\7" * CHAIN_BYTES), -1),
        "payload is 31 bytes, expected 2x4x4 = 32",
    ),
    "chain head without its flag": (
        _rebody(attrs.evolve(BOUNDARY, chain=b"\7" * CHAIN_BYTES), 0, flags=FLAG_FINAL),
        "payload is 64 bytes, expected 2x4x4 = 32",
    ),
    "sampling reserved": (patched(START, _SAMPLING_AT + 45, "<B", 1), "must be zero"),
    "start reserved": (patched(START, H + 14, "<B", 1), "must be zero"),
    "start speculate too high": (patched(START, H + 13, "<B", 17), "speculate 17 exceeds 16"),
    "unknown error code": (
        patched(Error(ErrorCode.INTERNAL, "x", 0), H, "<H", 999),
        "unknown error code 999",
    ),
    "error length mismatch": (
        patched(Error(ErrorCode.INTERNAL, "xy", 0), H + 2, "<H", 1),
        "message length 1",
    ),
    "error message not utf-8": (
        raw(FrameType.ERROR, struct.pack("<HHI", 1, 2, 0) + b"\xff\xfe"),
        "not valid UTF-8",
    ),
    "error message too long": (
        raw(FrameType.ERROR, struct.pack("<HHI", 1, 2000, 0) + b"a" * 2000),
        "body length 2008 invalid",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_frames_are_refused(case: str) -> None:
    data, reason = MALFORMED[case]
    with pytest.raises(ProtocolError, match=re.escape(reason)):
        decode_frame(data)
    # The streaming decoder refuses the same bytes (or waits for more when they are a clean prefix).
    decoder = FrameDecoder()
    try:
        decoder.feed(data)
        decoder.eof()
    except ProtocolError:
        pass
    else:
        pytest.fail(f"{case}: FrameDecoder accepted it")


def test_oversize_refused_before_the_body_arrives() -> None:
    decoder = FrameDecoder(max_frame_bytes=MIN_FRAME_LIMIT)
    header = raw(FrameType.BOUNDARY, body_length=MIN_FRAME_LIMIT)  # one header past the limit
    with pytest.raises(ProtocolError, match=f"length {MIN_FRAME_LIMIT + H} bytes exceeds the limit"):
        decoder.feed(header)


def test_decoder_stays_failed() -> None:
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError):
        decoder.feed(b"HT")
    with pytest.raises(ProtocolError, match="decoder already failed: bad magic"):
        decoder.feed(Keepalive().to_wire())


def test_decoder_eof_inside_frame() -> None:
    decoder = FrameDecoder()
    assert decoder.feed(Cancel(1, 0).to_wire()[:-2]) == []
    assert decoder.wanted() == 2
    with pytest.raises(ProtocolError, match="stream ended inside a frame"):
        decoder.eof()


def test_decoder_refuses_garbage_on_its_first_bytes() -> None:
    with pytest.raises(ProtocolError, match="bad magic b'GE'"):
        FrameDecoder().feed(b"GET")


# --------------------------------------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: StartRequest(0, [1], 1, 0, "n"), "request id 0 outside"),
        (lambda: StartRequest(1, [], 1, 0, "n"), "prompt length 0"),
        (lambda: StartRequest(1, [-1], 1, 0, "n"), "prompt\\[0\\]"),
        (lambda: StartRequest(1, [1], 1, 0, "n", stop=("",)), "stop\\[0\\] is empty"),
        (lambda: StartRequest(1, [1], 1, 0, "n", stop="ab"), "list or tuple"),
        (lambda: StartRequest(1, [1], 1, 0, "n", stop=("\ud800",)), "lone surrogate"),
        (lambda: StartRequest(1, [1], 1, 0, "n", stop=("x",) * 17), "stop count 17"),
        (lambda: Boundary(1, 0, 2, 2, BoundaryDType.F16, b"\0" * 7), "payload is 7 bytes"),
        (lambda: Boundary(1, 0, 1, 1, BoundaryDType.F32, b"\0" * 4, latest_token=-5), "latest token -5"),
        (lambda: Boundary(1, 0, 1, 1, BoundaryDType.F32, b"\0" * 4, chain=b"\0" * 31), "chain head must be"),
        (lambda: Boundary(1, 0, 1, 1, BoundaryDType.F32, b"\0" * 4, chain="ab" * 32), "chain head must be"),  # type: ignore[arg-type]
        (lambda: Token(1, 0, -1), "token id -1"),
        (lambda: Token(1, 0, 1, drafts=(1,) * 17), "draft count 17"),
        (lambda: Token(1, 0, 1, drafts=(-2,)), "drafts\\[0\\]"),
        (lambda: Boundary(1, 0, 2, 1, BoundaryDType.F32, b"\0" * 8, True, 3, (1, 2)), "a verify row .* is one"),
        (lambda: Boundary(1, 0, 1, 1, BoundaryDType.F32, b"\0" * 4, False, 3, (1,)), "a verify row .* is one"),
        (lambda: Boundary(1, 0, 1, 1, BoundaryDType.F32, b"\0" * 4, True, 3, (1,), row=2), "row 2 outside"),
        (lambda: Boundary(1, 0, 1, 1, BoundaryDType.F32, b"\0" * 4, row=1), "row 1 outside"),
        (lambda: StartRequest(1, [1], 1, 0, "n", speculate=17), "speculate 17"),
        (lambda: End(1, EndReason.EOG, -1, 0, 0), "prompt tokens -1"),
        (lambda: End(1, 2, 0, 0, 0), "EndReason"),  # type: ignore[arg-type]
        (lambda: Error(ErrorCode.INTERNAL, "x" * (MAX_ERROR_MESSAGE_BYTES + 1), 0), "message is 1025 bytes"),
        (lambda: Hello("a b", "m", 0, 1, 0, 1, 1, 8), "whitespace"),
        (lambda: Hello("a", "m", 0, 1, 0, 1, 1, 8, max_frame_bytes=1000), "max frame bytes"),
    ],
)
def test_invalid_frames_cannot_be_built(build: Callable[[], object], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        build()


@pytest.mark.parametrize(
    ("build", "field", "reason"),
    [
        (lambda: SamplingParams(temperature=-1), "temperature", "must be in [0, 100]"),
        (lambda: SamplingParams(temperature=math.inf), "temperature", "must be in [0, 100]"),
        (lambda: SamplingParams(top_p=0), "top_p", "must be in (0, 1]"),
        (lambda: SamplingParams(min_p=1.5), "min_p", "must be in [0, 1]"),
        (lambda: SamplingParams(repeat_penalty=0), "repeat_penalty", "must be in (0, 100]"),
        (lambda: SamplingParams(top_k=-1), "top_k", "must be an int"),
        (lambda: SamplingParams(repeat_last_n=-2), "repeat_last_n", "must be an int"),
        (lambda: SamplingParams(seed=2**32 - 1), "seed", "must be None or an int"),
        (lambda: SamplingParams(temperature=True), "temperature", "must be a number"),
    ],
)
def test_invalid_sampling_cannot_be_built(build: Callable[[], object], field: str, reason: str) -> None:
    # A user's bad value: a typed InputError naming the field (decoding a peer's START makes it a ProtocolError).
    with pytest.raises(SamplingError) as info:
        build()
    assert info.value.field == field and info.value.reason.startswith(reason)
    assert str(info.value).startswith(field) and isinstance(info.value, InputError)


def test_start_carrying_bad_sampling_is_a_protocol_error() -> None:
    data = patched(START, _SAMPLING_AT + 12, "<d", 0.0)  # top_p = 0
    with pytest.raises(ProtocolError, match=re.escape("START frame: sampling top_p must be in (0, 1]")):
        decode_frame(data)


def test_start_carries_a_client_authorisation_only_when_there_is_one() -> None:
    """CLIENT_AUTH (docs/protocol.md): the authorisation string ends the body and round-trips (withheld too); a
    START without one is the same bytes as before the flag existed; an empty or oversized one is refused."""
    from kvasir.wire.frames import FLAG_CLIENT_AUTH, MAX_CLIENT_AUTH_BYTES

    auth = "ka1." + "a" * 200 + "." + "b" * 86
    paid = attrs.evolve(START, client_auth=auth)
    data = paid.to_wire()
    assert struct.unpack_from("<H", data, 4)[0] & FLAG_CLIENT_AUTH and data.endswith(auth.encode())
    assert data[24 : len(START.to_wire())] == START.to_wire()[24:]  # the rest of the body as it was
    assert decode_frame(data) == paid and decode_frame(paid.withheld().to_wire()) == paid.withheld()
    assert not struct.unpack_from("<H", START.to_wire(), 4)[0] & FLAG_CLIENT_AUTH
    with pytest.raises(ProtocolError, match="client authorisation"):
        attrs.evolve(START, client_auth="x" * (MAX_CLIENT_AUTH_BYTES + 1))
    with pytest.raises(ProtocolError, match="client authorisation"):
        attrs.evolve(START, client_auth="has space")
    empty = bytearray(START.to_wire() + b"\x00\x00")
    struct.pack_into("<H", empty, 4, FLAG_CLIENT_AUTH)
    struct.pack_into("<I", empty, 20, struct.unpack_from("<I", empty, 20)[0] + 2)
    with pytest.raises(ProtocolError, match="empty client authorisation"):
        decode_frame(bytes(empty))


def test_greedy_is_temperature_zero() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams().greedy


def test_error_truncating_cuts_on_a_character_boundary() -> None:
    err = Error.truncating(ErrorCode.STAGE_FAILED, "☃" * 1000, origin_rank=3, request_id=9)
    assert len(err.message.encode()) <= MAX_ERROR_MESSAGE_BYTES
    assert set(err.message) == {"☃"}
    assert decode_frame(err.to_wire()) == err


# ------------------------------------------------------------------------------------------------ handshake


def ring(*windows: tuple[int, int], n_layers: int = 12, model: str = "m1") -> list[Hello]:
    return [Hello(f"node-{r}", model, r, len(windows), a, b, n_layers, 64) for r, (a, b) in enumerate(windows)]


def test_neighbours_that_join_are_accepted() -> None:
    nodes = ring((0, 4), (4, 9), (9, 12))
    for r, node in enumerate(nodes):
        succ = nodes[(r + 1) % 3]
        check_neighbour(node, succ, Side.SUCCESSOR)
        check_neighbour(succ, node, Side.PREDECESSOR)
    (solo,) = ring((0, 12))
    check_neighbour(solo, solo, Side.SUCCESSOR)
    assert neighbour_problem(solo, solo, Side.PREDECESSOR) is None


@pytest.mark.parametrize(
    ("local", "remote", "side", "reason"),
    [
        (ring((0, 4), (4, 12))[0], ring((0, 4), (4, 12), model="m2")[1], Side.SUCCESSOR, "serves model 'm2'"),
        (ring((0, 4), (4, 12))[0], ring((0, 5), (5, 12))[1], Side.SUCCESSOR, "does not join"),
        (ring((0, 4), (5, 12))[1], ring((0, 4), (5, 12))[0], Side.PREDECESSOR, "does not join"),
        (ring((0, 4), (4, 12))[0], ring((0, 4), (4, 12), n_layers=13)[1], Side.SUCCESSOR, "n_layers 13"),
        (ring((0, 4), (4, 12))[0], ring((0, 4), (4, 8), (8, 12))[1], Side.SUCCESSOR, "ring_size 3"),
        (ring((0, 4), (4, 8), (8, 12))[0], ring((0, 4), (4, 8), (8, 12))[2], Side.SUCCESSOR, "ring order"),
        (ring((0, 4), (4, 12))[0], ring((0, 4), (4, 11))[1], Side.SUCCESSOR, "last rank"),
        (ring((1, 4), (4, 12))[1], ring((1, 4), (4, 12))[0], Side.SUCCESSOR, "rank 0 but its window starts"),
    ],
)
def test_neighbours_that_do_not_join_are_refused(local: Hello, remote: Hello, side: Side, reason: str) -> None:
    with pytest.raises(RingError, match=reason):
        check_neighbour(local, remote, side)
    problem = neighbour_problem(local, remote, side)
    assert problem is not None
    assert problem[0] is (
        ErrorCode.MODEL_MISMATCH if "model" in reason or "n_layers" in reason else ErrorCode.WINDOW_MISMATCH
    )


def test_neighbour_with_same_node_id_is_refused() -> None:
    a, b = ring((0, 4), (4, 12))
    with pytest.raises(RingError, match="own node id"):
        check_neighbour(a, Hello(a.node_id, "m1", 1, 2, 4, 12, 12, 64), Side.SUCCESSOR)
    check_neighbour(a, b, Side.SUCCESSOR)


def test_dtype_choice_falls_back_to_f32() -> None:
    plain = ring((0, 12))[0]
    bf16 = Hello("x", "m1", 0, 1, 0, 12, 12, 64, dtypes=frozenset(BoundaryDType))
    assert choose_dtype(BoundaryDType.BF16, plain) is BoundaryDType.F32
    assert choose_dtype(BoundaryDType.BF16, bf16) is BoundaryDType.BF16


# ------------------------------------------------------------------------------------------------ streams


class RecordingStream(trio.abc.ReceiveStream):
    """Records how much the reader asks for, to prove it never reads far past a header."""

    def __init__(self, inner: trio.abc.ReceiveStream) -> None:
        self.inner = inner
        self.asked: list[int] = []

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        self.asked.append(max_bytes or 0)
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_reader_over_fragmented_writes() -> None:
    sent: list[Frame] = [HELLO, START, BOUNDARY, Boundary.from_array(7, 2, _hidden(300, 640)), Token(7, 2, 9)]
    sent += [End(7, EndReason.MAX_TOKENS, 3, 1, 1, 9), Error(ErrorCode.OVERLOADED, "busy", 1), Keepalive()]
    wire = b"".join(f.to_wire() for f in sent)
    send_stream, receive_stream = trio.testing.memory_stream_one_way_pair()
    recording = RecordingStream(receive_stream)
    reader = FrameReader(recording)
    rnd = random.Random(1)

    async def dribble() -> None:
        pos = 0
        while pos < len(wire):
            step = rnd.choice([1, 3, 23, 24, 25, 4096, 200_000])
            await send_stream.send_all(wire[pos : pos + step])
            await trio.lowlevel.checkpoint()
            pos += step
        await send_stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dribble)
            got = [frame async for frame in reader]
    assert got == sent
    assert max(recording.asked) <= READ_CHUNK


async def test_reader_round_trips_whole_frames() -> None:
    left, right = trio.testing.memory_stream_pair()
    reader = FrameReader(right)
    with trio.fail_after(5):
        await left.send_all(HELLO.to_wire())
        await left.send_all(BOUNDARY.to_wire())
        assert await reader.receive() == HELLO
        assert await reader.receive() == BOUNDARY
        await left.aclose()
        with pytest.raises(trio.EndOfChannel):
            await reader.receive()


async def test_reader_refuses_oversize_without_waiting_for_the_body() -> None:
    send_stream, receive_stream = trio.testing.memory_stream_one_way_pair()
    recording = RecordingStream(receive_stream)
    reader = FrameReader(recording, max_frame_bytes=MIN_FRAME_LIMIT)
    with trio.fail_after(5):
        # Only the header is ever sent and the stream stays open: the reader must not wait for 4 GiB.
        await send_stream.send_all(raw(FrameType.BOUNDARY, body_length=2**32 - 1))
        with pytest.raises(ProtocolError, match="exceeds the limit"):
            await reader.receive()
    assert sum(recording.asked) <= READ_CHUNK


async def test_reader_stream_ending_inside_a_frame() -> None:
    send_stream, receive_stream = trio.testing.memory_stream_one_way_pair()
    reader = FrameReader(receive_stream)
    with trio.fail_after(5):
        await send_stream.send_all(START.to_wire()[:-3])
        await send_stream.aclose()
        with pytest.raises(ProtocolError, match="stream ended inside a frame"):
            await reader.receive()


async def test_reader_refuses_two_receivers() -> None:
    _send_stream, receive_stream = trio.testing.memory_stream_one_way_pair()
    reader = FrameReader(receive_stream)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.receive)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await reader.receive()
            nursery.cancel_scope.cancel()
