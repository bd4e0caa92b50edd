"""Kvasir ring frames: a fixed 24-byte header and one body per frame type (byte layout: docs/protocol.md).

Every frame is a frozen attrs value that validates itself when built, so a frame decoded from the wire and a
frame built locally obey the same rules, and ``to_wire`` never emits what ``decode_frame`` would refuse. All
violations raise :class:`~kvasir.core.errors.ProtocolError` with one precise line.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from typing import ClassVar, Self, TypeAlias, TypeVar

import attrs
import numpy as np

from kvasir.core.codes import ErrorCode as ErrorCode  # re-exported: the wire speaks these codes
from kvasir.core.errors import ProtocolError
from kvasir.core.sampling import SamplingError, SamplingParams
from kvasir.core.speculate import K_LIMIT
from kvasir.wire._codec import I32_MAX, U32_MAX, BodyReader, pack_text
from kvasir.wire.boundary import BoundaryDType, F32Array, decode_boundary, encode_boundary

MAGIC = b"KV"
PROTOCOL_VERSION = 1

#: Default limit on one whole frame (header + body); each decoder may set its own.
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: The smallest frame limit a node may advertise; it must still carry useful boundaries and long prompts.
MIN_FRAME_LIMIT = 64 * 1024

MAX_ID_BYTES = 128
MAX_PROMPT_TOKENS = 1 << 20
MAX_NEW_TOKENS = 1 << 20
MAX_STOP_STRINGS = 16
MAX_STOP_BYTES = 256
MAX_ERROR_MESSAGE_BYTES = 1024
MAX_BOUNDARY_TOKENS = 1 << 16
MAX_EMBD = 1 << 16
MAX_LAYERS = 1 << 16
MAX_RING_SIZE = 1 << 12
#: Positions are int32 in llama.cpp; a boundary's last position + 1 must not pass this.
MAX_POSITION = I32_MAX

NO_TOKEN = -1
NO_REQUEST = 0

#: Header flag: on a BOUNDARY, the last rank samples after this chunk (final prefill chunk, or a decode step).
FLAG_FINAL = 0x0001
#: START only: the prompt's token ids are withheld (the receiver and the rest of its way round need only the length).
FLAG_WITHHELD = 0x0002
#: BOUNDARY only: one row of a speculative verify batch (n_tokens 1), sent as soon as it is computed so the next
#: window starts on it at once; the body ends with the row's index (u32) and the batch's drafts (the token ids of rows
#: 1…k; row 0's token is the header's latest token). The row's position is first_position + row.
FLAG_DRAFTS = 0x0004
#: BOUNDARY only: the body ends (after the row and drafts, if any) with the sender's output hash-chain head after
#: this frame, :data:`CHAIN_BYTES` bytes: set by a recording node, checked by a recording successor (docs/protocol.md).
FLAG_CHAIN = 0x0008
#: START only: the body ends (after the stop strings) with the client's signed request authorisation (a string of
#: at most MAX_CLIENT_AUTH_BYTES, kvasir.core.clientauth): a market ring's receipts carry it, and the market settles it.
#: Bit 5: bit 4 is left to the next START flag.
FLAG_CLIENT_AUTH = 0x0020
MAX_CLIENT_AUTH_BYTES = 1024
#: Size of the chain head a FLAG_CHAIN boundary carries (a sha256).
CHAIN_BYTES = 32
#: START and END: the body ends with the request's parameters hash (:data:`PARAMS_BYTES`), the entry's commitment to
#: what its client asked (START), echoed by the last rank (END); a withheld START with it carries the prompt's sha256
#: before it, in place of the token ids (docs/protocol.md § START). END may also set FLAG_CHAIN: the last rank's output
#: chain head after its last step, the head its receipt signs.
FLAG_PARAMS = 0x0010
#: Size of a parameters hash and of a withheld prompt's sha256.
PARAMS_BYTES = 32
#: Drafts one verify batch may carry (a TOKEN's or a BOUNDARY's); ``--speculate K`` never asks more.
MAX_DRAFTS = K_LIMIT

HEADER = struct.Struct("<2sBBHHQiI")
HEADER_SIZE = HEADER.size  # 24


class FrameType(enum.IntEnum):
    HELLO = 1
    START = 2
    BOUNDARY = 3
    TOKEN = 4
    END = 5
    CANCEL = 6
    ERROR = 7
    KEEPALIVE = 8


class EndReason(enum.IntEnum):
    EOG = 1  # the model produced an end-of-generation token
    MAX_TOKENS = 2
    STOP = 3  # a stop string matched
    CANCELLED = 4
    ERROR = 5


_E = TypeVar("_E", bound=enum.IntEnum)


def _enum_value(kind: str, cls: type[_E], value: int, field: str) -> _E:
    try:
        return cls(value)
    except ValueError:
        raise ProtocolError(f"{kind} frame: unknown {field} {value}") from None


def _check_int(kind: str, field: str, value: object, low: int, high: int) -> None:
    # bool is an int subclass; a True where a count belongs is a bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProtocolError(f"{kind} frame: {field} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ProtocolError(f"{kind} frame: {field} {value} outside [{low}, {high}]")


def _check_text(kind: str, field: str, value: object, max_bytes: int, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"{kind} frame: {field} must be a str, got {type(value).__name__}")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ProtocolError(f"{kind} frame: {field} is not encodable as UTF-8 (lone surrogate)") from None
    if size > max_bytes:
        raise ProtocolError(f"{kind} frame: {field} is {size} bytes (limit {max_bytes})")
    if not size and not allow_empty:
        raise ProtocolError(f"{kind} frame: {field} is empty")
    return value


def _check_id(kind: str, field: str, value: object, max_bytes: int = MAX_ID_BYTES) -> None:
    value = _check_text(kind, field, value, max_bytes)
    # Ids end up in logs, the TUI and error messages: no whitespace or control characters.
    if not value.isprintable() or any(ch.isspace() for ch in value):
        raise ProtocolError(f"{kind} frame: {field} {value!r} must be printable with no whitespace")


def _check_request(kind: str, request_id: object, latest_token: object) -> None:
    _check_int(kind, "request id", request_id, 1, 2**64 - 1)
    _check_int(kind, "latest token", latest_token, NO_TOKEN, I32_MAX)


# --------------------------------------------------------------------------------------------------- header


@attrs.frozen
class FrameHeader:
    """The fixed part of every frame, already validated against the type's rules."""

    type: FrameType
    flags: int
    request_id: int
    latest_token: int
    body_length: int

    @property
    def frame_length(self) -> int:
        return HEADER_SIZE + self.body_length


# Per type: (smallest body, largest body or None for "only the frame limit"); checked on the header alone so
# fixed-size frames of the wrong size are refused before their body is read.
_HELLO_FIXED = struct.Struct("<7IB3s")
_START_FIXED = struct.Struct("<IIIBB2s")
_SAMPLING = struct.Struct("<didddiIB3s")
_BOUNDARY_FIXED = struct.Struct("<IIIB3s")
_VERIFY_ROW = struct.Struct("<I")
BOUNDARY_FIXED_SIZE = _BOUNDARY_FIXED.size  # 16: a boundary body is this plus the payload
_TOKEN = struct.Struct("<Ii")
_END = struct.Struct("<B3sIII")
_CANCEL = struct.Struct("<I")
_ERROR_FIXED = struct.Struct("<HHI")

_BODY_SIZES: dict[FrameType, tuple[int, int | None]] = {
    FrameType.HELLO: (_HELLO_FIXED.size + 2 * (2 + 1), _HELLO_FIXED.size + 2 * (2 + MAX_ID_BYTES)),
    # A withheld START has no token ids: its smallest body ends after a 1-byte entry node id (review 2, N21).
    FrameType.START: (_START_FIXED.size + _SAMPLING.size + 2 + 1, None),
    FrameType.BOUNDARY: (_BOUNDARY_FIXED.size + 2, None),
    FrameType.TOKEN: (_TOKEN.size, _TOKEN.size + 4 * MAX_DRAFTS),
    FrameType.END: (_END.size, _END.size + PARAMS_BYTES + CHAIN_BYTES),
    FrameType.CANCEL: (_CANCEL.size, _CANCEL.size),
    FrameType.ERROR: (_ERROR_FIXED.size, _ERROR_FIXED.size + MAX_ERROR_MESSAGE_BYTES),
    FrameType.KEEPALIVE: (0, 0),
}
_LINK_FRAMES = frozenset({FrameType.HELLO, FrameType.KEEPALIVE})
_ALLOWED_FLAGS: dict[FrameType, int] = {
    FrameType.BOUNDARY: FLAG_FINAL | FLAG_DRAFTS | FLAG_CHAIN,
    FrameType.START: FLAG_WITHHELD | FLAG_CLIENT_AUTH | FLAG_PARAMS,
    FrameType.END: FLAG_PARAMS | FLAG_CHAIN,
}
_TYPE_CODES = frozenset(t.value for t in FrameType)


def check_header_prefix(data: bytes | bytearray | memoryview) -> None:
    """Refuse a stream as early as its first bytes allow: magic, then version, then frame type."""
    if len(data) >= 2 and bytes(data[:2]) != MAGIC:
        raise ProtocolError(f"bad magic {bytes(data[:2])!r} (expected {MAGIC!r}; not a Kvasir peer?)")
    if len(data) >= 3 and data[2] != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {data[2]} (this node speaks {PROTOCOL_VERSION})")
    if len(data) >= 4 and data[3] not in _TYPE_CODES:
        raise ProtocolError(f"unknown frame type {data[3]}")


def decode_header(data: bytes | bytearray | memoryview, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> FrameHeader:
    """Validate the first :data:`HEADER_SIZE` bytes of a frame: its body length is known before it is read."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"frame header truncated ({len(data)} of {HEADER_SIZE} bytes)")
    check_header_prefix(data)
    _magic, _version, type_code, flags, reserved, request_id, latest_token, body_length = HEADER.unpack_from(data)
    ftype = FrameType(type_code)
    name = ftype.name
    if reserved:
        raise ProtocolError(f"{name} frame: reserved header field is {reserved:#06x}, must be zero")
    if HEADER_SIZE + body_length > max_frame_bytes:
        raise ProtocolError(
            f"{name} frame: length {HEADER_SIZE + body_length} bytes exceeds the limit of {max_frame_bytes}"
        )
    low, high = _BODY_SIZES[ftype]
    if body_length < low or (high is not None and body_length > high):
        expected = f"exactly {low}" if low == high else f"{low}..{high if high is not None else 'limit'}"
        raise ProtocolError(f"{name} frame: body length {body_length} invalid (expected {expected})")
    if stray := flags & ~_ALLOWED_FLAGS.get(ftype, 0):
        raise ProtocolError(f"{name} frame: undefined flag bits {stray:#06x}")
    if ftype in _LINK_FRAMES:
        if request_id != NO_REQUEST or latest_token != NO_TOKEN:
            raise ProtocolError(f"{name} frame: must carry request id 0 and latest token -1")
    elif ftype is not FrameType.ERROR and request_id == NO_REQUEST:
        raise ProtocolError(f"{name} frame: request id 0 is reserved for link-level frames")
    if latest_token < NO_TOKEN:
        raise ProtocolError(f"{name} frame: latest token {latest_token} is negative")
    return FrameHeader(ftype, flags, request_id, latest_token, body_length)


def _pack(
    ftype: FrameType, body: bytes, *, request_id: int = NO_REQUEST, latest_token: int = NO_TOKEN, flags: int = 0
) -> bytes:
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, ftype, flags, 0, request_id, latest_token, len(body)) + body


# --------------------------------------------------------------------------------------------------- frames


@attrs.frozen
class Hello:
    """First frame each end of a link sends: who I am, which model, which layers."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO

    node_id: str
    model_id: str  # lowercase hex sha256 of the whole GGUF, or a shorter agreed id
    rank: int
    ring_size: int
    window_start: int  # the sender's layer window is [window_start, window_end)
    window_end: int
    n_layers: int  # the model's total block count
    n_embd: int  # boundary width both ends must agree on
    max_frame_bytes: int = MAX_FRAME_BYTES  # the largest frame the sender accepts
    dtypes: frozenset[BoundaryDType] = frozenset({BoundaryDType.F32})  # boundary dtypes the sender accepts

    @property
    def request_id(self) -> int:
        return NO_REQUEST

    @property
    def latest_token(self) -> int:
        return NO_TOKEN

    def __attrs_post_init__(self) -> None:
        k = "HELLO"
        _check_id(k, "node id", self.node_id)
        _check_id(k, "model id", self.model_id)
        _check_int(k, "ring size", self.ring_size, 1, MAX_RING_SIZE)
        _check_int(k, "rank", self.rank, 0, self.ring_size - 1)
        _check_int(k, "n_layers", self.n_layers, 1, MAX_LAYERS)
        _check_int(k, "window start", self.window_start, 0, self.n_layers - 1)
        _check_int(k, "window end", self.window_end, self.window_start + 1, self.n_layers)
        _check_int(k, "n_embd", self.n_embd, 1, MAX_EMBD)
        _check_int(k, "max frame bytes", self.max_frame_bytes, MIN_FRAME_LIMIT, U32_MAX)
        if not isinstance(self.dtypes, frozenset) or not all(isinstance(d, BoundaryDType) for d in self.dtypes):
            raise ProtocolError("HELLO frame: dtypes must be a frozenset of BoundaryDType")
        if BoundaryDType.F32 not in self.dtypes:
            raise ProtocolError("HELLO frame: every node must accept f32 boundaries")

    def to_wire(self) -> bytes:
        mask = sum(1 << d for d in self.dtypes)
        fixed = _HELLO_FIXED.pack(
            self.rank, self.ring_size, self.window_start, self.window_end,
            self.n_layers, self.n_embd, self.max_frame_bytes, mask, b"",
        )  # fmt: skip
        return _pack(self.TYPE, fixed + pack_text(self.node_id) + pack_text(self.model_id))

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        rank, ring_size, w0, w1, n_layers, n_embd, max_frame, mask, pad = r.unpack(_HELLO_FIXED, "fixed fields")
        r.reserved(pad)
        if mask & ~((1 << len(BoundaryDType)) - 1):
            raise r.fail(f"undefined dtype bits in mask {mask:#04x}")
        dtypes = frozenset(d for d in BoundaryDType if mask & (1 << d))
        node_id = r.text("node id", MAX_ID_BYTES)
        model_id = r.text("model id", MAX_ID_BYTES)
        r.finish()
        return cls(node_id, model_id, rank, ring_size, w0, w1, n_layers, n_embd, max_frame, dtypes)

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Hello:
        return _from_wire_as(cls, data, max_frame_bytes)


def _pack_sampling(s: SamplingParams) -> bytes:
    return _SAMPLING.pack(
        s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty,
        s.repeat_last_n, s.seed if s.seed is not None else 0, int(s.seed is not None), b"",
    )  # fmt: skip


def _unpack_sampling(r: BodyReader) -> SamplingParams:
    temperature, top_k, top_p, min_p, penalty, last_n, seed, sflags, pad = r.unpack(_SAMPLING, "sampling")
    r.reserved(pad)
    if sflags not in (0, 1):
        raise r.fail(f"undefined sampling flag bits {sflags:#04x}")
    if not sflags and seed:
        raise r.fail("sampling seed must be zero when absent")
    try:
        return SamplingParams(temperature, top_k, top_p, min_p, penalty, last_n, seed if sflags else None)
    except SamplingError as exc:  # the peer sent it: a protocol error, not the user's input
        raise r.fail(f"sampling {exc}") from None


def _tuple_of_ints(value: object) -> tuple[int, ...]:
    if isinstance(value, np.ndarray):
        return tuple(int(v) for v in value.tolist())
    if isinstance(value, list | tuple):
        return tuple(value)
    raise ProtocolError(f"START frame: prompt must be a sequence of token ids, got {type(value).__name__}")


def _drafts(value: object) -> tuple[int, ...]:
    if isinstance(value, np.ndarray):
        return tuple(int(v) for v in value.tolist())
    if isinstance(value, list | tuple):
        return tuple(value)
    raise ProtocolError(f"drafts must be a sequence of token ids, got {type(value).__name__}")


def _check_drafts(kind: str, drafts: tuple[int, ...]) -> None:
    _check_int(kind, "draft count", len(drafts), 0, MAX_DRAFTS)
    for i, tok in enumerate(drafts):
        if type(tok) is not int or not 0 <= tok <= I32_MAX:
            raise ProtocolError(f"{kind} frame: drafts[{i}] = {tok!r} is not a token id in [0, {I32_MAX}]")


def _read_drafts(r: BodyReader, n: int) -> tuple[int, ...]:
    tokens = np.frombuffer(r.take(4 * n, "drafts"), dtype="<i4")
    if len(tokens) and int(tokens.min()) < 0:
        raise r.fail(f"a draft token id is negative ({int(tokens.min())})")
    return tuple(tokens.tolist())


def _tuple_of_str(value: object) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ProtocolError("START frame: stop must be a list or tuple of strings")
    return tuple(value)


PARAMS_DOMAIN = b"kvasir-request-params/v1\n"


def prompt_digest(prompt: tuple[int, ...]) -> bytes:
    """sha256 of a prompt's token ids as the wire carries them (little-endian int32)."""
    return hashlib.sha256(np.asarray(prompt, dtype="<i4").tobytes()).digest()


def request_params_hash(start: StartRequest) -> bytes:
    """The canonical hash of what a START asks (pure; docs/protocol.md § START, *Parameters hash*): the request id,
    the entry's rank and node id, max_tokens, the prompt's length and sha256, the sampling settings (seed included),
    speculate and the stop strings, each in its START wire encoding, and the client's authorisation when there is
    one. b"" for a withheld START without the prompt's sha256 (nothing to hash the prompt by)."""
    prompt = start.prompt_hash()
    if not prompt:
        return b""
    h = hashlib.sha256(PARAMS_DOMAIN)
    h.update(struct.pack("<Q", start.request_id))
    n_stop = len(start.stop)
    h.update(_START_FIXED.pack(start.entry_rank, start.max_tokens, start.prompt_length, n_stop, start.speculate, b""))
    h.update(_pack_sampling(start.sampling))
    h.update(pack_text(start.entry_node_id))
    for s in start.stop:
        h.update(pack_text(s))
    h.update(prompt)
    if start.client_auth:  # a paid request: a member that rewrites who pays fails it, as for any parameter
        h.update(pack_text(start.client_auth))
    return h.digest()


@attrs.frozen
class StartRequest:
    """A new request entering the ring at ``entry_rank`` (the node that streams tokens to the client)."""

    TYPE: ClassVar[FrameType] = FrameType.START

    request_id: int
    prompt: tuple[int, ...] = attrs.field(converter=_tuple_of_ints, repr=lambda p: f"<{len(p)} tokens>")
    max_tokens: int
    entry_rank: int
    entry_node_id: str
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)
    #: When the token ids are withheld (FLAG_WITHHELD): the prompt's length, and ``prompt`` is empty.
    withheld_length: int = 0
    #: Speculative decoding: up to this many prompt-lookup drafts per verify batch (0: plain one-token steps).
    speculate: int = 0
    #: FLAG_CLIENT_AUTH: the client's signed authorisation of this request (opaque here; "" when none).
    client_auth: str = attrs.field(default="", repr=lambda a: f"<{len(a)} chars>" if a else "''")
    #: FLAG_PARAMS: the entry's commitment to what its client asked (:func:`request_params_hash`), or empty.
    params_hash: bytes = attrs.field(default=b"", repr=lambda h: h.hex()[:16] if h else "-")
    #: A withheld START with FLAG_PARAMS: the prompt's sha256 (:func:`prompt_digest`), so that a node without the
    #: token ids can still check the parameters hash; empty otherwise.
    prompt_sha256: bytes = attrs.field(default=b"", repr=lambda h: h.hex()[:16] if h else "-")

    @property
    def latest_token(self) -> int:
        return NO_TOKEN  # nothing has been sampled yet

    @property
    def prompt_length(self) -> int:
        return self.withheld_length or len(self.prompt)

    def withheld(self) -> StartRequest:
        """This START without the prompt's token ids (for nodes that need only its length; with a parameters hash,
        the prompt's sha256 stands in for them)."""
        if self.withheld_length:
            return self
        digest = prompt_digest(self.prompt) if self.params_hash else b""
        return attrs.evolve(self, prompt=(), withheld_length=len(self.prompt), prompt_sha256=digest)

    def prompt_hash(self) -> bytes:
        """The prompt's sha256: computed from the token ids, or the one a withheld START carries (b"" if none)."""
        return self.prompt_sha256 if self.withheld_length else prompt_digest(self.prompt)

    def __attrs_post_init__(self) -> None:
        k = "START"
        _check_request(k, self.request_id, NO_TOKEN)
        if self.withheld_length:
            _check_int(k, "prompt length", self.withheld_length, 1, MAX_PROMPT_TOKENS)
            if self.prompt:
                raise ProtocolError(f"{k} frame: a withheld prompt carries no token ids")
        else:
            _check_int(k, "prompt length", len(self.prompt), 1, MAX_PROMPT_TOKENS)
        for i, tok in enumerate(self.prompt):
            if type(tok) is not int or not 0 <= tok <= I32_MAX:
                raise ProtocolError(f"{k} frame: prompt[{i}] = {tok!r} is not a token id in [0, {I32_MAX}]")
        _check_int(k, "max tokens", self.max_tokens, 1, MAX_NEW_TOKENS)
        _check_int(k, "entry rank", self.entry_rank, 0, MAX_RING_SIZE - 1)
        _check_id(k, "entry node id", self.entry_node_id)
        if not isinstance(self.sampling, SamplingParams):
            raise ProtocolError(f"{k} frame: sampling must be SamplingParams")
        _check_int(k, "stop count", len(self.stop), 0, MAX_STOP_STRINGS)
        for i, s in enumerate(self.stop):
            _check_text(k, f"stop[{i}]", s, MAX_STOP_BYTES)
        _check_int(k, "speculate", self.speculate, 0, MAX_DRAFTS)
        if self.client_auth:
            _check_id(k, "client authorisation", self.client_auth, MAX_CLIENT_AUTH_BYTES)
        if not isinstance(self.params_hash, bytes) or len(self.params_hash) not in (0, PARAMS_BYTES):
            raise ProtocolError(f"{k} frame: parameters hash must be empty or {PARAMS_BYTES} bytes")
        sha_bytes = PARAMS_BYTES if self.withheld_length and self.params_hash else 0
        if not isinstance(self.prompt_sha256, bytes) or len(self.prompt_sha256) != sha_bytes:
            raise ProtocolError(
                f"{k} frame: the prompt's sha256 must be {sha_bytes} bytes"
                " (32 on a withheld START with a parameters hash, else none)"
            )

    def to_wire(self) -> bytes:
        parts = [
            _START_FIXED.pack(
                self.entry_rank, self.max_tokens, self.prompt_length, len(self.stop), self.speculate, b""
            ),
            _pack_sampling(self.sampling),
            pack_text(self.entry_node_id),
            np.asarray(self.prompt, dtype="<i4").tobytes(),
            *(pack_text(s) for s in self.stop),
            pack_text(self.client_auth) if self.client_auth else b"",
            self.prompt_sha256,
            self.params_hash,
        ]
        flags = (
            (FLAG_WITHHELD if self.withheld_length else 0)
            | (FLAG_CLIENT_AUTH if self.client_auth else 0)
            | (FLAG_PARAMS if self.params_hash else 0)
        )
        return _pack(self.TYPE, b"".join(parts), request_id=self.request_id, flags=flags)

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        withheld = bool(header.flags & FLAG_WITHHELD)
        if header.latest_token != NO_TOKEN:
            raise r.fail("latest token must be -1 (nothing sampled yet)")
        entry_rank, max_tokens, n_prompt, n_stop, speculate, pad = r.unpack(_START_FIXED, "fixed fields")
        r.reserved(pad)
        if speculate > MAX_DRAFTS:
            raise r.fail(f"speculate {speculate} exceeds {MAX_DRAFTS}")
        # Counts are checked before anything is sized by them.
        if not 1 <= n_prompt <= MAX_PROMPT_TOKENS:
            raise r.fail(f"prompt length {n_prompt} outside [1, {MAX_PROMPT_TOKENS}]")
        if n_stop > MAX_STOP_STRINGS:
            raise r.fail(f"stop count {n_stop} exceeds {MAX_STOP_STRINGS}")
        sampling = _unpack_sampling(r)
        entry_node_id = r.text("entry node id", MAX_ID_BYTES)
        tokens = np.frombuffer(r.take(0 if withheld else 4 * n_prompt, "prompt"), dtype="<i4")
        if len(tokens) and int(tokens.min()) < 0:
            bad = int(np.argmax(tokens < 0))
            raise r.fail(f"prompt[{bad}] = {int(tokens[bad])} is negative")
        stop = tuple(r.text(f"stop[{i}]", MAX_STOP_BYTES) for i in range(n_stop))
        client_auth = r.text("client authorisation", MAX_CLIENT_AUTH_BYTES) if header.flags & FLAG_CLIENT_AUTH else ""
        params = bool(header.flags & FLAG_PARAMS)
        prompt_sha256 = bytes(r.take(PARAMS_BYTES, "prompt sha256")) if params and withheld else b""
        params_hash = bytes(r.take(PARAMS_BYTES, "parameters hash")) if params else b""
        r.finish()
        if header.flags & FLAG_CLIENT_AUTH and not client_auth:
            raise r.fail("CLIENT_AUTH set with an empty client authorisation")
        return cls(
            header.request_id, tuple(tokens.tolist()), max_tokens, entry_rank, entry_node_id,
            sampling, stop, n_prompt if withheld else 0, speculate, client_auth, params_hash, prompt_sha256,
        )  # fmt: skip

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> StartRequest:
        return _from_wire_as(cls, data, max_frame_bytes)


def _payload_repr(payload: bytes) -> str:
    return f"<{len(payload)} bytes>"


@attrs.frozen
class Boundary:
    """Hidden states after a window's last layer, for positions ``first_position ..+ n_tokens``."""

    TYPE: ClassVar[FrameType] = FrameType.BOUNDARY

    request_id: int
    first_position: int
    n_tokens: int
    n_embd: int
    dtype: BoundaryDType
    payload: bytes = attrs.field(repr=_payload_repr)  # n_tokens * n_embd * dtype.itemsize little-endian bytes
    final: bool = False  # the last rank samples after this chunk (FLAG_FINAL)
    latest_token: int = NO_TOKEN
    #: A row of a speculative verify batch (FLAG_DRAFTS): the batch's drafts, the token ids of rows 1…k (row 0's is
    #: ``latest_token``); ``first_position`` is the batch's (row 0's) position.
    drafts: tuple[int, ...] = attrs.field(default=(), converter=_drafts)
    #: FLAG_CHAIN: the sender's output hash-chain head after this frame (CHAIN_BYTES), or empty. Not content: a
    #: replay carries the same one, and a receiver that does not record ignores it.
    chain: bytes = attrs.field(default=b"", repr=lambda c: c.hex() if c else "-")
    #: Which row of its verify batch this frame is (0…len(drafts)); 0 without drafts.
    row: int = 0

    def __attrs_post_init__(self) -> None:
        k = "BOUNDARY"
        _check_request(k, self.request_id, self.latest_token)
        if not isinstance(self.chain, bytes) or len(self.chain) not in (0, CHAIN_BYTES):
            raise ProtocolError(f"{k} frame: chain head must be empty or {CHAIN_BYTES} bytes")
        _check_drafts(k, self.drafts)
        if self.drafts and (self.n_tokens != 1 or not self.final or self.latest_token < 0):
            raise ProtocolError(
                f"{k} frame: a verify row (drafts) is one final row after its latest token (n_tokens {self.n_tokens})"
            )
        _check_int(k, "row", self.row, 0, len(self.drafts))
        _check_int(k, "n_tokens", self.n_tokens, 1, MAX_BOUNDARY_TOKENS)
        _check_int(k, "n_embd", self.n_embd, 1, MAX_EMBD)
        _check_int(k, "first position", self.first_position, 0, MAX_POSITION - self.n_tokens - self.row)
        if not isinstance(self.dtype, BoundaryDType):
            raise ProtocolError(f"{k} frame: dtype must be a BoundaryDType, got {self.dtype!r}")
        if not isinstance(self.final, bool):
            raise ProtocolError(f"{k} frame: final must be a bool")
        if not isinstance(self.payload, bytes):
            raise ProtocolError(f"{k} frame: payload must be bytes, got {type(self.payload).__name__}")
        expected = self.n_tokens * self.n_embd * self.dtype.itemsize
        if len(self.payload) != expected:
            raise ProtocolError(
                f"{k} frame: payload is {len(self.payload)} bytes, expected {self.n_tokens}x{self.n_embd}"
                f"x{self.dtype.itemsize} = {expected}"
            )

    @classmethod
    def from_array(
        cls,
        request_id: int,
        first_position: int,
        array: np.ndarray,
        *,
        dtype: BoundaryDType = BoundaryDType.F32,
        final: bool = False,
        latest_token: int = NO_TOKEN,
        drafts: tuple[int, ...] = (),
        row: int = 0,
    ) -> Self:
        """Build from a float32 ``(n_tokens, n_embd)`` array; see :func:`encode_boundary` for its errors."""
        payload = encode_boundary(array, dtype)
        n_tokens, n_embd = array.shape
        return cls(request_id, first_position, n_tokens, n_embd, dtype, payload, final, latest_token, drafts, row=row)

    @property
    def position(self) -> int:
        """Where this frame's first row goes in the sequence (a verify row's: the batch's position + its row)."""
        return self.first_position + self.row

    def to_array(self) -> F32Array:
        """The hidden states as float32 ``(n_tokens, n_embd)``; read-only for f32 payloads."""
        return decode_boundary(self.payload, self.n_tokens, self.n_embd, self.dtype)

    def to_wire(self) -> bytes:
        fixed = _BOUNDARY_FIXED.pack(self.first_position, self.n_tokens, self.n_embd, self.dtype, b"")
        verify = _VERIFY_ROW.pack(self.row) + np.asarray(self.drafts, dtype="<i4").tobytes() if self.drafts else b""
        tail = verify + self.chain
        flags = (FLAG_FINAL if self.final else 0) | (FLAG_DRAFTS if self.drafts else 0)
        flags |= FLAG_CHAIN if self.chain else 0
        return _pack(
            self.TYPE, fixed + self.payload + tail, request_id=self.request_id, latest_token=self.latest_token,
            flags=flags,
        )  # fmt: skip

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        first, n_tokens, n_embd, dtype_code, pad = r.unpack(_BOUNDARY_FIXED, "fixed fields")
        r.reserved(pad)
        dtype = _enum_value("BOUNDARY", BoundaryDType, dtype_code, "dtype")
        if not 1 <= n_tokens <= MAX_BOUNDARY_TOKENS:
            raise r.fail(f"n_tokens {n_tokens} outside [1, {MAX_BOUNDARY_TOKENS}]")
        if not 1 <= n_embd <= MAX_EMBD:
            raise r.fail(f"n_embd {n_embd} outside [1, {MAX_EMBD}]")
        expected = n_tokens * n_embd * dtype.itemsize
        chain_bytes = CHAIN_BYTES if header.flags & FLAG_CHAIN else 0
        verify = bool(header.flags & FLAG_DRAFTS)
        if verify and n_tokens != 1:
            raise r.fail(f"a verify row (drafts flag) carries one row, not {n_tokens}")
        # A verify row's tail: its index and at least one draft; its length is what follows the payload.
        extra = r.remaining - expected - chain_bytes
        if verify and not (_VERIFY_ROW.size + 4 <= extra <= _VERIFY_ROW.size + 4 * MAX_DRAFTS and extra % 4 == 0):
            raise r.fail(
                f"{max(extra, 0)} bytes after the {expected}-byte payload are no row index and 1 to {MAX_DRAFTS} drafts"
            )
        if not verify and extra != 0:
            raise r.fail(
                f"payload is {r.remaining - chain_bytes} bytes, expected {n_tokens}x{n_embd}x{dtype.itemsize} ="
                f" {expected}" + (f" (then {chain_bytes} bytes of chain head)" if chain_bytes else "")
            )
        payload = bytes(r.take(expected, "payload"))
        row = 0
        drafts: tuple[int, ...] = ()
        if verify:
            (row,) = r.unpack(_VERIFY_ROW, "row")
            drafts = _read_drafts(r, (extra - _VERIFY_ROW.size) // 4)
            if row > len(drafts):
                raise r.fail(f"row {row} of a verify batch of {len(drafts) + 1} rows")
        chain = bytes(r.take(CHAIN_BYTES, "chain head")) if chain_bytes else b""
        return cls(
            header.request_id, first, n_tokens, n_embd, dtype, payload,
            bool(header.flags & FLAG_FINAL), header.latest_token, drafts, chain, row,
        )  # fmt: skip

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Boundary:
        return _from_wire_as(cls, data, max_frame_bytes)


@attrs.frozen
class Token:
    """A token sampled by the last rank, travelling to rank 0 to be embedded at ``position``."""

    TYPE: ClassVar[FrameType] = FrameType.TOKEN

    request_id: int
    position: int
    token_id: int
    #: Speculative decoding: draft tokens rank 0 embeds after ``token_id`` in one verify batch (positions
    #: ``position + 1…``); the body's trailing token ids, so a TOKEN without drafts is the single-token frame.
    drafts: tuple[int, ...] = attrs.field(default=(), converter=_drafts)

    @property
    def latest_token(self) -> int:
        return self.token_id

    def __attrs_post_init__(self) -> None:
        _check_request("TOKEN", self.request_id, NO_TOKEN)
        _check_int("TOKEN", "position", self.position, 0, MAX_POSITION - 1 - len(self.drafts))
        _check_int("TOKEN", "token id", self.token_id, 0, I32_MAX)
        _check_drafts("TOKEN", self.drafts)

    def to_wire(self) -> bytes:
        body = _TOKEN.pack(self.position, self.token_id) + np.asarray(self.drafts, dtype="<i4").tobytes()
        return _pack(self.TYPE, body, request_id=self.request_id, latest_token=self.token_id)

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        position, token_id = r.unpack(_TOKEN, "fields")
        if token_id != header.latest_token:
            raise r.fail(f"token id {token_id} differs from the header's latest token {header.latest_token}")
        if r.remaining % 4:
            raise r.fail(f"{r.remaining} bytes of drafts is not a whole number of token ids")
        return cls(header.request_id, position, token_id, _read_drafts(r, r.remaining // 4))

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Token:
        return _from_wire_as(cls, data, max_frame_bytes)


@attrs.frozen
class End:
    """A request finished; ``origin_rank`` is the rank that ended it (forwarding stops before it)."""

    TYPE: ClassVar[FrameType] = FrameType.END

    request_id: int
    reason: EndReason
    prompt_tokens: int
    generated_tokens: int
    origin_rank: int
    latest_token: int = NO_TOKEN
    #: FLAG_PARAMS: the parameters hash of the START the last rank served, echoed for the entry to compare.
    params_hash: bytes = attrs.field(default=b"", repr=lambda h: h.hex()[:16] if h else "-")
    #: FLAG_CHAIN: the last rank's output chain head after its last step (the head its receipt signs), or empty.
    chain: bytes = attrs.field(default=b"", repr=lambda c: c.hex()[:16] if c else "-")

    def __attrs_post_init__(self) -> None:
        _check_request("END", self.request_id, self.latest_token)
        if not isinstance(self.reason, EndReason):
            raise ProtocolError(f"END frame: reason must be an EndReason, got {self.reason!r}")
        _check_int("END", "prompt tokens", self.prompt_tokens, 0, MAX_PROMPT_TOKENS)
        _check_int("END", "generated tokens", self.generated_tokens, 0, MAX_NEW_TOKENS)
        _check_int("END", "origin rank", self.origin_rank, 0, MAX_RING_SIZE - 1)
        if not isinstance(self.params_hash, bytes) or len(self.params_hash) not in (0, PARAMS_BYTES):
            raise ProtocolError(f"END frame: parameters hash must be empty or {PARAMS_BYTES} bytes")
        if not isinstance(self.chain, bytes) or len(self.chain) not in (0, CHAIN_BYTES):
            raise ProtocolError(f"END frame: chain head must be empty or {CHAIN_BYTES} bytes")

    def to_wire(self) -> bytes:
        body = _END.pack(self.reason, b"", self.origin_rank, self.prompt_tokens, self.generated_tokens)
        flags = (FLAG_PARAMS if self.params_hash else 0) | (FLAG_CHAIN if self.chain else 0)
        return _pack(
            self.TYPE, body + self.params_hash + self.chain, request_id=self.request_id,
            latest_token=self.latest_token, flags=flags,
        )  # fmt: skip

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        code, pad, origin, prompt_tokens, generated = r.unpack(_END, "fields")
        r.reserved(pad)
        reason = _enum_value("END", EndReason, code, "reason")
        tail = (PARAMS_BYTES if header.flags & FLAG_PARAMS else 0) + (CHAIN_BYTES if header.flags & FLAG_CHAIN else 0)
        if r.remaining != tail:
            raise r.fail(f"{r.remaining} bytes after the fields, expected {tail} (parameters hash, chain head)")
        params_hash = bytes(r.take(PARAMS_BYTES, "parameters hash")) if header.flags & FLAG_PARAMS else b""
        chain = bytes(r.take(CHAIN_BYTES, "chain head")) if header.flags & FLAG_CHAIN else b""
        return cls(header.request_id, reason, prompt_tokens, generated, origin, header.latest_token, params_hash, chain)

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> End:
        return _from_wire_as(cls, data, max_frame_bytes)


@attrs.frozen
class Cancel:
    """The client gave up on a request; every node frees it. ``origin_rank`` is where the cancel began."""

    TYPE: ClassVar[FrameType] = FrameType.CANCEL

    request_id: int
    origin_rank: int
    latest_token: int = NO_TOKEN

    def __attrs_post_init__(self) -> None:
        _check_request("CANCEL", self.request_id, self.latest_token)
        _check_int("CANCEL", "origin rank", self.origin_rank, 0, MAX_RING_SIZE - 1)

    def to_wire(self) -> bytes:
        return _pack(
            self.TYPE,
            _CANCEL.pack(self.origin_rank),
            request_id=self.request_id,
            latest_token=self.latest_token,
        )

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        (origin,) = r.unpack(_CANCEL, "fields")
        return cls(header.request_id, origin, header.latest_token)

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Cancel:
        return _from_wire_as(cls, data, max_frame_bytes)


@attrs.frozen
class Error:
    """A failure. Request id 0 means the link itself (refused handshake, bad frame); the sender closes it."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR

    code: ErrorCode
    message: str
    origin_rank: int
    request_id: int = NO_REQUEST
    latest_token: int = NO_TOKEN

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.code, ErrorCode):
            raise ProtocolError(f"ERROR frame: code must be an ErrorCode, got {self.code!r}")
        _check_text("ERROR", "message", self.message, MAX_ERROR_MESSAGE_BYTES, allow_empty=True)
        _check_int("ERROR", "origin rank", self.origin_rank, 0, MAX_RING_SIZE - 1)
        _check_int("ERROR", "request id", self.request_id, 0, 2**64 - 1)
        _check_int("ERROR", "latest token", self.latest_token, NO_TOKEN, I32_MAX)

    @classmethod
    def truncating(cls, code: ErrorCode, message: str, origin_rank: int, request_id: int = NO_REQUEST) -> Self:
        """Build from any message, cutting it on a character boundary to fit the wire limit."""
        raw = message.encode("utf-8", "replace")[:MAX_ERROR_MESSAGE_BYTES]
        return cls(code, raw.decode("utf-8", "ignore"), origin_rank, request_id)

    def to_wire(self) -> bytes:
        raw = self.message.encode("utf-8")
        body = _ERROR_FIXED.pack(self.code, len(raw), self.origin_rank) + raw
        return _pack(self.TYPE, body, request_id=self.request_id, latest_token=self.latest_token)

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        code_value, length, origin = r.unpack(_ERROR_FIXED, "fixed fields")
        code = _enum_value("ERROR", ErrorCode, code_value, "error code")
        if length != r.remaining:
            raise r.fail(f"message length {length} does not match the {r.remaining} bytes left in the body")
        try:
            message = bytes(r.take(length, "message")).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise r.fail(f"message is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        return cls(code, message, origin, header.request_id, header.latest_token)

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Error:
        return _from_wire_as(cls, data, max_frame_bytes)


@attrs.frozen
class Keepalive:
    """Sent on an idle link so the receiver's idle timer does not fire; carries nothing."""

    TYPE: ClassVar[FrameType] = FrameType.KEEPALIVE

    @property
    def request_id(self) -> int:
        return NO_REQUEST

    @property
    def latest_token(self) -> int:
        return NO_TOKEN

    def to_wire(self) -> bytes:
        return _pack(self.TYPE, b"")

    @classmethod
    def _from_body(cls, header: FrameHeader, r: BodyReader) -> Self:
        return cls()

    @classmethod
    def from_wire(cls, data: bytes, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Keepalive:
        return _from_wire_as(cls, data, max_frame_bytes)


Frame: TypeAlias = Hello | StartRequest | Boundary | Token | End | Cancel | Error | Keepalive
_F = TypeVar("_F", Hello, StartRequest, Boundary, Token, End, Cancel, Error, Keepalive)

_CLASSES: dict[FrameType, type[Frame]] = {
    cls.TYPE: cls for cls in (Hello, StartRequest, Boundary, Token, End, Cancel, Error, Keepalive)
}


def decode_body(header: FrameHeader, body: bytes | bytearray | memoryview) -> Frame:
    """Decode a body whose header :func:`decode_header` already validated."""
    if len(body) != header.body_length:
        raise ProtocolError(f"{header.type.name} frame: body is {len(body)} bytes, header says {header.body_length}")
    cls = _CLASSES[header.type]
    reader = BodyReader(header.type.name, body)
    frame = cls._from_body(header, reader)
    reader.finish()
    return frame


def decode_frame(data: bytes | bytearray | memoryview, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Decode exactly one whole frame (e.g. one WebSocket message); trailing or missing bytes are errors."""
    header = decode_header(data, max_frame_bytes=max_frame_bytes)
    if len(data) != header.frame_length:
        raise ProtocolError(
            f"{header.type.name} frame: message is {len(data)} bytes, header says {header.frame_length}"
        )
    return decode_body(header, memoryview(data)[HEADER_SIZE:])


def _from_wire_as(cls: type[_F], data: bytes, max_frame_bytes: int) -> _F:
    frame = decode_frame(data, max_frame_bytes=max_frame_bytes)
    if not isinstance(frame, cls):
        raise ProtocolError(f"expected a {cls.TYPE.name} frame, got {frame.TYPE.name}")
    return frame
