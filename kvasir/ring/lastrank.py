"""The last rank's work: it samples.

On a final boundary the last rank runs its window and samples in one worker-thread round trip (a verify row: samples
it, and the batch's tokens once that row closes the batch), then emits the step's tokens in ``generate``'s order,
decides whether the request ends (:func:`kvasir.core.stops.ending`, the one decision ``generate`` makes too) and
sends the next step to rank 0 as a TOKEN, with drafts when the request speculates (docs/speculation.md). The drafting
policy reads the ring's pace (:class:`~kvasir.ring.speculation.RingPace`).

A request's sampler chain is built in the worker thread of its first sample, not on the event loop: building it
feeds the whole prompt into the penalty history.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import trio

from kvasir.core.errors import InvalidRequest
from kvasir.core.speculate import Drafter, DraftPolicy, RowSampler
from kvasir.core.stops import ending
from kvasir.ring.compute import RingStage, TokenSampler
from kvasir.ring.config import NodeConfig
from kvasir.ring.observe import RequestObserver
from kvasir.ring.outbox import Outbox
from kvasir.ring.requests import RequestState, RequestTable, check_params
from kvasir.ring.speculation import RingPace, RowFate, VerifyBatch, row_fate, window_step
from kvasir.stage.vocab import TextStream
from kvasir.wire import Boundary, EndReason, ErrorCode, StartRequest, Token


class LastRank:
    def __init__(
        self, config: NodeConfig, stage: RingStage, requests: RequestTable, outbox: Outbox, observer: RequestObserver
    ) -> None:
        self.stage, self.requests, self.outbox, self.observer = stage, requests, outbox, observer
        self.draft_policy: DraftPolicy = config.draft_policy
        self.draft_sources = config.draft_sources
        self.pace = RingPace()  # the ring's pace, for the drafting policy

    # ------------------------------------------------------------------------------------------ requests

    def admit(self, start: StartRequest) -> None:
        """InvalidRequest if the last rank cannot serve ``start`` as asked."""
        if start.speculate and not start.prompt:  # drafts from anything less would not be generate's
            check_params(start, self.requests.rank)  # a START altered on the way says so first (PARAMS_MISMATCH)
            raise InvalidRequest(ErrorCode.BAD_REQUEST, "the last rank got a speculative START without its prompt")

    def adopt(self, state: RequestState) -> None:
        """A request registered here: its output text and, when it speculates, its drafter."""
        state.text_stream = TextStream(self.stage.vocab)
        if state.start.speculate:
            prompt, sources = state.start.prompt, self.draft_sources
            source = None if sources is None else sources(prompt, state.seq)
            fixed = self.draft_policy == "fixed"
            state.drafter = Drafter.for_prompt(prompt, state.start.speculate, source, fixed=fixed)

    def sampler(self, state: RequestState) -> TokenSampler:
        """Worker thread (the request's lock held): the request's sampler chain, built at its first sample with the
        prompt in its penalty history."""
        if state.sampler is None:
            sampler = self.stage.new_sampler(state.start.sampling)
            try:
                for t in state.start.prompt:
                    sampler.accept(t)
            except BaseException:
                sampler.close()
                raise
            state.sampler = sampler
        return state.sampler

    def _came_back(self, state: RequestState) -> None:
        """The step this rank sent is back round (its first row arrived): the ring's latency, for the pace."""
        if state.step_sent_at is not None:
            self.pace.waits.append(trio.current_time() - state.step_sent_at)
            state.step_sent_at = None

    # ------------------------------------------------------------------------------------------ a boundary

    async def boundary(self, state: RequestState, frame: Boundary, *, came_back: bool) -> None:
        """A boundary for the last window: computed, and sampled when final. ``came_back``: it starts a decode step
        (the one this rank sent, back round)."""
        if came_back:
            self._came_back(state)
        batch = self._verify_batch(state, frame) if frame.drafts else None
        if frame.drafts and batch is None:  # a stale row: behind a rejected draft, nothing to compute
            self.observer.on_skip(frame.request_id, frame.position, frame.n_tokens)
            return
        tokens = await self._compute_and_sample(state, frame, batch)
        if tokens is not None:
            await self.after_sample(state, tokens, len(frame.drafts), step=frame.first_position >= state.prompt_len)

    def _verify_batch(self, state: RequestState, frame: Boundary) -> VerifyBatch | None:
        """A verify row arriving: the batch it extends (a new one at row 0); None when the row is stale (after a
        rejected draft: dropped uncomputed). InvalidRequest when it is out of order."""
        fate = row_fate(state.verifying, frame.first_position, frame.row)
        if fate is RowFate.START:
            state.verifying = VerifyBatch(frame.first_position, RowSampler(lambda: self._sample(state), frame.drafts))
        elif fate is RowFate.UNEXPECTED:
            raise InvalidRequest(
                ErrorCode.BAD_REQUEST,
                f"verify row {frame.row} at position {frame.first_position} is not the next row of a batch here",
            )
        return None if fate is RowFate.STALE else state.verifying

    def _sample(self, state: RequestState) -> int:
        """Worker thread: the request's next token from the last row computed."""
        return self.stage.sample(self.sampler(state))

    async def _compute_and_sample(
        self, state: RequestState, frame: Boundary, batch: VerifyBatch | None
    ) -> list[int] | None:
        """Run the window and, on a final boundary, sample (a verify row: sample it, and the batch's tokens once that
        row closes it): one worker-thread round trip for both. None: no tokens yet, or the request ended meanwhile."""
        inputs = {"hidden": frame.to_array()}
        recorded = self.observer.records(frame.request_id)

        def forward_and_sample() -> list[int] | None:
            window_step(self.stage, state.seq, state.cache, state.start.speculate > 0, frame.position, inputs)
            if state.drafter is not None:  # an MTP source reads the rows' hidden states before the next computation
                state.drafter.computed(frame.position, frame.n_tokens)
            if not frame.final:
                tokens = None
            elif batch is not None:
                tokens = batch.sample(frame.row)
            else:
                tokens = [self._sample(state)]
            if recorded:  # hashes the logits row (1 MiB on a 262k vocabulary) here, off the event loop
                logits = self.stage.logits().tobytes()
                if batch is not None:  # a verify row: its own token (the batch's tokens come once it closes)
                    token: int | None = batch.rows.tokens[frame.row]
                else:
                    token = tokens[0] if tokens else None
                self.observer.on_sample(frame.request_id, frame.position, frame.n_tokens, logits, token)
            return tokens

        async with state.lock:
            if state.done:
                return None
            t0 = trio.current_time()
            tokens = await self.stage.run(forward_and_sample)
            if state.drafter is not None and frame.first_position >= state.prompt_len:
                self.pace.rows.append(trio.current_time() - t0)
            return tokens

    # ------------------------------------------------------------------------------------------ after a sample

    async def after_sample(self, state: RequestState, tokens: Sequence[int], drafted: int, *, step: bool) -> None:
        """Emit a step's sampled tokens (one, or a verify batch's accepted drafts and one more) in ``generate``'s
        order; then END the request, or send the next step to rank 0, with drafts when the request speculates."""
        if state.done:
            return  # cancelled or failed while its sample was computed: the tokens belong to nobody now
        start = state.start
        assert state.text_stream is not None
        if state.drafter is not None and step:  # a decode step (the prefill's sample is no step: as in generate)
            now = trio.current_time()
            if drafted and state.drafter.eager and state.sampled_at is not None:
                state.payoff.trip(len(tokens), now - state.sampled_at)
            state.sampled_at = now
            state.drafter.verified(drafted, len(tokens) - 1, tokens[0])
            self.requests.speculation = self.requests.speculation.after(
                drafted, len(tokens) - 1, eager=state.drafter.eager
            )
        first = state.generated

        def see() -> None:  # streamed and published once the step is on its way (as a boundary passing a node)
            for index in range(first, state.generated):
                self.requests.see(state, index, tokens[index - first])

        for token in tokens:
            eog = self.stage.vocab.is_eog(token)
            if not eog:
                state.generated += 1
                state.text += state.text_stream.push(token)
                if state.drafter is not None:
                    state.drafter.emitted(token)
            end = ending(
                eog=eog, text=state.text, stops=start.stop, generated=state.generated, max_tokens=start.max_tokens
            )
            if end is not None:
                see()
                await self.outbox.end(state, EndReason[end.name], latest=-1 if eog else token)
                return
        drafts: list[int] = []
        if state.drafter is not None:
            eager = self.pace.eager(self.draft_policy, state.drafter.k_max)
            if self.draft_policy == "auto":  # the acceptance gate: eagerly only while it pays
                eager = eager and state.payoff.pays(self.pace.plain_trip_s())
            draft = functools.partial(state.drafter.drafts, start.max_tokens - state.generated, eager=eager)
            if state.drafter.blocking:  # a draft model computes: off the event loop (MTP: on the stage's worker)
                drafts = await (self.stage.run(draft) if state.drafter.on_stage else trio.to_thread.run_sync(draft))
                if state.done:
                    see()
                    return
            else:
                drafts = draft()
        position = state.prompt_len + state.generated - 1
        try:
            await self.outbox.data(state, Token(start.request_id, position, tokens[-1], tuple(drafts)))
            if state.drafter is not None:
                state.step_sent_at = trio.current_time()
        finally:
            see()
