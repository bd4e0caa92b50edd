"""One real node in-process on loopback, poked by hand-made peers: refused neighbours, bad frames, waiting."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from kvasir.ring.links import StreamLink
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.node import NodeConfig, open_node
from kvasir.shard.cache import model_sha256, stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.wire import MAGIC, PROTOCOL_VERSION, Error, ErrorCode, FrameType, Hello, Keepalive
from kvasir.wire.frames import HEADER


async def _node(model: Path, cache_dir: Path) -> tuple[NodeConfig, Stage, Manifest]:
    windows = [(0, 3), (3, 6)]
    paths = stage_files(model, windows, cache_dir)
    sha = model_sha256(model, cache_dir)
    manifest = Manifest(sha, 6, (RankEntry(0, 0, 3, "127.0.0.1", 1), RankEntry(1, 3, 6, "127.0.0.1", 0)))
    stage = await trio.to_thread.run_sync(
        lambda: Stage.load(StageConfig(paths[1], n_ctx=128, n_seq_max=2, n_threads=1))
    )
    return NodeConfig(manifest, 1), stage, manifest


async def wait_for(cond: Callable[[], bool], limit: float = 30.0) -> None:
    with trio.fail_after(limit):
        while not cond():  # noqa: ASYNC110 (node state has no event to wait on)
            await trio.sleep(0.01)


def _hello(manifest: Manifest, model_id: str | None = None, node_id: str = "rogue") -> Hello:
    return Hello(
        node_id=node_id,
        model_id=model_id or manifest.model_sha256,
        rank=0,
        ring_size=2,
        window_start=0,
        window_end=3,
        n_layers=6,
        n_embd=64,
    )


async def test_bad_peers_are_refused_and_the_node_keeps_serving(
    tiny_model: Callable[..., Path], cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvasir.node")
    config, stage, manifest = await _node(tiny_model("llama", "f32"), cache_dir)
    try:
        with trio.fail_after(60):
            async with open_node(config, stage) as node:
                port = node.port
                # The successor (rank 0) is not up: the node says it is waiting and keeps retrying.
                await wait_for(lambda: "waiting for rank 0" in node.status().successor.state)

                async def raw(data: bytes) -> bytes:
                    s = await trio.open_tcp_stream("127.0.0.1", port)
                    await s.send_all(data)
                    out = b""
                    with trio.move_on_after(5):
                        while chunk := await s.receive_some(65536):
                            out += chunk
                    await s.aclose()
                    return out

                await raw(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)  # not a frame at all
                await raw(HEADER.pack(MAGIC, PROTOCOL_VERSION + 1, FrameType.HELLO, 0, 0, 0, -1, 10))  # wrong version
                # A header announcing a 2 GiB body is refused before anything is allocated.
                await raw(HEADER.pack(MAGIC, PROTOCOL_VERSION, FrameType.HELLO, 0, 0, 0, -1, 2**31))
                # A neighbour serving another model is refused with MODEL_MISMATCH.
                s = await trio.open_tcp_stream("127.0.0.1", port)
                link = StreamLink(s, "test")
                await link.send(_hello(manifest, model_id="f" * 64))
                reply = await link.receive()
                assert isinstance(reply, Error) and reply.code == ErrorCode.MODEL_MISMATCH
                await link.aclose()
                assert node.status().predecessor.state == "waiting"

                # A proper predecessor links, then sends a malformed frame: that link is closed with a reason.
                s = await trio.open_tcp_stream("127.0.0.1", port)
                link = StreamLink(s, "test")
                await link.send(_hello(manifest))
                assert isinstance(await link.receive(), Hello)
                await link.send(Keepalive())
                assert isinstance(await link.receive(), Keepalive)  # keepalives are echoed
                await s.send_all(HEADER.pack(MAGIC, PROTOCOL_VERSION, 99, 0, 0, 0, -1, 0))  # unknown frame type
                with trio.move_on_after(5):
                    while True:
                        try:
                            await link.receive()
                        except (trio.EndOfChannel, trio.BrokenResourceError, Exception):
                            break
                await link.aclose()
                await wait_for(lambda: any("closing predecessor link" in r.message for r in caplog.records))
                await wait_for(lambda: node.status().predecessor.state == "waiting")
                # ...and the node still accepts a good predecessor afterwards.
                s = await trio.open_tcp_stream("127.0.0.1", port)
                link = StreamLink(s, "test")
                await link.send(_hello(manifest, node_id="good"))
                assert isinstance(await link.receive(), Hello)
                await wait_for(lambda: node.status().predecessor.state.startswith("connected"))
                assert any("refused" in r.message and "bad magic" in r.message for r in caplog.records)
                assert any("protocol version" in r.message for r in caplog.records)
                assert any("too large" in r.message or "exceeds" in r.message for r in caplog.records), [
                    r.message for r in caplog.records
                ]
                await link.aclose()
    finally:
        stage.close()
