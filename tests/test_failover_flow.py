"""Failover under trio's MockClock: real nodes on FakeStages over memory streams, where a link breaks or a node dies
mid-answer and its window comes back (the same node, or a new one with an empty stage). The answer must not change.

The real path (llama.cpp stages, TCP, killed processes) is tests/test_failover.py; this covers the orderings fast.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from kvasir.core.errors import RequestRefused
from kvasir.core.identity import Identity
from kvasir.ring.manifest import Manifest
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.record import NodeRecorder
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.testing.fakestage import N_EMBD, FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.wire import SamplingParams
from tests.streams import wait_for

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 9, 17, 33, 2, 4, 6, 8]
WINDOWS = [(0, 2), (2, 4), (4, 6), (6, 8)]


class Ring:
    """Four nodes, each in its own cancel scope so one can die without a goodbye (as SIGKILL does)."""

    def __init__(
        self, nursery: trio.Nursery, manifest: Manifest, net: MemoryNetwork, record: Path | None = None, **config: Any
    ) -> None:
        self.nursery, self.manifest, self.net, self.config = nursery, manifest, net, config
        #: With a directory, every node (a replacement too) records its receipts there (``--record``).
        self.record = record
        self.nodes: list[Node | None] = [None] * manifest.size
        self.scopes: list[trio.CancelScope | None] = [None] * manifest.size

    async def start(self, rank: int, stage: FakeStage) -> Node:
        async def run(task_status: trio.TaskStatus[Node]) -> None:
            with trio.CancelScope() as scope:
                self.scopes[rank] = scope
                config = NodeConfig(self.manifest, rank, node_id=f"node{rank}", **self.config)
                rec = None
                if self.record is not None:
                    window = (stage.info.start, stage.info.end)
                    rec = NodeRecorder(self.record, Identity.generate(), self.manifest.model_sha256, window, "FAKE-0")
                rng = random.Random(rank)
                async with open_node(config, stage, transport=self.net, rng=rng, recorder=rec) as node:
                    task_status.started(node)
                    await trio.sleep_forever()

        node: Node = await self.nursery.start(run)
        self.nodes[rank] = node
        return node

    def kill(self, rank: int) -> None:
        """Gone at once: no error replies, no goodbye (its shutdown would send SHUTTING_DOWN)."""
        node, scope = self.nodes[rank], self.scopes[rank]
        assert node is not None and scope is not None

        async def silent() -> None:
            pass

        node.shutdown = silent  # type: ignore[method-assign]
        scope.cancel()
        self.nodes[rank] = None

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n is not None]


@asynccontextmanager
async def four_nodes(record: Path | None = None, **config: Any) -> AsyncIterator[tuple[Ring, list[FakeStage]]]:
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net, compute_s=0.01)
    async with trio.open_nursery() as nursery:
        ring = Ring(nursery, manifest, net, record, **config)
        for rank, stage in enumerate(stages):
            await ring.start(rank, stage)
        await wait_for(lambda: all(n.ready for n in ring.live()), "the ring to link")
        yield ring, stages
        nursery.cancel_scope.cancel()


async def answer(node: Node, max_tokens: int, at_token: int, fault: Any) -> tuple[list[int], EndEvent]:
    """Stream a request at ``node``; call ``fault()`` once the ``at_token``-th token arrived."""
    tokens: list[int] = []
    async with node.request(PROMPT, GREEDY, max_tokens) as handle, aclosing(node.events(handle)) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent) and ev.token >= 0:
                tokens.append(ev.token)
                if len(tokens) == at_token:
                    await fault()
            elif isinstance(ev, EndEvent):
                return tokens, ev
    raise AssertionError("no end event")


def fresh(windows: Sequence[tuple[int, int]], rank: int, **kw: Any) -> FakeStage:
    a, b = windows[rank]
    return FakeStage(a, b, windows[-1][1], model_sha256="f" * 64, compute_s=0.01, **kw)


async def test_a_broken_link_replays_and_the_answer_is_unchanged(autojump_clock: trio.testing.MockClock) -> None:
    """The link between ranks 1 and 2 breaks mid-answer (frames in transit lost): rank 1 replays its requests into
    rank 2, which recognises what it has seen (identical, dropped) and computes what it missed."""
    async with four_nodes() as (ring, _):
        n = ring.live()

        async def cut() -> None:
            link = n[1].links.successor
            assert link is not None
            await link.aclose()

        tokens, end = await answer(n[0], 40, 8, cut)
        assert end.reason == "max_tokens" and end.error is None
        assert tokens == expected_tokens(PROMPT, 40)
        assert n[1].failover.replays == 1 and n[1].failover.requests == 1
        assert n[2].failover.duplicates >= 1


@pytest.mark.parametrize("victim", [1, 2, 3, 0])
@pytest.mark.parametrize("recording", [False, True])
async def test_a_dead_node_replaced_by_an_empty_one_gives_the_same_answer(
    autojump_clock: trio.testing.MockClock, victim: int, recording: bool, tmp_path: Path
) -> None:
    """A middle rank, the last rank (its sampler replays the steps: rank 0 checks each token again) and rank 0 (it
    rebuilds from the prompt and the tokens) die at token 8 of 40; a new node with an empty stage takes the window.
    The request entered at another node, and its answer is exactly the fault-free one. Recording (every node and the
    replacement): the replacement's boundaries carry the chain of everything it recomputed, and its successor, which
    dropped the replayed ones, checks the new ones against the chain of what it got from the dead node."""
    entry = 2 if victim != 2 else 1
    async with four_nodes(tmp_path if recording else None) as (ring, _):

        async def crash() -> None:
            ring.kill(victim)
            await trio.sleep(1.0)  # the window is away for a while: its neighbours hold the requests
            await ring.start(victim, fresh(WINDOWS, victim))

        node = ring.nodes[entry]
        assert node is not None
        started = trio.current_time()
        tokens, end = await answer(node, 40, 8, crash)
        assert end.reason == "max_tokens" and end.error is None, end
        assert tokens == expected_tokens(PROMPT, 40)
        assert trio.current_time() - started < 10
        predecessor = ring.nodes[(victim - 1) % len(WINDOWS)]
        assert predecessor is not None and predecessor.failover.replays >= 1
        assert predecessor.failover.last_window == WINDOWS[victim]
        await wait_for(lambda: [x.status().requests.free_sequences for x in ring.live()] == [2] * 4, "all freed")
        # The replay logs are freed with their requests.
        assert all(x.status().failover.log_bytes == 0 for x in ring.live())
        if recording:
            recorders = [x.recorder for x in ring.live()]
            assert all(r is not None and r.mismatches == 0 for r in recorders)
            successor = ring.nodes[(victim + 1) % len(WINDOWS)]
            assert successor is not None and successor.recorder is not None
            # Checked: every boundary taken (rank 0 takes tokens only); a middle rank's successor got 8 before the
            # crash and the rest from the replacement.
            assert successor.recorder.checked == (0 if victim == 3 else 1 + 39)


async def test_the_entry_node_dying_frees_its_requests_everywhere(autojump_clock: trio.testing.MockClock) -> None:
    """A request that entered at the node that died is lost (its client went with it): the restarted node says so
    round the ring and every node frees it; the ring serves the next request."""
    async with four_nodes() as (ring, _):
        n1 = ring.nodes[1]
        assert n1 is not None
        seen = trio.Event()

        async def client() -> None:
            async with n1.request(PROMPT, GREEDY, 60) as handle, aclosing(n1.events(handle)) as events:
                async for ev in events:
                    if isinstance(ev, TokenEvent) and ev.index == 5:
                        seen.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client)
            await seen.wait()
            ring.kill(1)
        await ring.start(1, fresh(WINDOWS, 1))
        await wait_for(lambda: [x.status().requests.in_flight for x in ring.live()] == [0] * 4, "orphans freed", 5)
        node = ring.nodes[1]
        assert node is not None
        tokens, end = await answer(node, 6, 99, lambda: None)
        assert tokens == expected_tokens(PROMPT, 6) and end.reason == "max_tokens"


class NoisyStage(FakeStage):
    """A replacement whose window computes something else (corrupted weights)."""

    def forward(self, seq_id: int, pos0: int, **inputs: Any) -> np.ndarray[Any, np.dtype[np.float32]] | None:
        rows = super().forward(seq_id, pos0, **inputs)
        if rows is not None:
            rows[:, -1] += 0.5
        return rows


async def test_a_replacement_that_computes_differently_is_an_error_not_a_different_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with four_nodes() as (ring, _):

        async def crash() -> None:
            ring.kill(1)
            await trio.sleep(0.5)
            await ring.start(1, NoisyStage(*WINDOWS[1], 8, model_sha256="f" * 64, compute_s=0.01))

        node = ring.nodes[0]
        assert node is not None
        tokens, end = await answer(node, 40, 8, crash)
        assert end.reason == "error" and end.code == "replay_mismatch", end
        assert tokens == expected_tokens(PROMPT, 40)[: len(tokens)]


async def test_a_window_that_stays_away_fails_its_requests_after_the_failover_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with four_nodes(failover_wait=4.0) as (ring, _):
        node = ring.nodes[0]
        assert node is not None

        async def crash() -> None:
            ring.kill(2)

        started = trio.current_time()
        _tokens, end = await answer(node, 40, 8, crash)
        waited = trio.current_time() - started
        assert end.reason == "error" and end.code == "link_lost", end
        assert 4.0 <= waited < 12, waited
        await wait_for(lambda: [x.status().requests.free_sequences for x in ring.live()] == [2] * 3, "freed", 12)


async def test_without_its_successor_a_node_logs_a_step_and_reads_on(autojump_clock: trio.testing.MockClock) -> None:
    """Once a node has seen its successor link break, a request's next data frame goes into the replay log at once
    instead of waiting for the link (up to ``link_wait``): the node keeps reading its predecessor, where the END or
    ERROR for that request may be next (a leaving node's SHUTTING_DOWN was held back 20 s that way)."""
    async with four_nodes(failover_wait=6.0) as (ring, _):
        node = ring.nodes[0]
        assert node is not None

        async def crash() -> None:
            ring.kill(1)
            await wait_for(lambda: node.links.successor_down, "rank 0 to see its successor gone")
            state = next(s for s in node.requests if not s.done)
            logged = len(state.sent)
            step = node.outbox.boundary(state.request_id, 10_000, np.zeros((1, N_EMBD), np.float32), final=True)
            with trio.fail_after(1):  # link_wait is 30 s
                await node._send_data(state, step)
            assert len(state.sent) == logged + 1 and state.sent[-1] is step

        _tokens, end = await answer(node, 40, 8, crash)
        assert end.reason == "error" and end.code == "link_lost"  # rank 1 stayed away


async def test_a_new_request_is_refused_at_once_when_the_ring_gave_up_on_the_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Within the failover wait a new request waits for the window (a restart takes seconds); past it the ring has
    failed the requests in flight already, and a new one is refused at once with the reason, not after link_wait."""
    async with four_nodes(failover_wait=4.0) as (ring, _):
        node = ring.nodes[0]
        assert node is not None
        ring.kill(1)
        await wait_for(lambda: node.links.successor_down, "rank 0 to see its successor gone")
        await trio.sleep(5)
        started = trio.current_time()
        with pytest.raises(RequestRefused, match=r"rank 0 lost its successor link [56] s ago \(.*rank 1"):
            async with node.request(PROMPT, GREEDY, 4):
                pass
        assert trio.current_time() - started < 0.1  # link_wait is 30 s


async def test_a_new_request_waits_for_a_window_that_comes_back_within_the_failover_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with four_nodes(failover_wait=4.0) as (ring, _):
        node = ring.nodes[0]
        assert node is not None
        ring.kill(1)
        await wait_for(lambda: node.links.successor_down, "rank 0 to see its successor gone")
        async with trio.open_nursery() as nursery:

            async def restart() -> None:
                await trio.sleep(2)
                await ring.start(1, fresh(WINDOWS, 1))

            nursery.start_soon(restart)
            tokens, end = await answer(node, 6, 0, None)
        assert tokens == expected_tokens(PROMPT, 6) and end.reason == "max_tokens"


async def test_a_node_shutting_down_refuses_new_requests(autojump_clock: trio.testing.MockClock) -> None:
    async with four_nodes() as (ring, _):
        node = ring.nodes[2]
        assert node is not None
        await node.shutdown()
        with pytest.raises(RequestRefused, match="node rank 2 is shutting down"):
            async with node.request(PROMPT, GREEDY, 4):
                pass
