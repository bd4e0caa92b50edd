"""Audits: re-execute one window of one request from its logged input boundaries and compare output bytes.

Within a kernel class the window's output is a function of the stage file, the inputs and the schedule
(docs/verification.md), so an audit is a byte comparison: equal, the receipt stands; different, the auditor holds
a :class:`FraudProof` that anyone of the class checks with ``kvasir audit verify-proof FILE --stage STAGE``.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from kvasir.core.errors import InputError, ProtocolError
from kvasir.core.sampling import SamplingParams
from kvasir.core.schema import (
    FieldError,
    Json,
    record_hooks,
    register_hooks,
    register_record,
    require_object,
    structure,
    unstructure,
)
from kvasir.core.signed import canonical_json
from kvasir.stage.engine import Stage, StageConfig
from kvasir.util.files import atomic_output
from kvasir.verify.commit import (
    LOGITS_TOKEN,
    NO_TOKEN,
    SKIPPED,
    TOKENS,
    VerificationError,
    WindowReceipt,
    first_mismatch,
    sample_payload,
    skip_hash,
    step_hash,
)
from kvasir.verify.kernel import stage_kernel_class
from kvasir.wire.boundary import BoundaryDType, decode_boundary, encode_boundary

PROOF_DOMAIN = "kvasir-fraud-proof/v1"


@attrs.frozen
class LoggedInput:
    """One logged input of a window: a boundary frame's payload (rank 0: token ids) at its position.

    On the wire (window logs, fraud proofs) ``{"pos", "n_tokens", "dtype", "payload"}`` with the payload in base64url;
    read through the schema converter, which also checks that the payload fits the rows and dtype
    (:func:`_check_logged`): a market parses these from untrusted POSTs.
    """

    pos: int
    n_tokens: int
    dtype: int
    payload: bytes

    @property
    def hash(self) -> str:
        return step_hash(self.pos, self.n_tokens, self.dtype, self.payload)

    @classmethod
    def of_tokens(cls, pos: int, tokens: Sequence[int]) -> LoggedInput:
        return cls(pos, len(tokens), TOKENS, struct.pack(f"<{len(tokens)}i", *tokens))

    @classmethod
    def of_hidden(cls, pos: int, hidden: np.ndarray, dtype: BoundaryDType = BoundaryDType.F32) -> LoggedInput:
        return cls(pos, int(hidden.shape[0]), int(dtype), encode_boundary(hidden, dtype))

    def tokens(self) -> list[int]:
        return list(struct.unpack(f"<{self.n_tokens}i", self.payload))

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, data: Any, where: str = "input") -> LoggedInput:
        return structure(data, cls, where=where)


_logged_fields, _logged_to_wire = record_hooks(LoggedInput)


def _check_logged(data: object, tp: type) -> LoggedInput:
    b = _logged_fields(data, tp)
    pos, n, dtype, raw = b.pos, b.n_tokens, b.dtype, b.payload
    if not 0 <= pos < 2**32:
        raise FieldError("pos", "must be in [0, 2^32)")
    if not 0 < n < 2**32:
        raise FieldError("n_tokens", "must be in [1, 2^32)")
    if dtype == TOKENS:
        if len(raw) != 4 * n:
            raise FieldError("payload", f"of {n} token ids takes {4 * n} bytes, not {len(raw)}")
    elif dtype in tuple(BoundaryDType):
        if len(raw) % (n * BoundaryDType(dtype).itemsize):
            raise FieldError("payload", f"of {len(raw)} bytes is not {n} rows of {BoundaryDType(dtype).name}")
    else:
        raise FieldError("dtype", f"{dtype} is neither a boundary dtype nor token ids ({TOKENS})")
    return b


register_hooks(LoggedInput, _check_logged, _logged_to_wire)


@attrs.frozen
class StepOutput:
    """One step's output as the window computed it; ``payload`` is the boundary (or the last row's logits)."""

    pos: int
    n_tokens: int
    dtype: int
    payload: bytes
    token: int | None
    hash: str

    def as_input(self) -> LoggedInput:
        """The successor's logged input for this step (non-last ranks)."""
        return LoggedInput(self.pos, self.n_tokens, self.dtype, self.payload)


class WindowRunner:
    """One request on one window, step by step, on a fresh sequence (what a node serves and an auditor re-runs).

    On the last rank a step samples when asked, with a sampler built from ``sampling`` that first accepts
    ``history``; its output is the last row's logits and the token (NO_TOKEN when it does not sample).

    A step at a position before the end of what the window computed follows rejected speculative drafts: the cache
    forgets from there first, as the ring node does (``kvasir.ring.speculation.window_step``). A plain request's
    steps never go back, so this never happens for them. A step past the end (a hole) cannot be computed: its output
    is no hash, so it differs from whatever was signed for it.
    """

    def __init__(
        self,
        stage: Stage,
        *,
        out_dtype: BoundaryDType = BoundaryDType.F32,
        sampling: SamplingParams | None = None,
        history: Sequence[int] = (),
        seq_id: int = 0,
    ) -> None:
        self.stage, self.out_dtype, self.seq_id = stage, out_dtype, seq_id
        self._end = 0  # where the sequence's cache ends
        stage.free_sequence(seq_id)
        self._sampler = stage.new_sampler(sampling or SamplingParams.GREEDY) if stage.info.last else None
        if self._sampler is not None:
            for t in history:
                self._sampler.accept(t)

    def step(self, b: LoggedInput, *, sample: bool = True) -> StepOutput:
        stage, info = self.stage, self.stage.info
        if b.pos > self._end:  # no window computes past the positions its cache holds: nothing matches this step
            missing = f"nothing: position {b.pos} leaves a hole after the {self._end} positions computed before it"
            return StepOutput(b.pos, b.n_tokens, SKIPPED, b"", None, missing)
        if b.pos < self._end:
            stage.truncate(self.seq_id, b.pos)
        self._end = b.pos + b.n_tokens
        if b.dtype == TOKENS:
            result = stage.forward(self.seq_id, b.pos, tokens=b.tokens())
        else:
            hidden = decode_boundary(b.payload, b.n_tokens, info.n_embd, BoundaryDType(b.dtype))
            result = stage.forward(self.seq_id, b.pos, hidden=hidden)
        if self._sampler is not None:
            token = stage.sample(self._sampler) if sample else NO_TOKEN
            payload = stage.logits().tobytes()
            h = step_hash(b.pos, b.n_tokens, LOGITS_TOKEN, sample_payload(payload, token))
            return StepOutput(b.pos, b.n_tokens, LOGITS_TOKEN, payload, token, h)
        assert result is not None
        dtype = self.out_dtype
        try:
            payload = encode_boundary(result, dtype)
        except ProtocolError:  # beyond f16's range: the ring node sends this step in f32 (ring.node._boundary)
            dtype = BoundaryDType.F32
            payload = encode_boundary(result, dtype)
        h = step_hash(b.pos, b.n_tokens, int(dtype), payload)
        return StepOutput(b.pos, b.n_tokens, int(dtype), payload, None, h)

    def skip(self, b: LoggedInput) -> StepOutput:
        """A step the last rank took but did not compute (a stale verify row): no compute, no sample."""
        return StepOutput(b.pos, b.n_tokens, SKIPPED, b"", NO_TOKEN, skip_hash(b.pos, b.n_tokens))

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self.stage.free_sequence(self.seq_id)

    def __enter__(self) -> WindowRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def execute(
    stage: Stage,
    inputs: Sequence[LoggedInput],
    *,
    out_dtype: BoundaryDType = BoundaryDType.F32,
    sampling: SamplingParams | None = None,
    history: Sequence[int] = (),
    samples: Sequence[bool] | None = None,
    skips: Sequence[bool] | None = None,
) -> list[StepOutput]:
    """Run ``inputs`` through the window in order, one llama.cpp call per step (the schedule); on the last rank
    step ``i`` samples when ``samples[i]`` (default: every step), and is skipped (not computed) when ``skips[i]``."""
    with WindowRunner(stage, out_dtype=out_dtype, sampling=sampling, history=history) as runner:
        return [
            runner.skip(b) if skips is not None and skips[i] else runner.step(b, sample=samples is None or samples[i])
            for i, b in enumerate(inputs)
        ]


def legitimate_skips(schedule: Sequence[tuple[int, int]], skipped: Sequence[bool]) -> list[bool]:
    """Pure: which of a last rank's skipped steps an honest node skips: a verify row behind a rejected draft, which
    the next computed step rolls back (it starts at or before the row), or one after which nothing was computed (the
    request ended). Any other skip left a hole in the cache the following steps read: an audit computes it, and the
    skip's empty output then differs from what the window computes."""
    legit = [False] * len(schedule)
    next_pos: int | None = None  # the position of the next computed step (scanning back from the end)
    for i in range(len(schedule) - 1, -1, -1):
        pos = schedule[i][0]
        if skipped[i]:
            legit[i] = next_pos is None or next_pos <= pos
        else:
            next_pos = pos
    return legit


def skipped_steps(receipt: WindowReceipt) -> list[bool]:
    """Which steps of a receipt its signer says it skipped (output hash :func:`~kvasir.verify.commit.skip_hash`)."""
    return [h == skip_hash(p, n) for h, (p, n) in zip(receipt.output_hashes, receipt.schedule, strict=True)]


def receipt_skips(receipt: WindowReceipt) -> list[bool]:
    """Which steps of a receipt are skips an audit takes as they are (:func:`legitimate_skips`)."""
    return legitimate_skips(receipt.schedule, skipped_steps(receipt))


@attrs.frozen
class AuditResult:
    """The verdict of one audit: ``ok`` when every recomputed output hash equals the signed one."""

    ok: bool
    steps: int
    #: First step whose output differs (None when ok).
    step: int | None
    seconds: float
    signed_hash: str | None = None
    recomputed_hash: str | None = None
    #: Last rank: the first step whose signed token is not the re-sampled one (None when they agree).
    token_step: int | None = None
    #: Steps taken as skips, not computed: speculative verify rows that the next step rolled back.
    skipped: int = 0


def load_stage(path: Path, inputs: Sequence[LoggedInput]) -> Stage:
    """A stage sized for one request's re-execution (n_ctx, n_batch and one sequence: none of them changes bits)."""
    n_ctx = max((b.pos + b.n_tokens for b in inputs), default=1)
    n_batch = max(512, *(b.n_tokens for b in inputs)) if inputs else 512
    return Stage.load(StageConfig(path, n_ctx=max(256, n_ctx), n_seq_max=1, n_batch=n_batch, n_threads=None))


def check_inputs(receipt: WindowReceipt, inputs: Sequence[LoggedInput]) -> None:
    """VerificationError unless ``inputs`` are the boundaries the receipt commits to, step for step."""
    if len(inputs) > len(receipt.input_hashes):
        raise VerificationError(f"{len(inputs)} logged inputs for a receipt of {len(receipt.input_hashes)} steps")
    bad = first_mismatch(receipt.input_hashes[: len(inputs)], [b.hash for b in inputs])
    if bad is not None:
        raise VerificationError(f"logged input {bad} is not the boundary the receipt commits to")
    if [(b.pos, b.n_tokens) for b in inputs] != list(receipt.schedule[: len(inputs)]):
        raise VerificationError("the logged inputs do not follow the receipt's schedule")


def _check_stage(stage: Stage, receipt: WindowReceipt) -> None:
    info = stage.info
    if (info.start, info.end) != (receipt.start, receipt.end):
        raise VerificationError(
            f"stage holds layers {info.start}:{info.end}, the receipt {receipt.start}:{receipt.end}"
        )
    if info.model_sha256 is not None and info.model_sha256 != receipt.model_sha256:
        raise VerificationError(
            f"stage is of model {info.model_sha256[:12]}…, the receipt {receipt.model_sha256[:12]}…"
        )
    mine = stage_kernel_class(stage)
    if mine != receipt.kernel_class:
        raise VerificationError(f"this auditor's kernel class {mine} is not the receipt's {receipt.kernel_class}")


def audit_window(stage: Stage | Path, inputs: Sequence[LoggedInput], receipt: WindowReceipt) -> AuditResult:
    """Re-execute the receipt's window from the logged ``inputs`` (all steps, or the first k) and compare hashes.

    Raises VerificationError when the receipt's signature fails, the inputs are not the committed ones, or this
    machine cannot judge (another window, model or kernel class): none of those is evidence against the node.
    """
    receipt.verify()
    check_inputs(receipt, inputs)
    if isinstance(stage, Path):
        with load_stage(stage, inputs) as loaded:
            return audit_window(loaded, inputs, receipt)
    _check_stage(stage, receipt)
    t0 = time.perf_counter()
    n = len(inputs)
    skips = receipt_skips(receipt)[:n]
    outputs = execute(
        stage,
        inputs,
        out_dtype=BoundaryDType(receipt.out_dtype) if not receipt.last else BoundaryDType.F32,
        sampling=receipt.sampling,
        history=receipt.history,
        samples=[t != NO_TOKEN for t in receipt.tokens[:n]] if receipt.last else None,
        skips=skips,
    )
    seconds = time.perf_counter() - t0
    got = [o.hash for o in outputs]
    step = first_mismatch(receipt.output_hashes[:n], got)
    token_step = None
    if receipt.last:
        token_step = first_mismatch([str(t) for t in receipt.tokens[:n]], [str(o.token) for o in outputs])
    return AuditResult(
        ok=step is None,
        steps=n,
        step=step,
        seconds=seconds,
        signed_hash=receipt.output_hashes[step] if step is not None else None,
        recomputed_hash=got[step] if step is not None else None,
        token_step=token_step,
        skipped=sum(skips),
    )


def check_tokens(stage: Stage | Path, inputs: Sequence[LoggedInput], receipt: WindowReceipt) -> int | None:
    """Token receipt: re-sample every step of a last-rank receipt from its logged final boundaries with its sampler
    settings and seed; the first step whose signed token differs, or None."""
    if not receipt.last:
        raise InputError("only a last-rank receipt carries tokens")
    return audit_window(stage, inputs, receipt).token_step


# ---------------------------------------------------------------------------------------------- fraud proofs


@attrs.frozen
class FraudProof:
    """Self-contained evidence that ``suspect`` signed an output its window does not compute from its inputs.

    ``predecessor`` (absent on rank 0) is the previous rank's signed receipt: its output hashes are the suspect's
    input hashes, so neither can disown the inputs. ``inputs`` are the boundaries of steps 0..``step``.
    """

    suspect: WindowReceipt
    inputs: tuple[LoggedInput, ...]
    step: int
    predecessor: WindowReceipt | None = None

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, data: Any, where: str = "proof") -> FraudProof:
        return structure(data, cls, where=where)


_proof_fields, _proof_wire = record_hooks(
    FraudProof, omit_if_none=("predecessor",), key_order=("suspect", "step", "inputs", "predecessor")
)


def _proof_from_wire(data: object, tp: type) -> FraudProof:
    data = require_object(data)
    if data.get("kind") != PROOF_DOMAIN:
        raise FieldError("kind", f"must be {PROOF_DOMAIN!r}: this is not a fraud proof")
    return _proof_fields({k: v for k, v in data.items() if k != "kind"}, tp)


def _proof_to_wire(proof: FraudProof) -> Json:
    return {"kind": PROOF_DOMAIN, **_proof_wire(proof)}


register_hooks(FraudProof, _proof_from_wire, _proof_to_wire)


def make_proof(
    receipt: WindowReceipt, inputs: Sequence[LoggedInput], result: AuditResult, predecessor: WindowReceipt | None = None
) -> FraudProof:
    if result.ok or result.step is None:
        raise InputError("an audit that found the outputs equal proves nothing")
    return FraudProof(receipt, tuple(inputs[: result.step + 1]), result.step, predecessor)


def check_proof(proof: FraudProof) -> None:
    """Everything about a fraud proof that needs no window: both receipts' signatures, the inputs against the
    suspect's committed input hashes and schedule, and the predecessor's signed outputs against them.
    VerificationError when any fails (the proof is malformed: it says nothing about the suspect)."""
    s = proof.suspect
    s.verify()
    if not 0 <= proof.step < len(s.output_hashes) or len(proof.inputs) != proof.step + 1:
        raise VerificationError(f"a proof of step {proof.step} needs the inputs of steps 0..{proof.step}")
    check_inputs(s, proof.inputs)
    p = proof.predecessor
    if p is not None:
        p.verify()
        if (p.request, p.model_sha256, p.end) != (s.request, s.model_sha256, s.start):
            raise VerificationError("the predecessor's receipt is not of the same request on the window before")
        bad = first_mismatch(p.output_hashes[: proof.step + 1], s.input_hashes[: proof.step + 1])
        if bad is not None:
            raise VerificationError(f"at step {bad} the suspect's input is not the predecessor's output")


def proof_id(proof: FraudProof) -> str:
    """A proof's identity: sha256 over its canonical JSON (what a market writes down with a withdrawal)."""
    return hashlib.sha256(canonical_json(b"", proof.to_wire(), drop=None)).hexdigest()


def verify_proof(proof: FraudProof, stage: Stage | Path) -> AuditResult:
    """Check a fraud proof from scratch: :func:`check_proof`, then re-execution.

    Returns the re-execution's verdict (``ok`` False: the proof holds); VerificationError when the proof itself is
    malformed or this machine cannot judge it.
    """
    check_proof(proof)
    return audit_window(stage, proof.inputs, proof.suspect)


def proof_summary(proof: FraudProof, result: AuditResult) -> str:
    s = proof.suspect
    who = f"node {s.key.fingerprint} (layers {s.start}:{s.end}, request {s.request})"
    if result.ok:
        return f"proof does NOT hold: {who} computed every step of the proof correctly"
    return (
        f"proof holds: {who} signed output {result.signed_hash} at step {result.step}, "
        f"but its window computes {result.recomputed_hash}"
    )


# ---------------------------------------------------------------------------------------------- files


@attrs.frozen
class WindowLog:
    """What a node (or its auditor) keeps of one request on one window: the signed receipt, the input boundaries
    and, when it has it, the predecessor's signed receipt. The file ``kvasir audit run`` reads."""

    receipt: WindowReceipt
    inputs: tuple[LoggedInput, ...]
    predecessor: WindowReceipt | None = None

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, data: Any, where: str = "log") -> WindowLog:
        return structure(data, cls, where=where)


register_record(WindowLog, omit_if_none=("predecessor",))


def write_json(path: Path, data: Json) -> None:
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(data, separators=(",", ":")) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not JSON: {exc}") from exc
