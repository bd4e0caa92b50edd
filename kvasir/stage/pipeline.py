"""Stages chained in one process: ``kvasir generate`` and the reference the ring is tested against.

Data flow is the ring's: tokens → first stage → boundary → … → last stage → sampled token → first stage.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvasir.core.errors import InputError
from kvasir.core.sampling import SamplingParams
from kvasir.core.schedule import PREFILL_CHUNK
from kvasir.core.speculate import K_LIMIT, Drafter, DraftSources, RowSampler, SpeculationStats
from kvasir.core.stops import Ending, ending, find_stop
from kvasir.stage.engine import FloatArray, Stage
from kvasir.stage.vocab import TextStream


@attrs.frozen
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    stop_reason: str  # "eog" | "max_tokens" | "stop"
    prefill_ms: float
    decode_ms_per_token: float
    #: Set by a speculative generation only.
    speculation: SpeculationStats | None = None

    def to_json(self) -> dict[str, Any]:
        extra = {} if self.speculation is None else {"speculation": self.speculation.to_json()}
        return {
            "tokens": self.tokens,
            "text": self.text,
            "prompt_tokens": self.prompt_tokens,
            "stop_reason": self.stop_reason,
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms_per_token": round(self.decode_ms_per_token, 3),
            **extra,
        }


class _Output:
    """One generation's output as tokens are sampled: emits them (text, ``on_token``, the drafter) and says when the
    generation ends (:func:`kvasir.core.stops.ending`, the decision the ring's last rank makes too)."""

    def __init__(
        self,
        stage: Stage,
        stop: Sequence[str],
        max_tokens: int,
        on_token: Callable[[int, str], None] | None,
        drafter: Drafter | None = None,
    ) -> None:
        self._vocab, self._stream = stage.vocab, TextStream(stage.vocab)
        self._stop, self._max, self._on_token, self._drafter = stop, max_tokens, on_token, drafter
        self.tokens: list[int] = []
        self.text = ""
        self.reason = Ending.MAX_TOKENS

    def take(self, token: int) -> bool:
        """A sampled token; True when the generation ends with it."""
        eog = self._vocab.is_eog(token)
        if not eog:
            self.tokens.append(token)
            if self._drafter is not None:
                self._drafter.emitted(token)
            delta = self._stream.push(token)
            self.text += delta
            if self._on_token is not None:
                self._on_token(token, delta)
        end = ending(eog=eog, text=self.text, stops=self._stop, generated=len(self.tokens), max_tokens=self._max)
        if end is not None:
            self.reason = end
        return end is not None

    def finish(self) -> str:
        """The final text: cut at the stop string, or with the decoder's held-back bytes."""
        if self.reason is Ending.STOP:
            return self.text[: find_stop(self.text, self._stop)]
        return self.text + self._stream.flush()


class LocalPipeline:
    def __init__(self, stages: Sequence[Stage], *, prefill_chunk: int = PREFILL_CHUNK) -> None:
        if not stages or not stages[0].info.first or not stages[-1].info.last:
            raise InputError("a pipeline needs stages from the first layer to the last")
        for a, b in itertools.pairwise(stages):
            if a.info.end != b.info.start:
                raise InputError(f"stage windows do not join: {a.info.end} != {b.info.start}")
        self.stages = list(stages)
        self.chunk = max(1, min(prefill_chunk, *(s.config.n_batch for s in stages)))

    @property
    def last(self) -> Stage:
        return self.stages[-1]

    def step(self, seq_id: int, pos0: int, tokens: Sequence[int]) -> None:
        """Run one chunk through every stage; the last stage then holds its logits."""
        hidden: FloatArray | None = self.stages[0].forward(seq_id, pos0, tokens=tokens)
        for stage in self.stages[1:]:
            assert hidden is not None
            hidden = stage.forward(seq_id, pos0, hidden=hidden)

    def verify(self, seq_id: int, pos0: int, tokens: Sequence[int], until: Callable[[int], bool] | None = None) -> None:
        """Run a verify batch (the current token + drafts) through every stage, one row at a time in each (each row
        the plain one-token step); the last stage calls ``until(i)`` after row ``i`` and stops when it is True."""
        hidden: FloatArray | None = self.stages[0].forward_verify(seq_id, pos0, tokens=tokens, until=until)
        for stage in self.stages[1:]:
            assert hidden is not None
            hidden = stage.forward_verify(seq_id, pos0, hidden=hidden, until=until)

    def prefill(self, seq_id: int, tokens: Sequence[int], pos0: int = 0) -> None:
        for i in range(0, len(tokens), self.chunk):
            self.step(seq_id, pos0 + i, tokens[i : i + self.chunk])

    def free(self, seq_id: int) -> None:
        for stage in self.stages:
            stage.free_sequence(seq_id)

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        *,
        seq_id: int = 0,
        stop: Sequence[str] = (),
        on_token: Callable[[int, str], None] | None = None,
        speculate: int | None = None,
        draft_sources: DraftSources | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_tokens`` after ``prompt``. ``speculate=K`` drafts up to K tokens per step (from
        ``draft_sources``, prompt lookup when None) and verifies them in one batch (:meth:`_generate_speculative`);
        None is the plain one-token loop."""
        if speculate is not None:
            return self._generate_speculative(
                prompt, params, max_tokens, speculate, seq_id, stop, on_token, draft_sources
            )
        if not prompt:
            raise InputError("empty prompt")
        n_ctx = min(s.config.n_ctx for s in self.stages)
        if len(prompt) + max_tokens > n_ctx:
            raise InputError(f"prompt ({len(prompt)}) + max tokens ({max_tokens}) exceed the context of {n_ctx}")
        self.last.vocab.check_tokens(prompt)
        sampler = self.last.new_sampler(params)
        output = _Output(self.last, stop, max_tokens, on_token)
        try:
            for t in prompt:
                sampler.accept(t)
            t0 = time.perf_counter()
            self.prefill(seq_id, prompt)
            token = self.last.sample(sampler)
            t1 = time.perf_counter()
            pos = len(prompt)
            steps = 0
            while not output.take(token):
                self.step(seq_id, pos, [token])
                pos += 1
                steps += 1
                token = self.last.sample(sampler)
            t2 = time.perf_counter()
            text = output.finish()
        finally:
            sampler.close()
            self.free(seq_id)
        return GenerationResult(
            tokens=output.tokens,
            text=text,
            prompt_tokens=len(prompt),
            stop_reason=output.reason.value,
            prefill_ms=(t1 - t0) * 1e3,
            decode_ms_per_token=(t2 - t1) * 1e3 / steps if steps else 0.0,
        )

    def _generate_speculative(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        k_max: int,
        seq_id: int,
        stop: Sequence[str],
        on_token: Callable[[int, str], None] | None,
        draft_sources: DraftSources | None = None,
    ) -> GenerationResult:
        """Speculative decoding (drafts by prompt lookup, or from ``draft_sources``). Each step feeds the current
        token plus up to ``k`` drafts in one verify batch, samples row by row with the request's sampler while the
        sampled token equals the next draft, keeps the sampled tokens (the accepted drafts and one more) and rolls
        every cache back past the rejected drafts.

        The sampler sees exactly the calls of the plain loop (one per emitted token, same order, same penalty
        history, same seeded draws), and every verify row is computed as the plain one-token step, so the output is
        the plain loop's, bit for bit. A step without drafts is a plain one-token step.
        """
        if not 0 <= k_max <= K_LIMIT:
            raise InputError(f"speculate {k_max} outside [0, {K_LIMIT}]")
        if not prompt:
            raise InputError("empty prompt")
        n_ctx = min(s.config.n_ctx for s in self.stages)
        if len(prompt) + max_tokens > n_ctx:
            raise InputError(f"prompt ({len(prompt)}) + max tokens ({max_tokens}) exceed the context of {n_ctx}")
        self.last.vocab.check_tokens(prompt)
        sampler = self.last.new_sampler(params)
        # The ring's last rank drafts with the same object.
        drafter = Drafter.for_prompt(prompt, k_max, None if draft_sources is None else draft_sources(prompt, seq_id))
        output = _Output(self.last, stop, max_tokens, on_token, drafter)
        try:
            for t in prompt:
                sampler.accept(t)
            t0 = time.perf_counter()
            self.prefill(seq_id, prompt)
            new = [self.last.sample(sampler)]
            t1 = time.perf_counter()
            pos = len(prompt)  # where new[-1] is fed
            steps = 0
            while not any(output.take(token) for token in new):  # any() stops at the token that ends it
                drafts = drafter.drafts(max_tokens - len(output.tokens))
                fed = [new[-1], *drafts]
                if drafts:
                    rows = RowSampler(functools.partial(self.last.sample, sampler), drafts)
                    self.verify(seq_id, pos, fed, rows)
                    new = rows.tokens
                else:
                    self.step(seq_id, pos, fed)
                    new = [self.last.sample(sampler)]
                accepted = len(new) - 1
                if accepted < len(drafts):
                    # The last stage stopped at the rejected draft: only the windows before it computed past it.
                    for stage in self.stages[:-1]:
                        stage.truncate(seq_id, pos + 1 + accepted)
                pos += 1 + accepted
                steps += len(new)
                drafter.verified(len(drafts), accepted, new[0])
            t2 = time.perf_counter()
            text = output.finish()
        finally:
            sampler.close()
            drafter.close()
            self.free(seq_id)
        return GenerationResult(
            tokens=output.tokens,
            text=text,
            prompt_tokens=len(prompt),
            stop_reason=output.reason.value,
            prefill_ms=(t1 - t0) * 1e3,
            decode_ms_per_token=(t2 - t1) * 1e3 / steps if steps else 0.0,
            speculation=drafter.stats,
        )
