"""Request flow through real nodes on FakeStages linked by memory streams, under trio's MockClock: the races and
timeouts of the request path in milliseconds, with waits on state instead of sleeps.

The fake never replaces the real path: tests/test_ring.py and tests/test_review_node.py run llama.cpp stages over TCP.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from kvasir.control.server import serve_control
from kvasir.core.errors import InvalidRequest, RequestRefused
from kvasir.ring.links import StreamLink, handshake
from kvasir.ring.manifest import Manifest
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.ring.status import NodeStatus
from kvasir.testing.fakestage import EOG, FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.util.backoff import Backoff, jittered
from kvasir.wire import (
    Boundary,
    Cancel,
    Error,
    ErrorCode,
    Frame,
    Hello,
    Keepalive,
    SamplingParams,
    Side,
    StartRequest,
)
from tests.streams import wait_for

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 9, 17, 33]
WINDOWS = [(0, 2), (2, 4), (4, 6)]


@asynccontextmanager
async def ring(
    windows: list[tuple[int, int]] = WINDOWS, node_config: dict[str, Any] | None = None, **stage: Any
) -> AsyncIterator[tuple[list[Node], MemoryNetwork]]:
    net = MemoryNetwork()
    manifest, stages = fake_ring(windows, net, **stage)
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                open_node(
                    NodeConfig(manifest, r, node_id=f"node{r}", **(node_config or {})),
                    stages[r],
                    transport=net,
                    rng=random.Random(r),
                )
            )
            for r in range(len(windows))
        ]
        await wait_for(lambda: all(n.ready for n in nodes), "the ring to link")
        yield nodes, net


async def generate(
    node: Node, prompt: list[int], max_tokens: int, stop: tuple[str, ...] = ()
) -> tuple[list[int], EndEvent]:
    tokens: list[int] = []
    async with node.request(prompt, GREEDY, max_tokens, stop) as handle, aclosing(node.events(handle)) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent) and ev.token >= 0:
                tokens.append(ev.token)
            elif isinstance(ev, EndEvent):
                return tokens, ev
    raise AssertionError("no end event")


def free(nodes: list[Node]) -> list[int]:
    return [n.status().requests.free_sequences for n in nodes]


# ---------------------------------------------------------------------------------------------- request flow


async def test_a_request_goes_round_the_ring_from_every_entry(autojump_clock: trio.testing.MockClock) -> None:
    async with ring() as (nodes, _):
        for entry in nodes:
            tokens, end = await generate(entry, PROMPT, 6)
            assert tokens == expected_tokens(PROMPT, 6)
            assert end.reason == "max_tokens" and end.generated_tokens == 6 and end.prompt_tokens == len(PROMPT)
            assert end.text == "".join(f"<{t}>" for t in tokens)
        await wait_for(lambda: free(nodes) == [2, 2, 2], "every node to free the sequences")
        # Every node saw every token pass (what a market credits it for).
        assert [n.status().requests.tokens for n in nodes] == [18, 18, 18]


async def test_concurrent_requests_and_a_stop_string(autojump_clock: trio.testing.MockClock) -> None:
    async with ring(compute_s=0.01) as (nodes, _):
        results: list[tuple[list[int], EndEvent]] = []

        async def one(prompt: list[int]) -> None:
            results.append(await generate(nodes[1], prompt, 5))

        async with trio.open_nursery() as nursery:
            for k in range(4):  # 4 requests, 2 sequences per node: admission queues the rest
                nursery.start_soon(one, [1 + k, 2, 3])
        assert sorted(r[0] for r in results) == sorted(expected_tokens([1 + k, 2, 3], 5) for k in range(4))
        want = expected_tokens(PROMPT, 6)
        tokens, end = await generate(nodes[0], PROMPT, 6, stop=(f"<{want[2]}>",))
        assert end.reason == "stop" and tokens[:2] == want[:2]
        assert f"<{want[2]}>" not in end.text
        await wait_for(lambda: free(nodes) == [2, 2, 2], "every node to free the sequences")


async def test_eog_ends_the_request(autojump_clock: trio.testing.MockClock) -> None:
    async with ring(eog_at=len(PROMPT) + 3) as (nodes, _):
        tokens, end = await generate(nodes[2], PROMPT, 20)
        assert end.reason == "eog" and EOG not in tokens and len(tokens) == 3


async def test_cancel_frees_every_node_while_the_stage_is_busy(autojump_clock: trio.testing.MockClock) -> None:
    """A client leaves while a stage is held by another compute: every node still gets its sequence back."""
    async with ring(compute_s=0.05) as (nodes, _):
        busy = object()
        last = nodes[-1].stage
        assert isinstance(last, FakeStage)
        async with nodes[0].request(PROMPT, GREEDY, 50) as handle:
            async with aclosing(nodes[0].events(handle)) as events:
                async for ev in events:
                    if isinstance(ev, TokenEvent):
                        break  # the request is well under way
            await last.limiter.acquire_on_behalf_of(busy)
            with trio.move_on_after(0.01):  # the caller gives up on the cancel before the stage is free
                await nodes[0].cancel(handle.request_id)
            last.limiter.release_on_behalf_of(busy)
        await wait_for(lambda: free(nodes) == [2, 2, 2], "every node to free the cancelled request")
        assert [n.status().requests.in_flight for n in nodes] == [0, 0, 0]
        tokens, _ = await generate(nodes[0], PROMPT, 3)
        assert tokens == expected_tokens(PROMPT, 3)


# ---------------------------------------------------------------------------------------------- refusals


async def test_context_full_and_bad_tokens_are_typed_at_the_entry(autojump_clock: trio.testing.MockClock) -> None:
    async with ring(n_ctx=16) as (nodes, _):
        with pytest.raises(InvalidRequest) as info:
            await generate(nodes[0], PROMPT, 12)
        assert info.value.code == ErrorCode.CONTEXT_FULL
        with pytest.raises(InvalidRequest) as info:
            await generate(nodes[0], [1, 2, 999], 2)
        assert info.value.code == ErrorCode.BAD_REQUEST
        assert free(nodes) == [2, 2, 2]


@asynccontextmanager
async def node_between_peers(
    net: MemoryNetwork, manifest: Manifest, stage: FakeStage, **config: Any
) -> AsyncIterator[tuple[Node, StreamLink, StreamLink]]:
    """Rank 1 of a 2-rank ring as a real node, with the test playing rank 0 on both sides: ``(node, up, down)``."""
    peer = Hello(
        node_id="peer",
        model_id=manifest.model_sha256,
        rank=0,
        ring_size=2,
        window_start=0,
        window_end=2,
        n_layers=4,
        n_embd=8,
    )
    accepted: trio.MemorySendChannel[StreamLink]
    accepted, incoming = trio.open_memory_channel[StreamLink](1)

    async def as_successor(stream: trio.abc.Stream, peer_name: str) -> None:
        link = StreamLink(stream, peer_name)
        await handshake(link, peer, Side.PREDECESSOR, send_first=False)
        await accepted.send(link)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await nursery.start(net.listen, "mem", manifest.rank(0).port, as_successor)
        async with open_node(NodeConfig(manifest, 1, node_id="node1", **config), stage, transport=net) as node:
            down = await incoming.receive()
            up = StreamLink(await net.connect("mem", node.port), "test")
            await handshake(up, peer, Side.SUCCESSOR, send_first=True)
            yield node, up, down
        nursery.cancel_scope.cancel()


async def receive_error(link: StreamLink) -> Error:
    while True:
        frame: Frame = await link.receive()
        if isinstance(frame, Error):
            return frame


async def test_overloaded_and_context_full_travel_as_codes(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    manifest, stages = fake_ring([(0, 2), (2, 4)], net, n_seq_max=1, n_ctx=32)
    async with node_between_peers(net, manifest, stages[1], keepalive_interval=1000.0) as (node, up, down):
        await up.send(StartRequest(0x11, (1, 2, 3), 8, 0, "peer", GREEDY))
        await wait_for(lambda: node.status().requests.in_flight == 1, "the first request to register")
        await up.send(StartRequest(0x12, (1, 2, 3), 8, 0, "peer", GREEDY))  # no sequence left
        err = await receive_error(down)
        assert (err.request_id, err.code) == (0x12, ErrorCode.OVERLOADED)
        await up.send(StartRequest(0x13, (1,) * 30, 8, 0, "peer", GREEDY))  # 30 + 8 > 32
        err = await receive_error(down)
        assert (err.request_id, err.code) == (0x13, ErrorCode.CONTEXT_FULL)
        await up.send(Cancel(0x11, 0))
        await wait_for(lambda: node.status().requests.free_sequences == 1, "the cancel to free the sequence")


def test_refusals_carry_their_code() -> None:
    exc = RequestRefused(ErrorCode.OVERLOADED, "busy")
    assert exc.code is ErrorCode.OVERLOADED and str(exc) == "busy"
    assert isinstance(InvalidRequest(ErrorCode.CONTEXT_FULL, "x"), ValueError)  # an InputError: the client's


# ---------------------------------------------------------------------------------------------- reaper, liveness


async def test_the_reaper_frees_a_request_its_entry_abandoned(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    manifest, stages = fake_ring([(0, 2), (2, 4)], net)
    config = {"link_wait": 3.0, "stall_timeout": 5.0, "keepalive_interval": 1.0}
    async with (
        node_between_peers(net, manifest, stages[1], **config) as (node, up, down),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_send_keepalives, up)  # a live predecessor that then says nothing about the request
        nursery.start_soon(_echo_keepalives, down)
        await up.send(StartRequest(0x77, (1, 2, 3), 8, 0, "peer", GREEDY))
        await wait_for(lambda: node.status().requests.in_flight == 1, "the request to register")
        t0 = trio.current_time()
        await wait_for(lambda: node.status().requests.free_sequences == 2, "the reaper")
        assert 8.0 <= trio.current_time() - t0 <= 8.0 * 1.25 + 0.1  # stall_timeout + link_wait, checked every 1/4
        assert node.status().requests.in_flight == 0
        assert node.status().predecessor.up  # the link itself stayed
        nursery.cancel_scope.cancel()


async def _echo_keepalives(link: StreamLink) -> None:
    """A hand-made successor that keeps its link alive: it echoes keepalives as a node does."""
    try:
        while True:
            if isinstance(await link.receive(), Keepalive):
                await link.send(Keepalive())
    except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
        return


async def _send_keepalives(link: StreamLink, interval: float = 1.0) -> None:
    """A hand-made predecessor that keeps its link alive: a keepalive every interval (and it reads the echoes)."""

    async def drain() -> None:
        while True:
            await link.receive()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            while True:
                await link.send(Keepalive())
                await trio.sleep(interval)
    except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
        return


async def test_a_silent_predecessor_is_dropped_and_its_slot_freed(autojump_clock: trio.testing.MockClock) -> None:
    """A predecessor that vanishes without closing (no FIN: a phone off the network) is noticed within the idle
    timeout, and its replacement, another node, then takes the slot instead of being refused forever."""
    net = MemoryNetwork()
    manifest, stages = fake_ring([(0, 2), (2, 4)], net)
    async with (
        node_between_peers(net, manifest, stages[1], keepalive_interval=1.0) as (node, _up, down),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_echo_keepalives, down)
        assert node.status().predecessor.up
        # A second predecessor while the first is alive is refused.
        other = Hello(
            node_id="other",
            model_id=manifest.model_sha256,
            rank=0,
            ring_size=2,
            window_start=0,
            window_end=2,
            n_layers=4,
            n_embd=8,
        )
        rival = StreamLink(await net.connect("mem", node.port), "rival")
        await handshake(rival, other, Side.SUCCESSOR, send_first=True)
        assert (await receive_error(rival)).code == ErrorCode.PROTOCOL
        # `up` now goes silent (never reads, never sends): dropped after 3 keepalive intervals.
        t0 = trio.current_time()
        await wait_for(lambda: not node.status().predecessor.up, "the silent predecessor to be dropped")
        assert 3.0 <= trio.current_time() - t0 <= 3.5
        assert node.status().predecessor.state == "waiting"
        replacement = StreamLink(await net.connect("mem", node.port), "replacement")
        await handshake(replacement, other, Side.SUCCESSOR, send_first=True)
        await wait_for(lambda: node.status().predecessor.up, "the replacement to link")
        nursery.cancel_scope.cancel()


async def test_a_silent_successor_is_dropped_and_redialed(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    manifest, stages = fake_ring([(0, 2), (2, 4)], net)
    async with (
        node_between_peers(net, manifest, stages[1], keepalive_interval=1.0) as (node, up, _down),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_send_keepalives, up)
        assert node.status().successor.up
        # `down` never answers: the node drops its successor link and dials again (our listener accepts).
        await wait_for(lambda: not node.status().successor.up, "the silent successor to be dropped")
        nursery.cancel_scope.cancel()


async def test_a_busy_node_keeps_its_predecessor_link(autojump_clock: trio.testing.MockClock) -> None:
    """Computes far longer than the idle timeout: the node does not read while it computes (backpressure), but its
    own keepalives keep its predecessor from dropping it."""
    async with ring(compute_s=10.0, node_config={"keepalive_interval": 1.0}) as (nodes, _):
        links = [(n.links.predecessor, n.links.successor) for n in nodes]
        tokens, end = await generate(nodes[0], PROMPT, 2)
        assert tokens == expected_tokens(PROMPT, 2) and end.reason == "max_tokens"
        assert [(n.links.predecessor, n.links.successor) for n in nodes] == links  # no link was dropped


async def test_a_bad_first_frame_is_answered_with_an_error(autojump_clock: trio.testing.MockClock) -> None:
    async with ring(windows=[(0, 2), (2, 4)]) as (nodes, net):
        stream = await net.connect("mem", nodes[1].port)
        link = StreamLink(stream, "test")
        await link.send(Keepalive())  # not a HELLO
        assert (await receive_error(link)).code == ErrorCode.PROTOCOL
        assert nodes[1].ready  # the linked predecessor was not disturbed


# ---------------------------------------------------------------------------------------------- status, lifecycle


async def test_status_round_trips_through_the_control_socket_and_the_tui(
    autojump_clock: trio.testing.MockClock, tmp_path: Any
) -> None:
    from kvasir.tui.model import NodeModel

    async with ring() as (nodes, _), trio.open_nursery() as nursery:
        await generate(nodes[0], PROMPT, 3)
        status = nodes[0].status()
        assert NodeStatus.from_wire(status.to_wire()) == status
        sock = tmp_path / "c.sock"
        await nursery.start(serve_control, nodes[0], sock)
        s = await trio.open_unix_socket(str(sock))
        await s.send_all(b'{"op": "status"}\n')
        data = b""
        while not data.endswith(b"\n"):
            data += await s.receive_some(65536)
        await s.aclose()
        import json

        msg = json.loads(data)
        model = NodeModel()
        model.apply(msg)
        assert model.node is not None and model.bad_status == 0
        assert model.node.requests.tokens == 3 and model.node.window == (0, 2) and model.node.ready
        assert model.links["successor"].connected and model.links["successor"].kind == "direct"
        assert [s.holder for s in model.coverage()] == ["rank 0", "rank 1", "rank 2"]
        nursery.cancel_scope.cancel()


async def test_leaving_open_node_fails_requests_in_flight(autojump_clock: trio.testing.MockClock) -> None:
    net = MemoryNetwork()
    manifest, stages = fake_ring([(0, 2), (2, 4)], net)
    async with node_between_peers(net, manifest, stages[1], keepalive_interval=1000.0) as (node, up, down):
        await up.send(StartRequest(0x21, (1, 2, 3), 8, 0, "peer", GREEDY))
        await wait_for(lambda: node.status().requests.in_flight == 1, "the request to register")
        await node.shutdown()
        err = await receive_error(down)
        assert (err.request_id, err.code) == (0x21, ErrorCode.SHUTTING_DOWN)
        assert node.status().requests.free_sequences == 2


async def test_boundaries_from_the_predecessor_reach_the_last_rank(autojump_clock: trio.testing.MockClock) -> None:
    """A hand-made rank 0 drives the fake last rank: the sampled token comes back as a TOKEN frame."""
    import numpy as np

    from kvasir.testing.fakestage import N_EMBD, next_token
    from kvasir.wire import Token

    net = MemoryNetwork()
    manifest, stages = fake_ring([(0, 2), (2, 4)], net)
    async with node_between_peers(net, manifest, stages[1], keepalive_interval=1000.0) as (_, up, down):
        await up.send(StartRequest(0x31, (4, 5, 6), 8, 0, "peer", GREEDY))
        rows = np.zeros((3, N_EMBD), np.float32)
        rows[:, 0], rows[:, 1] = (4, 5, 6), (0, 1, 2)
        await up.send(Boundary.from_array(0x31, 0, rows, final=True))
        while True:
            frame = await down.receive()
            if isinstance(frame, Token):
                break
        assert (frame.request_id, frame.position, frame.token_id) == (0x31, 3, next_token(6, 2))


# ---------------------------------------------------------------------------------------------- backoff


def test_backoff_doubles_within_jitter_bounds() -> None:
    rng = random.Random(7)
    b = Backoff(initial=0.05, maximum=2.0, jitter=0.5, rng=rng)
    bases = [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    delays = [b.next() for _ in bases]
    for base, d in zip(bases, delays, strict=True):
        assert base * 0.5 <= d <= base
    assert len(set(delays)) == len(delays)  # jittered: no two alike
    b.reset()
    assert b.next() <= 0.05
    assert 0.5 <= b.next(at_least=1.0) <= 1.0  # a refusal raises the base
    assert jittered(1.0, 0.0, rng) == 1.0
    with pytest.raises(ValueError):
        Backoff(initial=3.0, maximum=2.0)


def test_backoff_spreads_peers_that_failed_together() -> None:
    """Two peers that lost the relay at the same moment do not redial in lockstep."""
    a, b = Backoff(rng=random.Random(1)), Backoff(rng=random.Random(2))
    assert [a.next() for _ in range(5)] != [b.next() for _ in range(5)]


async def test_a_moved_successor_is_redialed_at_its_new_address(autojump_clock: trio.testing.MockClock) -> None:
    """The market moves rank 1 to another holder: rank 0 drops the old link and links to the new address, and the
    newcomer takes rank 0's predecessor slot once the old holder is gone."""
    net = MemoryNetwork()
    manifest, stages = fake_ring([(0, 2), (2, 4)], net)
    moved = attrs.evolve(manifest, ranks=(manifest.ranks[0], attrs.evolve(manifest.ranks[1], port=net.port())))
    replacement = FakeStage(2, 4, 4, model_sha256=manifest.model_sha256)

    def successor_id(node: Node) -> str | None:
        hello = node.links.successor_hello if node.links.successor is not None else None
        return None if hello is None else hello.node_id

    leave = trio.Event()

    async def old_holder(task_status: trio.TaskStatus[Node]) -> None:
        async with open_node(NodeConfig(manifest, 1, node_id="old1"), stages[1], transport=net) as old:
            task_status.started(old)
            await leave.wait()

    async with (
        open_node(NodeConfig(manifest, 0, node_id="node0"), stages[0], transport=net) as node0,
        trio.open_nursery() as nursery,
    ):
        old: Node = await nursery.start(old_holder)
        await wait_for(lambda: node0.ready and old.ready, "the first ring")
        async with open_node(NodeConfig(moved, 1, node_id="new1"), replacement, transport=net) as new:
            node0.update_manifest(moved)  # the old holder's link still works: rank 0 must drop it itself
            await wait_for(lambda: successor_id(node0) == "new1", "rank 0 to link to the new holder")
            assert successor_id(old) == "node0"  # the old holder still has rank 0's predecessor slot...
            leave.set()  # ...until it leaves
            await wait_for(lambda: node0.ready and new.ready, "the newcomer to take rank 0's predecessor slot")
            tokens, _ = await generate(node0, PROMPT, 3)
            assert tokens == expected_tokens(PROMPT, 3)


async def test_tcp_links_set_keepalive() -> None:
    import socket

    from kvasir.ring.linkmgr import TcpTransport

    transport = TcpTransport()
    accepted: list[trio.SocketStream] = []
    got = trio.Event()

    async def handler(stream: trio.abc.Stream, peer: str) -> None:
        assert isinstance(stream, trio.SocketStream)
        accepted.append(stream)
        got.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        port = await nursery.start(transport.listen, "127.0.0.1", 0, handler)
        dialed = await transport.connect("127.0.0.1", port)
        await got.wait()
        for s in (dialed, accepted[0]):
            assert isinstance(s, trio.SocketStream)
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        await dialed.aclose()
        nursery.cancel_scope.cancel()


def test_the_recorded_tui_session_follows_the_status_schema() -> None:
    """The TUI's replay fixture is a recorded stream of ``status`` messages: it must stay readable by the schema
    the node writes with, and a malformed status is skipped (counted), never half-applied."""
    import json
    from pathlib import Path

    from kvasir.tui.model import NodeModel

    lines = (Path(__file__).parent / "data" / "tui_session.jsonl").read_text().splitlines()
    statuses = [m["msg"]["status"] for m in map(json.loads, lines) if m["msg"].get("type") == "status"]
    assert statuses
    for raw in statuses:
        parsed = NodeStatus.from_wire(raw)
        again = NodeStatus.from_wire(parsed.to_wire())
        assert again == parsed
    model = NodeModel()
    model.apply({"type": "status", "status": statuses[0]})
    model.apply({"type": "status", "status": {**statuses[0], "window": "all of them"}})
    assert model.bad_status == 1 and model.node == NodeStatus.from_wire(statuses[0])
