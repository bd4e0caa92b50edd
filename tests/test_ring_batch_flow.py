"""Batched decode across requests (``--batch N``), fast: real nodes on FakeStages over memory streams, under trio's
MockClock. The fake model is exact whatever the batch, so every answer must be the expected one; what is checked
here is the scheduling: concurrent requests' decode steps really share ``forward_batch`` calls, a lone request is not
held back, prefill and speculative steps stay unbatched, and failover replay still rebuilds a window exactly.
The real model: test_ring_batch.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from typing import Any

import attrs
import numpy as np
import pytest
import trio
import trio.testing

from kvasir.ring.batching import DecodeStep, batchable, take_batch
from kvasir.ring.requests import EndEvent, RequestState, TokenEvent
from kvasir.testing.fakestage import FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.wire import Boundary, SamplingParams, StartRequest, Token
from tests.streams import wait_for
from tests.test_failover_flow import Ring
from tests.test_ring_speculate_flow import answer

GREEDY = SamplingParams(temperature=0.0)
WINDOWS = [(0, 2), (2, 4), (4, 6)]
SEQS = 8
PROMPTS = [[1 + i, 5, 9 + i, 17, 33 - i, 2, 4 + i] for i in range(SEQS)]


def fresh(rank: int) -> FakeStage:
    a, b = WINDOWS[rank]
    return FakeStage(a, b, WINDOWS[-1][1], model_sha256="f" * 64, compute_s=0.01, n_seq_max=SEQS)


@asynccontextmanager
async def three_nodes(batch: int, **config: Any) -> AsyncIterator[tuple[Ring, list[FakeStage]]]:
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net, compute_s=0.01, n_seq_max=SEQS)
    async with trio.open_nursery() as nursery:
        ring = Ring(nursery, manifest, net, batch=batch, **config)
        for rank, stage in enumerate(stages):
            await ring.start(rank, stage)
        await wait_for(lambda: all(n.ready for n in ring.live()), "the ring to link")
        yield ring, stages
        nursery.cancel_scope.cancel()


async def concurrent(
    ring: Ring, n: int, max_tokens: int, fault: Any = None, entry: int | None = None
) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        node = ring.nodes[i % len(WINDOWS) if entry is None else entry]  # default: entries at every rank
        assert node is not None
        got[i] = await answer(node, max_tokens, prompt=PROMPTS[i], fault=fault if i == 0 else None, at_token=10)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return got


async def test_concurrent_requests_share_decodes_and_keep_their_answers(autojump_clock: trio.testing.MockClock) -> None:
    async with three_nodes(batch=8) as (ring, stages):
        got = await concurrent(ring, SEQS, 30)
        assert got == {i: expected_tokens(PROMPTS[i], 30) for i in range(SEQS)}
        for stage in stages:
            assert max(stage.batch_sizes) >= 4, stage.batch_sizes  # steps really shared a decode
            assert max(stage.batch_sizes) <= 8
        # Every decode step went through forward_batch once (prefill: one plain forward per request and rank).
        decode_steps = SEQS * 30 - SEQS  # the first token of each answer is sampled from the prefill
        assert [sum(s.batch_sizes) for s in stages] == [decode_steps] * 3
        assert all(len(s.batch_sizes) < decode_steps / 2 for s in stages), [s.batch_sizes for s in stages]
        await wait_for(lambda: [x.status().requests.free_sequences for x in ring.live()] == [SEQS] * 3, "freed")


async def test_the_limit_caps_a_batch(autojump_clock: trio.testing.MockClock) -> None:
    async with three_nodes(batch=3) as (ring, stages):
        got = await concurrent(ring, 6, 20)
        assert got == {i: expected_tokens(PROMPTS[i], 20) for i in range(6)}
        assert all(max(s.batch_sizes) == 3 for s in stages), [s.batch_sizes for s in stages]


async def test_a_lone_request_is_not_held_back(autojump_clock: trio.testing.MockClock) -> None:
    """One request: every step runs at once, alone, and takes the same time as without batching."""
    times = []
    for batch in (1, 8):
        async with three_nodes(batch=batch) as (ring, stages):
            node = ring.nodes[0]
            assert node is not None
            t0 = trio.current_time()
            assert await answer(node, 20, prompt=PROMPTS[0]) == expected_tokens(PROMPTS[0], 20)
            times.append(trio.current_time() - t0)
            assert all(s.batch_sizes == ([1] * 19 if batch > 1 else []) for s in stages)
    assert times[0] == pytest.approx(times[1])


async def test_batch_one_is_the_plain_ring(autojump_clock: trio.testing.MockClock) -> None:
    async with three_nodes(batch=1) as (ring, stages):
        got = await concurrent(ring, 4, 12)
        assert got == {i: expected_tokens(PROMPTS[i], 12) for i in range(4)}
        assert all(s.batch_sizes == [] for s in stages)


async def test_speculative_requests_stay_unbatched(autojump_clock: trio.testing.MockClock) -> None:
    """A speculative request (its steps verify drafts and roll back) beside plain ones: its steps never join a batch,
    the plain ones still batch, every answer is right."""
    async with three_nodes(batch=8) as (ring, stages):
        node = ring.nodes[1]
        assert node is not None
        got: dict[int, list[int]] = {}

        async def one(i: int, speculate: int) -> None:
            got[i] = await answer(node, 16, prompt=PROMPTS[i], speculate=speculate)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0, 3)
            for i in range(1, 4):
                nursery.start_soon(one, i, 0)
        assert got == {i: expected_tokens(PROMPTS[i], 16) for i in range(4)}
        assert sum(stages[0].batch_sizes) == 3 * 15  # the plain requests' steps only
        assert max(stages[0].batch_sizes) >= 2


@pytest.mark.parametrize("victim", [0, 1, 2])
async def test_a_dead_node_replaced_mid_batch_gives_the_same_answers(
    autojump_clock: trio.testing.MockClock, victim: int
) -> None:
    """A node dies while eight requests batch through it; a new empty node takes the window and its predecessor
    replays every request into it (a burst of one request's steps at once: they must stay in order)."""
    async with three_nodes(batch=8) as (ring, _):

        async def crash() -> None:
            ring.kill(victim)
            await trio.sleep(1.0)
            await ring.start(victim, fresh(victim))

        got = await concurrent(ring, SEQS, 24, crash, entry=(victim + 1) % len(WINDOWS))
        assert got == {i: expected_tokens(PROMPTS[i], 24) for i in range(SEQS)}
        predecessor = ring.nodes[(victim - 1) % len(WINDOWS)]
        assert predecessor is not None and predecessor.failover.replays >= 1
        await wait_for(lambda: [x.status().requests.free_sequences for x in ring.live()] == [SEQS] * 3, "freed")


class BatchSensitiveStage(FakeStage):
    """A window whose numbers depend on the batch, as llama.cpp's do: a batch of several sequences moves a padding
    column (the tokens stay right, the bits change)."""

    def forward_batch(self, items: Sequence[Any]) -> list[np.ndarray[Any, np.dtype[np.float32]] | None]:
        out = super().forward_batch(items)
        if len(items) > 1:
            for rows in out:
                if rows is not None:
                    rows[:, -1] += 0.25
        return out


async def test_a_rebuilt_window_behind_batches_fails_loudly_not_silently(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Batching's failover guarantee: rank 1 computed in batches (batch-dependent bits) and dies; its replacement
    recomputes the replayed steps one by one, so rank 2 sees replayed boundaries differ from what it got: those
    requests end with REPLAY_MISMATCH, never with a silently different answer."""
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net, compute_s=0.01, n_seq_max=SEQS)
    stages[1] = BatchSensitiveStage(*WINDOWS[1], WINDOWS[-1][1], model_sha256="f" * 64, compute_s=0.01, n_seq_max=SEQS)
    ends: dict[int, tuple[list[int], EndEvent]] = {}
    async with trio.open_nursery() as nursery:
        ring = Ring(nursery, manifest, net, batch=8)
        for rank, stage in enumerate(stages):
            await ring.start(rank, stage)
        await wait_for(lambda: all(n.ready for n in ring.live()), "the ring to link")
        node = ring.nodes[0]
        assert node is not None
        crashed = trio.Event()

        async def one(i: int) -> None:
            tokens: list[int] = []
            async with node.request(PROMPTS[i], GREEDY, 24) as handle, aclosing(node.events(handle)) as events:
                async for ev in events:
                    if isinstance(ev, TokenEvent) and ev.token >= 0:
                        tokens.append(ev.token)
                        if i == 0 and len(tokens) == 10 and not crashed.is_set():
                            crashed.set()
                            ring.kill(1)
                            await trio.sleep(1.0)
                            await ring.start(1, fresh(1))
                    elif isinstance(ev, EndEvent):
                        ends[i] = (tokens, ev)

        async with trio.open_nursery() as clients:
            for i in range(SEQS):
                clients.start_soon(one, i)
        nursery.cancel_scope.cancel()
    assert max(stages[1].batch_sizes) > 1
    mismatched = 0
    for i, (tokens, end) in ends.items():
        assert tokens == expected_tokens(PROMPTS[i], 24)[: len(tokens)]  # never a wrong token
        if end.reason == "error":
            assert end.code == "replay_mismatch", end
            mismatched += 1
        else:
            assert end.reason == "max_tokens" and len(tokens) == 24
    assert mismatched > 0


async def test_which_frames_batch() -> None:
    start = StartRequest(request_id=3, prompt=(1, 2, 3), max_tokens=9, entry_rank=0, entry_node_id="n", sampling=GREEDY)
    plain = RequestState(start=start, seq=0)
    spec = RequestState(start=attrs.evolve(start, speculate=2), seq=1)
    row = Boundary.from_array(3, 3, _rows(1), final=True, latest_token=5)
    assert batchable(plain, row, recorded=False)
    assert batchable(plain, Token(3, 3, 5), recorded=False)
    assert not batchable(plain, row, recorded=True)  # receipts promise exact bits
    assert not batchable(plain, Token(3, 3, 5, (6, 7)), recorded=False)  # a verify batch
    assert not batchable(plain, Boundary.from_array(3, 2, _rows(1), final=True), recorded=False)  # prefill
    assert not batchable(plain, Boundary.from_array(3, 3, _rows(2), final=True), recorded=False)  # two rows
    assert not batchable(spec, row, recorded=False)  # its steps may roll back
    queue = deque(DecodeStep(RequestState(start=start, seq=s), Token(3, 3, 5)) for s in (5, 2, 7, 0))
    assert [step.state.seq for step in take_batch(queue, 3)] == [2, 5, 7]  # the oldest three, in id order
    assert [step.state.seq for step in take_batch(queue, 3)] == [0]


def _rows(n: int) -> Any:
    return np.ones((n, 8), np.float32)
