"""A node's window at work on its requests' frames.

Rank 0 prefills a prompt in chunks and embeds each TOKEN that comes back (a verify batch row by row, each row sent on
as soon as it is computed); a middle rank runs each boundary through its window and passes it on; the last rank hands
its boundaries to :class:`~kvasir.ring.lastrank.LastRank`, which samples. With ``--batch N`` plain decode steps of
several requests go through :class:`~kvasir.ring.batching.DecodeBatcher` and one ``llama_decode``.

Compute runs in the stage's worker thread (``Stage.run``) with the request's lock held, so its sequence is never
freed mid-compute; what goes out goes through the node's :class:`~kvasir.ring.outbox.Outbox`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import trio

from kvasir.ring.batching import DecodeBatcher, DecodeStep, batchable, compute_batch
from kvasir.ring.compute import RingStage
from kvasir.ring.config import NodeConfig
from kvasir.ring.lastrank import LastRank
from kvasir.ring.observe import RequestObserver
from kvasir.ring.outbox import Outbox
from kvasir.ring.requests import RequestState
from kvasir.ring.speculation import window_step
from kvasir.wire import Boundary, ErrorCode, Token

log = logging.getLogger("kvasir.node")


class WindowRunner:
    def __init__(
        self,
        config: NodeConfig,
        stage: RingStage,
        outbox: Outbox,
        observer: RequestObserver,
        lastrank: LastRank | None,
    ) -> None:
        self.stage, self.outbox, self.observer, self.lastrank = stage, outbox, observer, lastrank
        self.rank = config.rank
        self.chunk = max(1, min(config.prefill_chunk, stage.config.n_batch))
        #: Batched decode (``--batch N``), a task of the node; None: every step computes alone.
        self.batcher = DecodeBatcher(config.batch, self._decode_batch) if config.batch > 1 else None

    async def prefill(self, state: RequestState) -> None:
        """Rank 0: the prompt in chunks, each chunk's boundary sent on as soon as it is computed."""
        prompt = list(state.start.prompt)
        try:
            async with self.outbox.fails(state.request_id):
                for i in range(0, len(prompt), self.chunk):
                    self.observer.on_tokens(state.request_id, i, prompt[i : i + self.chunk])
                    hidden = await self._compute(state, i, tokens=prompt[i : i + self.chunk])
                    if hidden is None:
                        return
                    final = i + self.chunk >= len(prompt)
                    state.touched = trio.current_time()
                    await self.outbox.data(state, self.outbox.boundary(state.request_id, i, hidden, final=final))
        finally:
            state.prefilled.set()

    async def boundary(self, state: RequestState, frame: Boundary, *, came_back: bool) -> None:
        """A boundary from the predecessor (new: not a replayed one seen before). ``came_back``: it starts a
        decode step (the last rank's pace)."""
        if (broken := self.observer.take(frame)) is not None:
            log.error("request %x: rank %d: %s", state.request_id, self.rank, broken)
            await self.outbox.error(state, ErrorCode.CHAIN_MISMATCH, f"rank {self.rank}: {broken}")
            return
        if await self._batched(state, frame):
            return
        if self.lastrank is not None:
            await self.lastrank.boundary(state, frame, came_back=came_back)
            return
        hidden = await self._compute(state, frame.position, hidden=frame.to_array())
        if hidden is not None:
            boundary = self.outbox.boundary(
                frame.request_id, frame.first_position, hidden, final=frame.final, latest_token=frame.latest_token,
                drafts=frame.drafts, row=frame.row,
            )  # fmt: skip
            await self.outbox.data(state, boundary)

    async def token(self, state: RequestState, frame: Token) -> None:
        """Rank 0: a TOKEN from the last rank (new: not a replayed one seen before), with drafts a verify batch."""
        fed = (frame.token_id, *frame.drafts)
        for row, token in enumerate(fed):  # each row of a verify batch is a step of its own
            self.observer.on_tokens(state.request_id, frame.position + row, [token])
        if await self._batched(state, frame):
            return
        # A verify batch goes on row by row, each row as soon as it is computed: the next window starts on it
        # while this one computes the next (docs/speculation.md).
        for row, token in enumerate(fed):
            hidden = await self._compute(state, frame.position + row, tokens=[token])
            if hidden is None:
                return
            boundary = self.outbox.boundary(
                frame.request_id, frame.position, hidden, final=True, latest_token=frame.token_id,
                drafts=frame.drafts, row=row,
            )  # fmt: skip
            await self.outbox.data(state, boundary)

    async def _compute(self, state: RequestState, pos: int, **inputs: Any) -> Any:
        """Run the stage on one chunk of a request (rolling back rejected drafts first); None if the request ended
        meanwhile."""
        async with state.lock:
            if state.done:
                return None
            speculative = state.start.speculate > 0
            return await self.stage.run(window_step, self.stage, state.seq, state.cache, speculative, pos, inputs)

    async def _batched(self, state: RequestState, frame: Token | Boundary) -> bool:
        """Batching on and a plain decode step: queue it for the batcher (returns at once, so the next frame is read
        while it waits) and say so. Other frames of a request wait for its queued step: its frames stay in order."""
        if self.batcher is None:
            return False
        if not batchable(state, frame, recorded=self.observer.records(state.request_id)):
            await self.batcher.idle(state)
            return False
        await self.batcher.submit(DecodeStep(state, frame))
        return True

    async def _decode_batch(self, steps: list[DecodeStep]) -> None:
        """The batcher's compute: the steps in one worker-thread call (each request's lock held, as ``_compute``
        holds it), then each request's next frame exactly as an unbatched step sends it."""
        outs: list[Any] = []
        error: Exception | None = None
        async with contextlib.AsyncExitStack() as locks:
            for step in steps:
                await locks.enter_async_context(step.state.lock)
            live = [step for step in steps if not step.state.done]
            try:
                outs = await self.stage.run(compute_batch, self.stage, live) if live else []
            except Exception as exc:  # each step's request fails with it (Outbox.fails), never the batcher's task
                error = exc
        for i, step in enumerate(live):
            state, frame = step.state, step.frame
            async with self.outbox.fails(state.request_id):
                if error is not None:
                    raise error
                if self.lastrank is not None:
                    await self.lastrank.after_sample(state, [outs[i]], 0, step=True)
                else:
                    latest = frame.token_id if isinstance(frame, Token) else frame.latest_token
                    hidden = outs[i]
                    boundary = self.outbox.boundary(state.request_id, step.pos, hidden, final=True, latest_token=latest)
                    await self.outbox.data(state, boundary)
