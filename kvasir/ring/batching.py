"""Batched decode across requests (``kvasir node --batch N``): a throughput mode, off by default.

When several requests' decode steps (one token each: a TOKEN at rank 0, a one-row BOUNDARY elsewhere) wait at a node
at the same time, the node computes them in one ``llama_decode`` (``Stage.forward_batch``) instead of one after the
other. Scheduling is continuous: a step that finds the node idle runs as soon as the event loop has read what already
arrived (frames of a predecessor's batch come as a burst), alone if nothing else did (no added latency); steps that
arrive while a batch computes queue, and the next batch takes them all (up to N). Each request then goes on as if
computed alone: its boundary is sent, or, on the last rank, its row is sampled (``Stage.batch_index``).

Not bit-exact: llama.cpp's numbers for a sequence depend on the micro-batch it is computed in
(docs/speculation.md § Batched decode), so a batching ring gives up bit-equality with ``kvasir generate``; with
``--batch 1`` (the default) every ``llama_decode`` holds one sequence, as before, and the ring is exact. Prefill
chunks and speculative verify batches are never batched, nor are recorded requests (an audit re-runs plain steps).

What is sent is unchanged (the same frames, one per request and step, kept in the replay log as before): batching
groups compute only, so failover replay works the same. A replay burst brings several steps of one request at once;
a request has at most one step queued or computing, later ones wait for it (:meth:`DecodeBatcher.submit`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio

from kvasir.ring.compute import RingStage
from kvasir.ring.requests import RequestState
from kvasir.stage.engine import BatchItem
from kvasir.wire import Boundary, Token

#: The longest a batch waits for frames that have already arrived to be read (normally microseconds).
GATHER_LIMIT_S = 0.002
#: Scheduler passes without a new step after which the batch is taken (see ``DecodeBatcher._gather``).
QUIET_ROUNDS = 8


@attrs.frozen(eq=False)
class DecodeStep:
    """One request's decode step waiting at this node: the frame that brought it (TOKEN at rank 0, else BOUNDARY)."""

    state: RequestState
    frame: Token | Boundary

    @property
    def pos(self) -> int:
        return self.frame.position if isinstance(self.frame, Token) else self.frame.first_position


def batchable(state: RequestState, frame: Token | Boundary, *, recorded: bool) -> bool:
    """Whether a frame is a plain decode step that batching may group (pure): one token, no drafts, past the prompt,
    of a request that neither speculates (its steps may roll back) nor is recorded (receipts promise exact bits)."""
    if state.start.speculate or recorded or frame.drafts:
        return False
    if isinstance(frame, Boundary):
        return frame.n_tokens == 1 and frame.final and frame.first_position >= state.prompt_len
    return True  # a TOKEN at rank 0 is always a decode step


def take_batch(queue: deque[DecodeStep], limit: int) -> list[DecodeStep]:
    """The next batch: the oldest ``limit`` waiting steps (each request appears at most once in the queue), in
    ascending sequence id, the order ``Stage.forward_batch`` takes (and in which llama.cpp puts consecutive ids in
    one micro-batch)."""
    batch = [queue.popleft() for _ in range(min(limit, len(queue)))]
    return sorted(batch, key=lambda step: step.state.seq)


def compute_batch(stage: RingStage, steps: Sequence[DecodeStep]) -> list[Any]:
    """Worker thread: the steps through this window in one ``forward_batch``. Returns each step's boundary row on a
    non-last stage, its sampled token on the last (each request's sampler on its own output row)."""
    items = [
        BatchItem(s.state.seq, s.pos, tokens=[s.frame.token_id])
        if isinstance(s.frame, Token)
        else BatchItem(s.state.seq, s.pos, hidden=s.frame.to_array())
        for s in steps
    ]
    out = stage.forward_batch(items)
    for s in steps:
        s.state.cache.computed(s.pos, 1)
    if not stage.info.last:
        return list(out)
    return [stage.sample(s.state.sampler, stage.batch_index(i, 1)) for i, s in enumerate(steps)]


class DecodeBatcher:
    """Queues decode steps and runs them in batches of at most ``limit``, one batch at a time (:meth:`run`, a task
    of the node). ``compute`` runs one batch (the node's: locks, worker thread, then each request's next frame)."""

    def __init__(self, limit: int, compute: Callable[[list[DecodeStep]], Awaitable[None]]) -> None:
        self.limit = limit
        self._compute = compute
        self._queue: deque[DecodeStep] = deque()
        self._wake = trio.Event()
        #: Requests with a step queued or computing, set when it is done.
        self._pending: dict[int, trio.Event] = {}
        #: Sizes of the batches run (status and tests): how often requests really shared a decode.
        self.batches = 0
        self.steps = 0

    async def idle(self, state: RequestState) -> None:
        """Wait until ``state`` has no step queued or computing here."""
        while (pending := self._pending.get(state.request_id)) is not None:
            await pending.wait()

    async def submit(self, step: DecodeStep) -> None:
        """Queue a step; returns at once unless the same request has a step in the queue (a replay burst)."""
        await self.idle(step.state)
        self._pending[step.state.request_id] = trio.Event()
        self._queue.append(step)
        self._wake.set()

    async def _gather(self) -> None:
        """Yield to the other tasks until QUIET_ROUNDS scheduler passes bring no new step (bounded): a frame already
        read needs a few passes (link reader, decoder, node) to reach the queue."""
        with trio.move_on_after(GATHER_LIMIT_S):
            quiet = 0
            while quiet < QUIET_ROUNDS:
                queued = len(self._queue)
                await trio.lowlevel.checkpoint()
                quiet = quiet + 1 if len(self._queue) == queued else 0

    async def run(self) -> None:
        """Run batches until cancelled."""
        while True:
            while not self._queue:
                self._wake = trio.Event()
                await self._wake.wait()
            # Let every frame that has already arrived reach the queue first (a predecessor's batch comes as a burst
            # of frames): one step that waits alone still runs at once, as the event loop has nothing else to do.
            # Bounded: a busy task elsewhere must not hold the batch back.
            await self._gather()
            batch = take_batch(self._queue, self.limit)
            self.batches += 1
            self.steps += len(batch)
            try:
                await self._compute(batch)
            finally:
                for step in batch:
                    done = self._pending.pop(step.state.request_id, None)
                    if done is not None:
                        done.set()
