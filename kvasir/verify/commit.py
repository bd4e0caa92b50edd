"""Commitments: what a node signs about one request's work on its window.

Each step of a request (a prefill chunk or a decode token) enters a window as an input boundary and leaves it as
an output boundary (on the last rank: the last row's logits and the sampled token). :func:`step_hash` binds a
boundary's payload bytes to its position, row count and dtype; a :class:`Chain` folds the step hashes of one
direction into a running head, so a node can commit as frames pass without keeping them. At the end of the request
the node signs a :class:`WindowReceipt`: the window, its kernel class, the schedule, both chain heads and every
step's input and output hash. A successor holds the predecessor's output hashes against its own input hashes
(:func:`first_mismatch`); an auditor re-executes the window from the logged inputs and compares output hashes
(:mod:`kvasir.verify.audit`). Everything here is pure; docs/verification.md has the design.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from typing import Any

import attrs

from kvasir.core.errors import InputError, KvasirError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.sampling import SamplingParams
from kvasir.core.schema import Json, register_record, structure, unstructure
from kvasir.core.signed import canonical_json, sign, unb64url
from kvasir.core.validators import matches, rule

#: dtype code of an input that is token ids (rank 0), beside the wire's BoundaryDType codes 0-2.
TOKENS = 100
#: dtype code of a last-rank output: the last row's logits (f32) followed by the sampled token (int32).
LOGITS_TOKEN = 101
#: Token id a last-rank step records when it does not sample (a prefill chunk before the prompt's last, a skipped row).
NO_TOKEN = -1
#: dtype code of a last-rank step it took but did not compute: a speculative verify row behind a rejected draft, which
#: the next step rolls back (its output hash is :func:`skip_hash`: no bytes).
SKIPPED = 102
STEP_DOMAIN = b"kvasir-step/v1\n"
CHAIN_DOMAIN = b"kvasir-chain/v1\n"
RECEIPT_DOMAIN = b"kvasir-window-receipt/v1\n"
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: Steps one receipt may list (a 32k-token request decoded one token a step, with room for the prefill).
MAX_STEPS = 1 << 16


class VerificationError(KvasirError):
    """A receipt, proof or log that does not hold together (a bad signature, inputs that are not the committed ones)."""


def step_hash(pos: int, n_tokens: int, dtype: int, payload: bytes) -> str:
    """The commitment to one boundary: sha256 over a domain, position, rows, dtype and the payload bytes."""
    h = hashlib.sha256(STEP_DOMAIN)
    h.update(struct.pack("<QII", pos, n_tokens, dtype))
    h.update(payload)
    return h.hexdigest()


def skip_hash(pos: int, n_tokens: int) -> str:
    """The output commitment of a skipped step (see SKIPPED)."""
    return step_hash(pos, n_tokens, SKIPPED, b"")


def tokens_payload(tokens: Sequence[int]) -> bytes:
    """Token ids as the bytes rank 0's input commitment hashes (little-endian int32)."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def sample_payload(logits: bytes, token: int) -> bytes:
    """A last-rank step's output bytes: its logits row, then the sampled token."""
    return logits + struct.pack("<i", token)


class Chain:
    """A running hash chain over step hashes: ``head = sha256(domain, head, step)``, starting from the request."""

    def __init__(self, request: int, direction: str) -> None:
        self.head = hashlib.sha256(CHAIN_DOMAIN + f"{request}/{direction}".encode()).hexdigest()
        self.steps: list[str] = []

    def add(self, step: str) -> str:
        self.head = hashlib.sha256(bytes.fromhex(self.head) + bytes.fromhex(step)).hexdigest()
        self.steps.append(step)
        return self.head


def chain_head(request: int, direction: str, steps: Sequence[str]) -> str:
    chain = Chain(request, direction)
    for s in steps:
        chain.add(s)
    return chain.head


_hexes = rule(
    lambda v: len(v) <= MAX_STEPS and all(isinstance(h, str) and _HEX64.fullmatch(h) for h in v),
    f"must list at most {MAX_STEPS} sha256 hashes in lowercase hex",
)
_hex = matches(_HEX64, "must be a sha256 in lowercase hex")
_hex_or_empty = rule(lambda v: v == "" or bool(_HEX64.fullmatch(v)), "must be empty or a sha256 in lowercase hex")


@attrs.frozen
class WindowReceipt:
    """One node's signed account of one request on its window (see the module docstring)."""

    request: int = attrs.field(validator=attrs.validators.instance_of(int))
    model_sha256: str = attrs.field(validator=_hex)
    start: int
    end: int
    kernel_class: str
    #: (position, n_tokens) of every step, in order: the schedule a re-execution must follow.
    schedule: tuple[tuple[int, int], ...]
    input_head: str = attrs.field(validator=_hex)
    output_head: str = attrs.field(validator=_hex)
    input_hashes: tuple[str, ...] = attrs.field(validator=_hexes)
    output_hashes: tuple[str, ...] = attrs.field(validator=_hexes)
    #: dtype code of the inputs (a BoundaryDType, or TOKENS on rank 0) and of the outputs (or LOGITS_TOKEN).
    in_dtype: int
    out_dtype: int
    #: The signer's public key (``ed25519:…``).
    node_key: str
    #: Last rank: the sampler settings (seed included) and the sampled token of each step, so anyone holding the
    #: output head can re-sample; ``history`` is what the sampler accepted before the first step (the prompt, when
    #: repeat penalties read it).
    sampling: SamplingParams | None = None
    tokens: tuple[int, ...] = ()
    history: tuple[int, ...] = ()
    #: The parameters hash of the START this node served (hex; "" without one): what its entry committed to, as it
    #: reached this node. A receipt whose hash is not the entry's shows the START altered before this node; the last
    #: rank's, with ``sampling``, shows the parameters it sampled with (docs/protocol.md § START).
    params_hash: str = attrs.field(default="", validator=_hex_or_empty)
    signature: str = ""

    def __attrs_post_init__(self) -> None:
        n = len(self.schedule)
        if not 0 <= self.request < 2**64:
            raise InputError("receipt request id must be in [0, 2^64)")
        if n > MAX_STEPS or not all(len(step) == 2 and step[0] >= 0 and step[1] > 0 for step in self.schedule):
            raise InputError(f"receipt schedule must list at most {MAX_STEPS} (position >= 0, n_tokens > 0) steps")
        if not 0 <= self.start < self.end:
            raise InputError(f"receipt window [{self.start}, {self.end}] is not a window")
        if not (len(self.input_hashes) == len(self.output_hashes) == n):
            raise InputError(f"receipt lists {n} steps but {len(self.input_hashes)}/{len(self.output_hashes)} hashes")
        if self.out_dtype == LOGITS_TOKEN and len(self.tokens) != n:
            raise InputError(f"a last-rank receipt lists {n} steps but {len(self.tokens)} tokens")
        PublicKey.from_text(self.node_key)

    @property
    def key(self) -> PublicKey:
        return PublicKey.from_text(self.node_key)

    @property
    def last(self) -> bool:
        return self.out_dtype == LOGITS_TOKEN

    def message(self) -> bytes:
        """The signed bytes: a domain and the canonical JSON of every field but the signature."""
        return canonical_json(RECEIPT_DOMAIN, self.to_wire())

    def signed(self, identity: Identity) -> WindowReceipt:
        if identity.public != self.key:
            raise InputError("a receipt is signed by the key it names")
        return attrs.evolve(self, signature=sign(identity, self.message()))

    def verify(self) -> None:
        """VerificationError unless the signature is the named key's and the chain heads match the step lists."""
        if not self.key.verify(unb64url(self.signature, "receipt signature"), self.message()):
            raise VerificationError(f"receipt of request {self.request}: the signature is not {self.key.fingerprint}'s")
        if chain_head(self.request, "in", self.input_hashes) != self.input_head:
            raise VerificationError(f"receipt of request {self.request}: input hashes do not make the input head")
        if chain_head(self.request, "out", self.output_hashes) != self.output_head:
            raise VerificationError(f"receipt of request {self.request}: output hashes do not make the output head")

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, data: Any, where: str = "receipt") -> WindowReceipt:
        return structure(data, cls, where=where)


class Recorder:
    """What a ring node keeps for one request on its window; it hashes frames as they pass and signs at the end.

    ``on_input`` for each input boundary (rank 0: ``tokens_payload`` with dtype TOKENS), ``on_output`` for each
    output boundary, ``on_sample`` on the last rank instead (``on_skip`` for a verify row it drops uncomputed);
    ``receipt`` signs the account.
    """

    def __init__(
        self,
        request: int,
        model_sha256: str,
        window: tuple[int, int],
        kernel_class: str,
        *,
        sampling: SamplingParams | None = None,
        history: Sequence[int] = (),
        params_hash: str = "",
    ) -> None:
        self.request, self.model_sha256, self.window, self.kernel_class = request, model_sha256, window, kernel_class
        self.sampling, self.history, self.params_hash = sampling, tuple(history), params_hash
        self.inputs, self.outputs = Chain(request, "in"), Chain(request, "out")
        self.schedule: list[tuple[int, int]] = []
        self.tokens: list[int] = []
        self.in_dtype = self.out_dtype = -1

    def on_input(self, pos: int, n_tokens: int, payload: bytes, dtype: int) -> str:
        self.schedule.append((pos, n_tokens))
        self.in_dtype = dtype
        return self.inputs.add(step_hash(pos, n_tokens, dtype, payload))

    def on_output(self, pos: int, n_tokens: int, payload: bytes, dtype: int) -> str:
        self.out_dtype = dtype
        return self.outputs.add(step_hash(pos, n_tokens, dtype, payload))

    def on_sample(self, pos: int, n_tokens: int, logits: bytes, token: int) -> str:
        self.tokens.append(token)
        return self.on_output(pos, n_tokens, sample_payload(logits, token), LOGITS_TOKEN)

    def on_skip(self, pos: int, n_tokens: int) -> str:
        """Last rank: a step taken but not computed (SKIPPED); it samples nothing."""
        self.tokens.append(NO_TOKEN)
        return self.outputs.add(skip_hash(pos, n_tokens))

    def receipt(self, identity: Identity) -> WindowReceipt:
        return WindowReceipt(
            request=self.request,
            model_sha256=self.model_sha256,
            start=self.window[0],
            end=self.window[1],
            kernel_class=self.kernel_class,
            schedule=tuple(self.schedule),
            input_head=self.inputs.head,
            output_head=self.outputs.head,
            input_hashes=tuple(self.inputs.steps),
            output_hashes=tuple(self.outputs.steps),
            in_dtype=self.in_dtype,
            out_dtype=self.out_dtype,
            node_key=identity.public.to_text(),
            sampling=self.sampling,
            tokens=tuple(self.tokens),
            history=self.history,
            params_hash=self.params_hash,
        ).signed(identity)


def successor_mismatch(predecessor_outputs: Sequence[str], inputs: Sequence[str]) -> int | None:
    """The successor check on two receipts: the first step whose input is not the predecessor's output, or None.
    A successor's inputs must be the start of its predecessor's outputs; the predecessor may list more (frames still
    on their way when the request ended at the successor, such as a verify batch's rows after an EOG), never fewer."""
    return first_mismatch(predecessor_outputs[: len(inputs)], inputs)


def first_mismatch(predecessor_outputs: Sequence[str], inputs: Sequence[str]) -> int | None:
    """The first step whose input hash is not the predecessor's output hash (a length difference counts at the end
    of the shorter list); None when they agree."""
    for i, (a, b) in enumerate(zip(predecessor_outputs, inputs, strict=False)):
        if a != b:
            return i
    if len(predecessor_outputs) != len(inputs):
        return min(len(predecessor_outputs), len(inputs))
    return None


register_record(
    WindowReceipt, window=True, omit_if_none=("sampling",), omit_if_empty=("tokens", "history", "params_hash")
)
