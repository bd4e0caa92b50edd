"""Speculative decoding across the ring, fast: real nodes on FakeStages (a repetitive fake model, so prompt-lookup
drafts are mostly right and sometimes wrong) over memory streams, under trio's MockClock.

The ring must run ``generate --speculate K``'s schedule: the same tokens, the same rows computed and the same
truncations at every window as :class:`~kvasir.stage.pipeline.LocalPipeline` on the same FakeStages, from any entry
node, with the windows working on successive rows of a verify batch at once; and a node that dies mid-answer and
comes back empty must not change the answer. The real model: test_ring_speculate.py.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from kvasir.core.speculate import Drafter, RowSampler
from kvasir.ring.node import Node
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.ring.speculation import CacheEnd, RowFate, TokenTrail, VerifyBatch, row_fate
from kvasir.stage.pipeline import LocalPipeline
from kvasir.testing.fakestage import FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.wire import SamplingParams
from tests.streams import wait_for
from tests.test_failover_flow import Ring

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
WINDOWS = [(0, 2), (2, 4), (4, 6), (6, 8)]
PERIOD = 5


def reference(k: int | None, max_tokens: int, **kw: Any) -> tuple[list[int], list[tuple[int, int, int, int]]]:
    """``generate --speculate k`` on the same fake model: its tokens, and each stage's (verify batches, rows computed
    in them, forward calls in all, truncations)."""
    stages = [FakeStage(a, b, WINDOWS[-1][1], period=PERIOD, **kw) for a, b in WINDOWS]
    result = LocalPipeline(stages).generate(PROMPT, GREEDY, max_tokens, speculate=k)  # type: ignore[arg-type]
    return result.tokens, [(s.verifies, s.verify_rows, s.forwards, s.truncations) for s in stages]


def overlapping(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> int:
    """How many of ``a``'s compute spans overlap one of ``b``'s."""
    return sum(any(s0 < t1 and t0 < s1 for t0, t1 in b) for s0, s1 in a)


@asynccontextmanager
async def ring_of(
    speculate: int = 0, *, last_compute_s: float = 0.01, draft_policy: str = "auto", **kw: Any
) -> AsyncIterator[tuple[Ring, list[FakeStage]]]:
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net, compute_s=0.01, period=PERIOD, **kw)
    stages[-1].compute_s = last_compute_s
    async with trio.open_nursery() as nursery:
        ring = Ring(nursery, manifest, net, speculate=speculate, draft_policy=draft_policy)
        for rank, stage in enumerate(stages):
            await ring.start(rank, stage)
        await wait_for(lambda: all(n.ready for n in ring.live()), "the ring to link")
        yield ring, stages
        nursery.cancel_scope.cancel()


async def answer(
    node: Node,
    max_tokens: int,
    *,
    at_token: int = 0,
    fault: Any = None,
    reason: str = "max_tokens",
    prompt: Sequence[int] = PROMPT,
    **kw: Any,
) -> list[int]:
    """Stream a greedy request at ``node``, checking token indices and the end; ``fault()`` after ``at_token``."""
    tokens: list[int] = []
    async with node.request(prompt, GREEDY, max_tokens, **kw) as handle, aclosing(node.events(handle)) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent) and ev.token >= 0:
                assert ev.index == len(tokens)
                tokens.append(ev.token)
                if fault is not None and len(tokens) == at_token:
                    await fault()
            elif isinstance(ev, EndEvent):
                assert ev.reason == reason and ev.error is None, ev
                assert ev.generated_tokens == len(tokens)
                return tokens
    raise AssertionError("no end event")


@pytest.mark.parametrize("entry", [0, 1, 3])
async def test_the_ring_runs_generates_speculative_schedule(autojump_clock: trio.testing.MockClock, entry: int) -> None:
    want, schedule = reference(4, 40)
    assert want == expected_tokens(PROMPT, 40, PERIOD)
    assert schedule[-1][0] > 5 and schedule[0][3] > 2  # the fake text both accepts and rejects drafts
    # The last stage stops a verify batch at its first rejected draft: fewer rows than the windows before it.
    assert schedule[-1][1] < schedule[0][1]
    async with ring_of(speculate=4) as (ring, stages):
        node = ring.nodes[entry]
        assert node is not None
        # Every entry streams every token in order, accepted drafts included (answer() checks the indices).
        assert await answer(node, 40) == want
        # The ring computes each verify row as a one-row forward as it arrives: the same calls and truncations.
        assert [(s.forwards, s.truncations) for s in stages] == [(f, t) for _, _, f, t in schedule]
        # One request alone, yet neighbouring windows computed at once: rows of a verify batch were pipelined.
        assert all(overlapping(a.spans, b.spans) >= 5 for a, b in itertools.pairwise(stages))
        # Equal windows and no network latency: a compute-bound ring, so auto drafted adaptively, as generate does.
        last = ring.nodes[3]
        assert last is not None and last.status().requests.eager_steps == 0
        await wait_for(lambda: [x.status().requests.free_sequences for x in ring.live()] == [2] * 4, "all freed")


async def test_speculate_zero_and_a_per_request_k(autojump_clock: trio.testing.MockClock) -> None:
    """K=0 is the plain ring (no verify batch anywhere); a request may ask its own K whatever the node's default."""
    plain, _ = reference(None, 30)
    async with ring_of(speculate=0) as (ring, stages):
        node = ring.nodes[2]
        assert node is not None
        assert await answer(node, 30) == plain
        assert all(s.truncations == 0 for s in stages)
        assert not any(overlapping(a.spans, b.spans) for a, b in itertools.pairwise(stages))  # one request: no overlap
        want, schedule = reference(2, 30)
        assert want == plain
        forwards = [s.forwards for s in stages]
        assert await answer(node, 30, speculate=2) == want
        assert [s.forwards - f for s, f in zip(stages, forwards, strict=True)] == [f for _, _, f, _ in schedule]
        assert [s.truncations for s in stages] == [t for *_, t in schedule]


async def test_two_speculative_requests_at_once(autojump_clock: trio.testing.MockClock) -> None:
    """Each request's verify batches and rollbacks touch only its own sequence: two at once (different K, different
    entries) each give their own schedule's answer."""
    want4, _ = reference(4, 40)
    want2, _ = reference(2, 30)
    got: dict[int, list[int]] = {}
    async with ring_of(speculate=4) as (ring, _stages):
        n1, n3 = ring.nodes[1], ring.nodes[3]
        assert n1 is not None and n3 is not None

        async def one(key: int, node: Node, max_tokens: int, k: int) -> None:
            got[key] = await answer(node, max_tokens, speculate=k)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 4, n1, 40, 4)
            nursery.start_soon(one, 2, n3, 30, 2)
    assert got == {4: want4, 2: want2}


@pytest.mark.parametrize("entry", [0, 1])
async def test_an_end_inside_a_verify_batch_streams_its_accepted_drafts(
    autojump_clock: trio.testing.MockClock, entry: int
) -> None:
    """EOG sampled after accepted drafts: the END carries only the count, and an entry node that is not the last
    rank streams the accepted drafts of that last batch from the batch it saw (TokenTrail), in order."""
    # eog_at=47: EOG is sampled at a row after accepted drafts in its verify batch (checked: without the END's
    # confirmation of the trail, entries 0 and 1 miss those drafts).
    want, schedule = reference(6, 60, eog_at=47)
    assert len(want) < 47 and schedule[-1][0] > 3
    async with ring_of(speculate=6, eog_at=47) as (ring, _stages):
        node = ring.nodes[entry]
        assert node is not None
        assert await answer(node, 60, reason="eog") == want


@pytest.mark.parametrize("victim", [1, 3, 0])
async def test_a_dead_node_replaced_mid_speculation_gives_the_same_answer(
    autojump_clock: trio.testing.MockClock, victim: int
) -> None:
    """A middle rank, the last rank (it re-drafts and re-samples from the replayed verify batches: rank 0 checks
    each TOKEN, drafts included, against the one it had) and rank 0 die mid-answer; an empty node takes the window
    and the replay rebuilds its cache with the same verify batches and truncations."""
    want, _ = reference(4, 40)
    entry = 2
    async with ring_of(speculate=4) as (ring, _stages):

        async def crash() -> None:
            ring.kill(victim)
            await trio.sleep(1.0)
            a, b = WINDOWS[victim]
            await ring.start(victim, FakeStage(a, b, 8, model_sha256="f" * 64, compute_s=0.01, period=PERIOD))

        node = ring.nodes[entry]
        assert node is not None
        assert await answer(node, 40, at_token=12, fault=crash) == want
        predecessor = ring.nodes[(victim - 1) % len(WINDOWS)]
        assert predecessor is not None and predecessor.failover.replays >= 1


@pytest.mark.parametrize("policy", ["auto", "adaptive", "eager"])
async def test_a_latency_bound_ring_drafts_eagerly(autojump_clock: trio.testing.MockClock, policy: str) -> None:
    """The last rank's window computes a row in 0.5 ms while a step takes 30 ms to come back round (the windows
    before it: to the last rank, latency it cannot tell from a network's): auto drafts eagerly after its first
    passes, as the eager policy does from the start; adaptive never does. The answer is the same either way."""
    async with ring_of(speculate=4, last_compute_s=0.0005, draft_policy=policy) as (ring, _stages):
        node, last = ring.nodes[1], ring.nodes[3]
        assert node is not None and last is not None
        assert await answer(node, 40) == expected_tokens(PROMPT, 40, PERIOD)
        counters = last.status().requests
    if policy == "adaptive":
        assert counters.eager_steps == 0
    else:
        assert counters.eager_steps > 5
        stages = [FakeStage(a, b, WINDOWS[-1][1], period=PERIOD) for a, b in WINDOWS]
        adaptive = LocalPipeline(stages).generate(PROMPT, GREEDY, 40, speculate=4)  # type: ignore[arg-type]
        assert adaptive.speculation is not None and counters.drafted > adaptive.speculation.drafted


def test_the_fate_of_a_verify_row_at_the_last_rank() -> None:
    """Row 0 opens a batch; the next row in order is computed; rows behind a rejected draft are stale; a gap, or a
    row of a batch this node never opened, is a misbehaving predecessor."""
    samples = iter([7, 5])
    batch = VerifyBatch(10, RowSampler(lambda: next(samples), [7, 8, 9]))
    assert row_fate(None, 10, 0) is RowFate.START and row_fate(None, 10, 1) is RowFate.UNEXPECTED
    assert row_fate(batch, 10, 1) is RowFate.UNEXPECTED  # row 0 not sampled yet: row 1 is a gap
    assert batch.sample(0) is None  # 7 == the first draft: the batch goes on
    assert row_fate(batch, 10, 1) is RowFate.NEXT and row_fate(batch, 10, 2) is RowFate.UNEXPECTED
    assert row_fate(batch, 11, 1) is RowFate.UNEXPECTED  # another batch's row
    assert batch.sample(1) == [7, 5]  # 5 != 8: rejected, the batch closes with its tokens
    assert row_fate(batch, 10, 2) is RowFate.STALE and row_fate(batch, 10, 3) is RowFate.STALE
    assert row_fate(batch, 12, 0) is RowFate.START


def test_row_sampler_accepts_while_equal_to_the_drafts() -> None:
    """Called after each verify row (as ``forward_verify`` on the last stage does): it samples that row and says
    stop at the first sampled token that differs from its draft, or after the row past the last draft."""
    samples = iter([7, 8, 5, 9])

    def run(drafts: list[int]) -> tuple[list[int], int]:
        rows = RowSampler(lambda: next(samples), drafts)
        computed = 0
        for i in range(len(drafts) + 1):
            computed += 1
            if rows(i):
                break
        return rows.tokens, computed

    assert run([8, 6, 1]) == ([7], 1)  # row 0 gives 7, not the first draft's 8: rows 1..3 never computed
    samples = iter([7, 8, 5, 9])
    assert run([7, 8, 9]) == ([7, 8, 5], 3)
    samples = iter([7, 8, 5])
    assert run([7, 8]) == ([7, 8, 5], 3)  # every draft accepted: one more from the last row


def test_drafter_cache_end_and_trail() -> None:
    d = Drafter.for_prompt([1, 2, 3, 1, 2], 4)
    assert d.k == 1 and d.drafts(may_emit=10) == [3]  # (1, 2) was followed by 3, 1, 2; a request starts at k=1
    d.verified(1, 1, 3)
    assert d.k == 3 and d.drafts(may_emit=10) == [3, 1, 2]
    assert d.drafts(may_emit=2) == [3]  # one draft and the sample after it
    d.verified(3, 1, 3)
    assert d.k == 2 and d.stats.accepted == 2
    d.verified(2, 0, 9)
    d.verified(1, 0, 9)
    assert d.k == 0 and d.drafts(may_emit=10) == [] and d.shadow == [3]  # off, guessing in the shadow
    d.verified(0, 0, 7)
    assert d.k == 0  # the guess (3) was wrong: still off
    d.drafts(may_emit=10)
    d.verified(0, 0, 3)
    assert d.k == 1  # it would have been right: back on
    cache = CacheEnd()
    cache.computed(10, 4)
    assert cache.rollback(12) and not cache.rollback(14)
    trail = TokenTrail()
    assert trail.step(10, [5, 6, 7]) == [(10, 5)]
    assert trail.step(12, [9]) == [(10, 5), (11, 6), (12, 9)]  # one draft (6) accepted, 7 rejected
    assert trail.confirmed(14) == [(12, 9)]
