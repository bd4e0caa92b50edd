"""Speculative generation on a chain of stages drafting with the model's MTP block (kvasir.stage.mtp).

The schedule is ``LocalPipeline``'s prompt-lookup one (docs/speculation.md): each step feeds the current token and up
to K drafts as one verify batch, computed row by row (each row the plain one-token step) and sampled row by row with
the request's sampler until a draft is rejected, so the answer is plain ``generate``'s, bit for bit. What differs is
where drafts come from: the last stage's nextn hidden state of every row it computes goes to the MTP drafter with the
tokens, and the MTP block drafts K tokens after the latest one. Only the last stage (the ring's last rank) is
involved; the windows before it see verify batches as they do with prompt lookup.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import attrs

from kvasir.core.errors import InputError
from kvasir.core.sampling import SamplingParams
from kvasir.core.speculate import K_LIMIT, RowSampler, SpeculationStats
from kvasir.shard.arch import rules_for
from kvasir.stage.engine import Stage
from kvasir.stage.mtp import MtpDrafter, MtpHead
from kvasir.stage.pipeline import GenerationResult, LocalPipeline, _Output


@attrs.frozen
class MtpCost:
    """What an MTP generation's drafting cost at the last stage: seconds in MTP decodes (the prompt's pairs, then
    per step the true pairs and the chain's links) and the tokens drafted."""

    draft_s: float
    drafted: int
    #: Seconds drafting the prompt's pairs into the MTP cache (part of ``draft_s``: the prefill's share).
    prompt_s: float
    #: ``draft_s`` and ``prompt_s`` in CPU time of the calling thread (steadier than wall clock on a loaded machine).
    draft_cpu_s: float = 0.0
    prompt_cpu_s: float = 0.0


def generate_mtp(
    pipe: LocalPipeline,
    head: MtpHead,
    prompt: Sequence[int],
    params: SamplingParams,
    max_tokens: int,
    k: int,
    *,
    seq_id: int = 0,
    stop: Sequence[str] = (),
    on_token: Callable[[int, str], None] | None = None,
) -> tuple[GenerationResult, MtpCost]:
    """``pipe.generate(prompt, …)`` with up to ``k`` MTP drafts verified per step; the same tokens and text."""
    if not 1 <= k <= K_LIMIT:
        raise InputError(f"MTP drafts per step {k} outside [1, {K_LIMIT}]")
    if not prompt:
        raise InputError("empty prompt")
    last = pipe.last
    if head.stage is not last:
        raise InputError("the MTP head must run on the pipeline's last stage")
    for stage in pipe.stages[:-1]:
        if rules_for(stage.info.arch).needs_both_kinds and stage.config.rollback < k + 1:
            raise InputError(
                f"window {stage.info.start}:{stage.info.end} keeps {stage.config.rollback} recurrent "
                f"snapshots; {k} drafts need {k + 1} (StageConfig.rollback)"
            )
    n_ctx = min(s.config.n_ctx for s in pipe.stages)
    if len(prompt) + max_tokens > n_ctx:
        raise InputError(f"prompt ({len(prompt)}) + max tokens ({max_tokens}) exceed the context of {n_ctx}")
    last.vocab.check_tokens(prompt)
    sampler = last.new_sampler(params)
    drafter = MtpDrafter(head, seq_id)
    output = _Output(last, stop, max_tokens, on_token)
    stats = SpeculationStats()
    draft_s0, cpu_s0 = head.busy_s, head.cpu_s
    prompt_s = prompt_cpu_s = 0.0
    try:
        for t in prompt:
            sampler.accept(t)
        drafter.accept(prompt)
        t0 = time.perf_counter()
        for i in range(0, len(prompt), pipe.chunk):
            chunk = prompt[i : i + pipe.chunk]
            pipe.step(seq_id, i, chunk)
            drafter.observe(i, last.nextn_hidden(len(chunk)))
        new = [last.sample(sampler)]
        t1 = time.perf_counter()
        pos = len(prompt)  # where new[-1] is fed
        steps = 0
        while not any(output.take(token) for token in new):
            drafter.accept(new)
            busy, cpu = head.busy_s, head.cpu_s
            drafts = drafter.propose(min(k, max_tokens - len(output.tokens) - 1))
            if steps == 0:  # the first proposal writes the whole prompt's pairs
                prompt_s, prompt_cpu_s = head.busy_s - busy, head.cpu_s - cpu
            fed = [new[-1], *drafts]
            rows_sampler = RowSampler(functools.partial(last.sample, sampler), drafts)
            until = _observing(drafter, last, pos, rows_sampler)
            if drafts:
                pipe.verify(seq_id, pos, fed, until)
            else:
                pipe.step(seq_id, pos, fed)
                until(0)
            new = rows_sampler.tokens
            accepted = len(new) - 1
            if accepted < len(drafts):
                for stage in pipe.stages[:-1]:
                    stage.truncate(seq_id, pos + 1 + accepted)
            pos += 1 + accepted
            steps += len(new)
            stats = stats.after(len(drafts), accepted)
        t2 = time.perf_counter()
        text = output.finish()
    finally:
        sampler.close()
        drafter.close()
        pipe.free(seq_id)
    result = GenerationResult(
        tokens=output.tokens,
        text=text,
        prompt_tokens=len(prompt),
        stop_reason=output.reason.value,
        prefill_ms=(t1 - t0) * 1e3,
        decode_ms_per_token=(t2 - t1) * 1e3 / steps if steps else 0.0,
        speculation=stats,
    )
    cost = MtpCost(
        draft_s=head.busy_s - draft_s0,
        drafted=stats.drafted,
        prompt_s=prompt_s,
        draft_cpu_s=head.cpu_s - cpu_s0,
        prompt_cpu_s=prompt_cpu_s,
    )
    return result, cost


def _observing(drafter: MtpDrafter, last: Stage, pos: int, rows: RowSampler) -> Callable[[int], bool]:
    """The last stage's ``until`` for a step at ``pos``: hand the drafter each computed row's nextn hidden state, then
    sample the row."""

    def until(row: int) -> bool:
        drafter.observe(pos + row, last.nextn_hidden(1))
        return rows(row)

    return until
