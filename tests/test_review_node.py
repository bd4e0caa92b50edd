"""Review findings in the request flow: real nodes in-process on loopback, poked at the edges of a request's life."""

from __future__ import annotations

import json
import logging
import operator
import os
import socket
import stat
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from kvasir.control.server import serve_control
from kvasir.core.errors import InputError
from kvasir.local.launcher import free_ports
from kvasir.ring.events import TokenPassed
from kvasir.ring.links import StreamLink, handshake
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.requests import EndEvent
from kvasir.shard.cache import model_sha256, stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.wire import Boundary, Error, ErrorCode, Hello, SamplingParams, Side, StartRequest, Token

WINDOWS = [(0, 3), (3, 6)]
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 9, 17, 33]


async def _load(model: Path, cache_dir: Path, n_seq_max: int) -> tuple[list[Stage], Manifest]:
    paths = stage_files(model, WINDOWS, cache_dir)
    sha = model_sha256(model, cache_dir)
    p0, p1 = free_ports(2)
    manifest = Manifest(
        sha, 6, (RankEntry(0, 0, 3, "127.0.0.1", p0), RankEntry(1, 3, 6, "127.0.0.1", p1)), model_name="tiny"
    )
    stages = [
        await trio.to_thread.run_sync(Stage.load, StageConfig(p, n_ctx=128, n_seq_max=n_seq_max, n_threads=1))
        for p in paths
    ]
    for s in stages:
        await trio.to_thread.run_sync(operator.attrgetter("vocab"), s)
    return stages, manifest


@asynccontextmanager
async def two_node_ring(model: Path, cache_dir: Path, n_seq_max: int = 2) -> AsyncIterator[list[Node]]:
    stages, manifest = await _load(model, cache_dir, n_seq_max)
    try:
        async with AsyncExitStack() as stack:
            nodes = [
                await stack.enter_async_context(open_node(NodeConfig(manifest, r, link_wait=5.0), stages[r]))
                for r in range(2)
            ]
            await wait_for(lambda: all(n.ready for n in nodes))
            yield nodes
    finally:
        for s in stages:
            s.close()


async def wait_for(cond: Callable[[], bool], limit: float = 30.0) -> None:
    """Wait on node state (there is no event for it) instead of sleeping a guessed time."""
    with trio.fail_after(limit):
        while not cond():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def _drain(node: Node, prompt: list[int], max_tokens: int) -> EndEvent:
    async with node.request(prompt, GREEDY, max_tokens) as handle, aclosing(node.events(handle)) as events:
        async for ev in events:
            if isinstance(ev, EndEvent):
                return ev
    raise AssertionError("no end event")


async def test_a_request_waiting_for_admission_gets_the_sequence_the_last_one_freed(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """One sequence per node: a second client waits its turn and is served, never refused for a busy slot."""
    model = tiny_model("llama", "f32")
    with trio.fail_after(60):
        async with two_node_ring(model, cache_dir, n_seq_max=1) as nodes:
            results: list[EndEvent | BaseException] = []

            async def one() -> None:
                try:
                    results.append(await _drain(nodes[0], PROMPT, 6))
                except Exception as exc:  # what a client would see
                    results.append(exc)

            for _ in range(3):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(one)
                    nursery.start_soon(one)
            assert all(isinstance(r, EndEvent) and r.reason in ("max_tokens", "eog") for r in results), results
            assert all(n.status().requests.free_sequences == 1 for n in nodes)


async def test_cancel_at_the_last_rank_during_its_sample_keeps_the_predecessor_link(
    tiny_model: Callable[..., Path], cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A client of the last rank cancels while that rank computes and samples for it: the sample that comes back
    for the finished request is dropped; the node does not lose its predecessor link (and every other request's
    frames on it)."""
    caplog.set_level(logging.INFO, logger="kvasir.node")
    model = tiny_model("llama", "f32")
    with trio.fail_after(60):
        async with two_node_ring(model, cache_dir) as nodes:
            last = nodes[1]
            stage = last.stage
            assert isinstance(stage, Stage)
            pred = last.links.predecessor
            busy = object()
            await stage.limiter.acquire_on_behalf_of(busy)  # the stage is busy: the next compute waits
            async with last.request(PROMPT, GREEDY, 20) as handle:
                # The prompt's FINAL boundary arrived: compute + sample is queued behind the busy stage.
                await wait_for(lambda: stage.limiter.statistics().tasks_waiting >= 1)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(last.cancel, handle.request_id)
                    # The cancel finished the request (its client's end is out) and waits for the compute.
                    await wait_for(lambda: last.requests.get(handle.request_id) is None)
                    stage.limiter.release_on_behalf_of(busy)
                events = [ev async for ev in last.events(handle)]
            assert isinstance(events[-1], EndEvent) and events[-1].reason == "cancelled"
            # The sample for the finished request came back and was dropped; the next request uses the same link.
            await wait_for(lambda: stage.limiter.statistics().borrowed_tokens == 0)
            assert (await _drain(nodes[0], PROMPT, 4)).reason in ("max_tokens", "eog")
            assert not any("predecessor link lost" in r.message for r in caplog.records)
            assert last.links.predecessor is pred
            await wait_for(lambda: all(n.status().requests.free_sequences == 2 for n in nodes))


async def test_a_cancel_cut_short_by_its_caller_still_frees_the_sequence(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """A client leaves while the stage is busy with a long compute: every node still gets its sequence back."""
    model = tiny_model("llama", "f32")
    with trio.fail_after(60):
        async with two_node_ring(model, cache_dir) as nodes:
            entry = nodes[0]

            stage = entry.stage
            assert isinstance(stage, Stage)

            async def busy_stage(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                async with stage.limiter:  # as a long compute of another request would
                    task_status.started()
                    await trio.sleep(1.0)

            async with trio.open_nursery() as nursery, entry.request(PROMPT, GREEDY, 20) as handle:
                await nursery.start(busy_stage)
                with trio.move_on_after(0.2):  # the caller gives up on the cancel before the stage is free
                    await entry.cancel(handle.request_id)
            await wait_for(lambda: [n.status().requests.free_sequences for n in nodes] == [2, 2])
            assert [n.status().requests.in_flight for n in nodes] == [0, 0]
            assert (await _drain(entry, PROMPT, 4)).reason in ("max_tokens", "eog")


@asynccontextmanager
async def node_between_fakes(
    model: Path, cache_dir: Path, **config: Any
) -> AsyncIterator[tuple[Node, StreamLink, StreamLink]]:
    """Rank 1 as a real node, with this test playing rank 0 on both sides: ``(node, up, down)`` where ``up`` sends
    to the node as its predecessor and ``down`` receives what the node sends its successor."""
    paths = stage_files(model, WINDOWS, cache_dir)
    sha = model_sha256(model, cache_dir)
    stage = await trio.to_thread.run_sync(
        lambda: Stage.load(StageConfig(paths[1], n_ctx=128, n_seq_max=2, n_threads=1))
    )
    listeners: list[trio.SocketListener] = []
    try:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        succ_port = listeners[0].socket.getsockname()[1]
        manifest = Manifest(sha, 6, (RankEntry(0, 0, 3, "127.0.0.1", succ_port), RankEntry(1, 3, 6, "127.0.0.1", 0)))
        peer = Hello(
            node_id="peer", model_id=sha, rank=0, ring_size=2, window_start=0, window_end=3, n_layers=6, n_embd=64
        )
        async with open_node(NodeConfig(manifest, 1, **config), stage) as node:
            # The node dials its successor (us, rank 0)...
            down = StreamLink(await listeners[0].accept(), "node")
            await handshake(down, peer, Side.PREDECESSOR, send_first=False)
            # ...and we link as its predecessor.
            up = StreamLink(await trio.open_tcp_stream("127.0.0.1", node.port), "node")
            try:
                await handshake(up, peer, Side.SUCCESSOR, send_first=True)
                yield node, up, down
            finally:
                await up.aclose()
                await down.aclose()
    finally:
        for lst in listeners:
            await lst.aclose()
        stage.close()


async def test_a_token_outside_the_vocabulary_fails_the_request_not_the_node(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """A frame whose latest token is not in the vocabulary must not reach llama.cpp (it aborts the process)."""
    with trio.fail_after(60):
        async with node_between_fakes(tiny_model("llama", "f32"), cache_dir, link_wait=5.0) as (node, up, down):
            rid = 0x1234
            await up.send(StartRequest(rid, (1, 2, 3), 8, 0, "peer", GREEDY))
            hidden = np.zeros((1, 64), np.float32)
            await up.send(Boundary.from_array(rid, 3, hidden, final=True, latest_token=10**6))
            while True:
                frame = await down.receive()
                if isinstance(frame, Error):
                    break
            assert frame.request_id == rid and frame.code == ErrorCode.BAD_REQUEST
            assert node.status().requests.in_flight == 0
            assert node.status().requests.free_sequences == 2


async def test_a_verify_row_out_of_order_fails_the_request_not_the_node(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """A faulty predecessor sends the last rank row 2 of a verify batch it never began: that request fails with
    BAD_REQUEST on its way round, its sequence is freed, and the node goes on serving the next request."""
    with trio.fail_after(60):
        async with node_between_fakes(tiny_model("llama", "f32"), cache_dir, link_wait=5.0) as (node, up, down):

            async def sampled(rid: int) -> Token:
                await up.send(StartRequest(rid, (1, 2, 3), 8, 0, "peer", GREEDY, speculate=2))
                await up.send(Boundary.from_array(rid, 0, np.zeros((3, 64), np.float32), final=True))
                while not isinstance(frame := await down.receive(), Token):
                    pass
                return frame

            first = await sampled(0x51)
            row = Boundary.from_array(
                0x51, first.position, np.zeros((1, 64), np.float32), final=True, latest_token=5, drafts=(6, 7), row=2
            )
            await up.send(row)
            while not isinstance(frame := await down.receive(), Error):
                pass
            assert frame.request_id == 0x51 and frame.code == ErrorCode.BAD_REQUEST
            assert "verify row 2" in frame.message
            assert node.status().requests.in_flight == 0 and node.status().requests.free_sequences == 2
            assert (await sampled(0x52)).request_id == 0x52  # the next request is served


@pytest.mark.parametrize(
    "line",
    [
        b'{"op": "generate", "prompt": "hi", "max_tokens": Infinity}\n',
        b'{"op": "cancel", "request": 1e400}\n',
        b'{"op": "status", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
    ],
    ids=["infinite-max-tokens", "infinite-request-id", "deep-nesting"],
)
async def test_a_malformed_control_line_is_answered_not_fatal(
    line: bytes, tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model("llama", "f32")
    with trio.fail_after(60):
        async with two_node_ring(model, cache_dir) as nodes, trio.open_nursery() as nursery:
            sock = tmp_path / "c.sock"
            await nursery.start(serve_control, nodes[0], sock)
            s = await trio.open_unix_socket(str(sock))
            await s.send_all(line)
            reply = b""
            while not reply.endswith(b"\n"):
                reply += await s.receive_some(65536)
            assert json.loads(reply)["type"] == "error"
            await s.aclose()
            # The control socket (and the node) still serve.
            s = await trio.open_unix_socket(str(sock))
            await s.send_all(b'{"op": "status"}\n')
            reply = b""
            while not reply.endswith(b"\n"):
                reply += await s.receive_some(65536)
            assert json.loads(reply)["type"] == "status"
            await s.aclose()
            nursery.cancel_scope.cancel()


async def test_watch_never_writes_a_torn_line_to_a_slow_reader(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """An event line that is slow to write is delivered whole before the next status line, however slow the reader."""
    model = tiny_model("llama", "f32")
    with trio.fail_after(60):
        async with two_node_ring(model, cache_dir) as nodes, trio.open_nursery() as nursery:
            sock = tmp_path / "w.sock"
            await nursery.start(serve_control, nodes[0], sock)
            s = await trio.open_unix_socket(str(sock))
            await s.send_all(b'{"op": "watch", "interval": 0.1}\n')
            await trio.sleep(0.2)
            nodes[0].hub.publish(TokenPassed(1, 0, 1, "x" * (4 << 20)))  # far beyond the socket's buffer
            await trio.sleep(0.5)  # the reader is slow: status deadlines pass while the line is being written
            data = b""
            with trio.move_on_after(3):
                while data.count(b"\n") < 8:
                    data += await s.receive_some(1 << 20)
            lines = data.split(b"\n")[:-1]
            assert any(len(json.loads(ln).get("text", "")) == 4 << 20 for ln in lines)
            for ln in lines:
                json.loads(ln)  # no torn line
            await s.aclose()
            nursery.cancel_scope.cancel()


async def test_a_request_abandoned_by_its_entry_is_freed_on_every_node(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """A START whose entry node never says anything again: the node frees its sequence after the stall limit."""
    model = tiny_model("llama", "f32")
    with trio.fail_after(60):
        async with node_between_fakes(model, cache_dir, link_wait=0.3, stall_timeout=0.5) as (node, up, _down):
            await up.send(StartRequest(0x77, (1, 2, 3), 8, 0, "peer", GREEDY))
            await wait_for(lambda: node.requests.get(0x77) is not None)  # registered, waiting for its boundaries
            # ...until the reaper frees it (its sequence is back once the stage has dropped the cache).
            await wait_for(lambda: node.status().requests.free_sequences == 2)
            assert node.status().requests.in_flight == 0


async def test_the_control_socket_never_removes_what_is_not_a_stale_socket(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """N19 (security-2): ``--control PATH`` used to unlink whatever was at PATH (a user's file, a live node's socket),
    and flipped the process-wide umask around ``bind``. Now a file is refused, a live socket is refused, a stale
    socket a killed node left behind is replaced, and the socket is 0600."""
    model = tiny_model("llama", "f32")
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    stale = tmp_path / "stale.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))
    dead.close()  # a socket file nobody listens on: what a SIGKILLed node leaves
    with trio.fail_after(60):
        async with two_node_ring(model, cache_dir) as nodes, trio.open_nursery() as nursery:
            with pytest.raises(InputError, match="not a socket"):
                await nursery.start(serve_control, nodes[0], precious)
            assert precious.read_text() == "keep me"
            await nursery.start(serve_control, nodes[0], stale)
            assert stat.S_IMODE(os.stat(stale).st_mode) == 0o600
            with pytest.raises(InputError, match="another process is serving it"):
                await nursery.start(serve_control, nodes[1], stale)
            s = await trio.open_unix_socket(str(stale))  # the first node's socket still answers
            await s.send_all(b'{"op": "status"}\n')
            reply = b""
            while not reply.endswith(b"\n"):
                reply += await s.receive_some(65536)
            assert json.loads(reply)["type"] == "status"
            await s.aclose()
            nursery.cancel_scope.cancel()
    assert not stale.exists()  # removed on the way out
