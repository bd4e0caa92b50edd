"""A ring node's receipts (opt-in, ``kvasir node --record DIR``): what it received and sent for each request, hashed
as frames pass, signed with its key when the request ends (docs/verification.md § The ring records).

A :class:`~kvasir.ring.observe.RequestObserver`: the node calls :meth:`NodeRecorder.take` for each input boundary
it takes (rank 0: :meth:`on_tokens` for the prompt's chunks and the tokens coming back, as ``TOKENS``), :meth:`seal`
for each boundary it sends (before the replay log and the link, so the bytes are the frame's) or, on the last rank,
:meth:`on_sample` with the last row's logits and the token (NO_TOKEN on a prefill chunk that does not sample) or
:meth:`on_skip` for a verify row it drops uncomputed, and :meth:`ended` when the request ends here. A speculative
verify row is a step of its own, at its own position (rank 0: one token each).
Replayed frames are not recorded again (the node drops them before these calls), and recording never touches what
is computed: it reads the bytes.

The live chain check (FLAG_CHAIN, docs/protocol.md): :meth:`seal` stamps the outgoing frame with this node's output
chain head after it (the one its receipt signs); :meth:`take`, when the incoming frame carries a head, compares it
with the predecessor's output chain as this node rebuilt it from what it received (its input chain's step hashes,
folded from the output chain's start) and says why they differ; the node then fails the request (CHAIN_MISMATCH).

At the end the request's :class:`~kvasir.verify.commit.WindowReceipt` goes to ``DIR/receipts/<name>.json`` and its
:class:`~kvasir.verify.audit.WindowLog` (receipt and input boundaries) to ``DIR/pending/<name>.log.json``, each
written atomically (temp file, rename). ``pending/`` is a spool bounded by ``keep_bytes`` (oldest first out): the
inputs wait there for the auditor's key (:func:`kvasir.verify.select.reveal`), which keeps the selected ones.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from kvasir.core.errors import KvasirError
from kvasir.core.identity import Identity
from kvasir.core.sampling import SamplingParams
from kvasir.verify.audit import LoggedInput, WindowLog, write_json
from kvasir.verify.commit import NO_TOKEN, TOKENS, Chain, Recorder, tokens_payload
from kvasir.verify.select import PENDING, RECEIPTS, log_name
from kvasir.wire import frames

log = logging.getLogger("kvasir.node")

#: Default cap on the input spool (``pending/``) of one node.
DEFAULT_KEEP_BYTES = 1 << 30


class OpenRecord:
    """One request on this window: its recorder and the inputs it took."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.inputs: list[LoggedInput] = []
        #: The predecessor's output chain as this node received it: what a FLAG_CHAIN head must equal.
        self.received = Chain(recorder.request, "out")

    def log(self, identity: Identity) -> WindowLog:
        """The signed record. A request that ended between taking an input and sending its output (a cancel, a
        failed compute) is signed up to its last complete step."""
        rec = self.recorder
        n = len(rec.outputs.steps)
        if len(rec.schedule) > n:
            inputs = Chain(rec.request, "in")
            for step in rec.inputs.steps[:n]:
                inputs.add(step)
            rec.inputs, rec.schedule = inputs, rec.schedule[:n]
            self.inputs = self.inputs[:n]
        return WindowLog(rec.receipt(identity), tuple(self.inputs))


class NodeRecorder:
    """Receipts of one node's window; every method but :meth:`write` is cheap enough for the event loop (it hashes
    one frame; signing and writing run in :meth:`write`, in a worker thread) and never raises into the data path."""

    def __init__(
        self,
        directory: Path,
        identity: Identity,
        model_sha256: str,
        window: tuple[int, int],
        kernel_class: str,
        *,
        keep_bytes: int = DEFAULT_KEEP_BYTES,
        required: bool = False,
    ) -> None:
        self.directory, self.identity, self.model_sha256 = directory, identity, model_sha256
        self.window, self.kernel_class, self.keep_bytes = window, kernel_class, keep_bytes
        #: Recording required (market rings: issue 24, N9): a boundary without a chain head, and an END from the last
        #: rank without its head, fail the request (CHAIN_MISMATCH) instead of passing unchecked.
        self.required = required
        (directory / RECEIPTS).mkdir(parents=True, exist_ok=True)
        (directory / PENDING).mkdir(parents=True, exist_ok=True)
        self._open: dict[int, OpenRecord] = {}
        #: The spool's files, oldest first, with their sizes (this node's window only: others share the directory).
        suffix = f"-{window[0]}-{window[1]}.log.json"
        spool = sorted((p for p in (directory / PENDING).glob(f"*{suffix}")), key=lambda p: p.stat().st_mtime)
        self._spool: OrderedDict[Path, int] = OrderedDict((p, p.stat().st_size) for p in spool)
        self.spool_bytes = sum(self._spool.values())
        self.written = self.evicted = self.failed = 0
        #: Input boundaries checked live against their chain head, and the mismatches among them.
        self.checked = self.mismatches = 0
        self._lock = threading.Lock()

    def begin(
        self, request: int, *, last: bool, sampling: SamplingParams, history: Sequence[int], params: bytes = b""
    ) -> None:
        rec = Recorder(
            request,
            self.model_sha256,
            self.window,
            self.kernel_class,
            sampling=sampling if last else None,
            history=history if last else (),
            params_hash=params.hex(),
        )
        self._open[request] = OpenRecord(rec)

    def records(self, request: int) -> bool:
        """Whether ``request`` is being recorded (begun, not ended)."""
        return request in self._open

    def on_input(self, request: int, pos: int, n_tokens: int, dtype: int, payload: bytes) -> None:
        o = self._open.get(request)
        if o is not None:
            o.recorder.on_input(pos, n_tokens, payload, dtype)
            o.inputs.append(LoggedInput(pos, n_tokens, dtype, payload))

    def take(self, frame: frames.Boundary) -> str | None:
        """Record an input boundary; when it carries a chain head (FLAG_CHAIN) and this request is recorded here,
        check it: the reason it differs from the chain of what this node received, or None. Unrecorded: ignored."""
        o = self._open.get(frame.request_id)
        if o is None:
            return None
        pos = frame.position  # a verify row's own position (its batch's, plus its row)
        o.recorder.on_input(pos, frame.n_tokens, frame.payload, frame.dtype.value)
        o.inputs.append(LoggedInput(pos, frame.n_tokens, frame.dtype.value, frame.payload))
        head = o.received.add(o.recorder.inputs.steps[-1])
        if not frame.chain:
            if not self.required:
                return None
            self.mismatches += 1
            return f"the boundary at position {pos} carries no chain head, and this ring requires recording"
        self.checked += 1
        if frame.chain.hex() == head:
            return None
        self.mismatches += 1
        return (
            f"the boundary at position {pos} carries chain head {frame.chain.hex()[:16]}…, but the"
            f" chain of the boundaries received is at {head[:16]}… (step {len(o.received.steps) - 1})"
        )

    def seal(self, frame: frames.Boundary) -> frames.Boundary:
        """Record an output boundary as it is sent; if the request is recorded here, the frame with this node's
        output chain head after it (FLAG_CHAIN), else the frame unchanged."""
        o = self._open.get(frame.request_id)
        if o is None:
            return frame
        head = o.recorder.on_output(frame.position, frame.n_tokens, frame.payload, frame.dtype.value)
        return attrs.evolve(frame, chain=bytes.fromhex(head))

    def head(self, request: int) -> bytes:
        """The output chain head of ``request`` so far (what its receipt will sign), or b"" if not recorded."""
        o = self._open.get(request)
        return bytes.fromhex(o.recorder.outputs.head) if o is not None and o.recorder.outputs.steps else b""

    def closes(self, frame: frames.End) -> str | None:
        """An END passing: when recording is required and the last rank sent no chain head (it did not record), why
        the request fails; else None."""
        if not self.required or frame.chain or frame.request_id not in self._open:
            return None
        self.mismatches += 1
        return f"END from rank {frame.origin_rank} carries no chain head, and this ring requires recording"

    def on_tokens(self, request: int, pos: int, tokens: Sequence[int]) -> None:
        self.on_input(request, pos, len(tokens), TOKENS, tokens_payload(tokens))

    def on_output(self, request: int, pos: int, n_tokens: int, dtype: int, payload: bytes) -> None:
        o = self._open.get(request)
        if o is not None:
            o.recorder.on_output(pos, n_tokens, payload, dtype)

    def on_sample(self, request: int, pos: int, n_tokens: int, logits: bytes, token: int | None) -> None:
        """Last rank: may run in the stage's worker thread (the request's lock is held, so never concurrently)."""
        o = self._open.get(request)
        if o is not None:
            o.recorder.on_sample(pos, n_tokens, logits, NO_TOKEN if token is None else token)

    def on_skip(self, request: int, pos: int, n_tokens: int) -> None:
        """Last rank: a verify row taken (:meth:`take`) and dropped uncomputed, behind a rejected draft."""
        o = self._open.get(request)
        if o is not None:
            o.recorder.on_skip(pos, n_tokens)

    def end(self, request: int) -> OpenRecord | None:
        """The request ended here: its record (None if it completed no step here), for :meth:`write`."""
        o = self._open.pop(request, None)
        if o is None or not o.recorder.outputs.steps:
            return None
        return o

    def ended(self, request: int) -> Callable[[], None] | None:
        """The request ended here (:class:`~kvasir.ring.observe.RequestObserver`): its :meth:`write`, or None."""
        done = self.end(request)
        return None if done is None else functools.partial(self.write, done)

    def write(self, done: OpenRecord) -> None:
        """Sign and store a record (blocking: run it in a worker thread), then trim the spool to ``keep_bytes``."""
        request = done.recorder.request
        try:
            record = done.log(self.identity)
            name = log_name(request, self.window)
            write_json(self.directory / RECEIPTS / f"{name}.json", record.receipt.to_wire())
            path = self.directory / PENDING / f"{name}.log.json"
            write_json(path, record.to_wire())
            size = path.stat().st_size
        except (KvasirError, OSError) as exc:  # a full disk must not fail the ring: the request is already answered
            with self._lock:
                self.failed += 1
            log.warning("request %x: receipt not written: %s", request, exc)
            return
        with self._lock:  # requests end in several worker threads at once
            self.written += 1
            self._spool[path] = size
            self.spool_bytes += size
            while self.spool_bytes > self.keep_bytes and len(self._spool) > 1:
                old, old_size = self._spool.popitem(last=False)
                self.spool_bytes -= old_size
                with contextlib.suppress(FileNotFoundError):  # gone already if the auditor revealed its key over it
                    os.unlink(old)
                self.evicted += 1
