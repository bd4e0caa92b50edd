"""The TUI (``tui/``): its model, reconnecting, a flood of events, and a Pilot run against a live ring.

Textual runs on asyncio while the project's tests run on trio (``trio_mode``): these tests are plain synchronous
functions that call ``asyncio.run`` around ``app.run_test()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from textual.widgets import Input, Label, Markdown, TabbedContent

from kvasir.commands.tui import socket_source
from kvasir.control.paths import node_socket_path
from kvasir.control.server import serve_control
from kvasir.ring.node import NodeConfig, open_node
from kvasir.testing.fakestage import MemoryNetwork, fake_ring
from kvasir.tui.app import KvasirTUI
from kvasir.tui.model import NodeModel, Segment, fill_gaps, sanitize
from kvasir.tui.screens import HelpScreen, Sampling, SettingsScreen, parse_sampling
from kvasir.tui.screenshots import stale_app
from kvasir.tui.source import Message, ReplaySource, SocketSource, SourceError
from kvasir.tui.widgets import (
    CoverageMap,
    NodePanel,
    RingView,
    TokenStream,
    render_coverage,
    render_node,
    render_requests,
)
from tests.ringutil import ring_generate, running_ring

SESSION = Path(__file__).parent / "data" / "tui_session.jsonl"
PROMPT = "Tell me about the ring"


async def wait_until(cond: Callable[[], bool], limit: float = 60.0, step: float = 0.05) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(step)


def _status(uptime: float, frames: int, tokens: int = 0, node_id: str = "n1") -> dict[str, Any]:
    link = {"state": "connected", "kind": "direct", "frames_in": frames, "frames_out": 0, "bytes_in": frames * 100}
    return {
        "node_id": node_id,
        "rank": 0,
        "ring_size": 2,
        "model": {"name": "m", "layers": 8},
        "window": [0, 4],
        "uptime_s": uptime,
        "ranks": [{"rank": 0, "layers": [0, 4]}, {"rank": 1, "layers": [4, 6]}],
        "links": {"predecessor": link, "successor": {**link, "rtt_ms": 2.5}},
        "requests": {"tokens": tokens},
    }


def test_coverage_marks_uncovered_layers() -> None:
    model = NodeModel()
    model.apply({"type": "status", "status": _status(1.0, 0)})
    assert model.coverage() == [Segment(0, 4, "rank 0"), Segment(4, 6, "rank 1"), Segment(6, 8, None)]
    assert fill_gaps([(2, 3, "a")], 4) == [Segment(0, 2, None), Segment(2, 3, "a"), Segment(3, 4, None)]
    text = render_coverage(model.coverage(), 8, 40, (0, 4), "rank 0").plain
    assert "6:8 uncovered" in text and "rank 0 0:4 (this node)" in text and "░" in text.splitlines()[0]


def test_coverage_from_the_market_shows_holders_and_rewards() -> None:
    """A self-enrolled node's status carries the market's map: who serves each window and what it pays."""
    model = NodeModel()
    market = [
        {"rank": 0, "layers": [0, 4], "holder": "n1", "reward": 2.5, "state": "serving"},
        {"rank": 1, "layers": [4, 6], "holder": None, "reward": 1.0, "state": None},
        {"rank": 2, "layers": [6, 8], "holder": "n3", "reward": 3.0, "state": "serving"},
    ]
    model.apply({"type": "status", "status": {**_status(1.0, 0), "market": market}})
    assert model.coverage() == [Segment(0, 4, "rank 0", 2.5), Segment(4, 6, None, 1.0), Segment(6, 8, "rank 2", 3.0)]
    text = render_coverage(model.coverage(), 8, 40, (0, 4), "rank 0").plain
    assert "4:6 uncovered" in text and "¤2.5" in text and "¤3" in text


def test_rates_from_successive_snapshots() -> None:
    model = NodeModel()
    for k, (uptime, frames, tokens) in enumerate([(1.0, 0, 0), (1.2, 5, 1), (2.0, 20, 10), (3.0, 5, 12)]):
        model.apply({"type": "status", "status": _status(uptime, frames, tokens)})
        if k == 1:
            assert not model.links["predecessor"].frames_hist  # too close to the last sample for a rate
    pred = model.links["predecessor"]
    assert list(pred.frames_hist) == [20.0, 5.0]  # the counter went down: a new link, counted from zero
    assert pred.bytes_s == 500.0 and model.links["successor"].rtt_ms == 2.5
    assert model.token_rate == 2.0


def test_node_panel_shows_where_the_time_went() -> None:
    model = NodeModel()
    model.apply({"type": "status", "status": _status(1.0, 0)})
    assert "time" not in str(render_node(model))  # a node that has not computed yet: no row
    busy = {**_status(2.0, 5), "busy_s": 12.34, "handoff_s": 0.56, "send_s": 0.25}
    model.apply({"type": "status", "status": busy})
    assert "compute 12.3 s · worker hand-off 0.6 s · link sends 0.2 s" in str(render_node(model))
    assert "speculation" not in str(render_node(model))  # no verify batch yet: no row
    spec = {**busy, "requests": {"verify_batches": 7, "drafted": 20, "accepted": 15, "eager_steps": 3}}
    model.apply({"type": "status", "status": spec})
    assert "7 verify batches · 15/20 drafts accepted (75%) · 3 steps drafted eagerly" in str(render_node(model))


def test_node_panel_shows_what_ring_ups_supervisor_says_of_the_windows() -> None:
    model = NodeModel()
    model.apply({"type": "status", "status": _status(1.0, 0)})
    assert "ring up" not in str(render_node(model))  # a node on its own: no row
    down = {"label": "rank 2", "state": "down", "streak": 3, "exit_code": -9, "down_since": 0.0, "retry_at": 4.0}
    sup = {"written_at": 1.0, "processes": [{"label": "rank 0", "state": "up", "pid": 7}, down]}
    model.apply({"type": "status", "status": {**_status(2.0, 0), "supervisor": sup}})
    text = str(render_node(model))
    clock = time.strftime("%H:%M:%S", time.localtime(4.0))
    assert "ring up" in text and f"rank 2 down since {time.strftime('%H:%M:%S', time.localtime(0.0))}" in text
    assert f"(exit -9, 3 times in a row); next restart at {clock}" in text and "rank 0" not in text.split("ring up")[1]
    model.apply({"type": "status", "status": {**_status(3.0, 0), "supervisor": {"written_at": 2, "processes": []}}})
    assert "all 0 processes up" in str(render_node(model))
    model.apply({"type": "status", "status": {**_status(4.0, 0), "supervisor": {"written_at": "x"}}})
    assert model.bad_status == 1 and "all 0 processes up" in str(render_node(model))  # refused: the last one stays


def test_token_events_and_sanitize() -> None:
    model = NodeModel()
    model.apply_all(
        [
            {"type": "request", "state": "start", "request": 7, "prompt_tokens": 3, "entry_rank": 1},
            {"type": "token", "request": 7, "index": 0, "token": 5, "text": "Hi"},
            {"type": "token", "request": 7, "index": 1, "token": 6, "text": " \x02there"},
            {"type": "request", "state": "end", "request": 7, "reason": "eog"},
        ]
    )
    req = model.requests[7]
    assert (req.text, req.tokens, req.state, req.reason) == ("Hi \x02there", 2, "ended", "eog")
    assert sanitize(req.text) == "Hi \u2402there"


def test_a_lost_connection_leaves_no_live_looking_leftovers() -> None:
    """After a lost connection: a request last seen running is unknown until a token shows it is still going; a
    status from another node (a restarted ring) starts the rates and their history over."""
    model = NodeModel()
    model.apply_all([{"type": "status", "status": _status(1.0, 0)}, {"type": "status", "status": _status(2.0, 50, 4)}])
    model.apply_all(
        [{"type": "request", "state": "start", "request": r, "prompt_tokens": 3, "entry_rank": 0} for r in (7, 8)]
    )
    assert model.links["predecessor"].frames_hist and model.token_hist
    model.mark_stale("12:00:00")
    model.mark_stale("12:00:05")
    assert model.stale_since == "12:00:00"  # since the first loss, not the latest retry
    assert "◌ " in render_requests(list(model.requests.values()), 80, stale=True).plain
    model.apply({"type": "status", "status": _status(3.0, 60, 5)})  # the same node, back
    assert not model.stale and [r.state for r in model.requests.values()] == ["unknown", "unknown"]
    assert len(model.links["predecessor"].frames_hist) == 2  # the same node: its history goes on
    model.apply({"type": "token", "request": 8, "index": 0, "token": 1, "text": "x"})
    assert [r.state for r in model.requests.values()] == ["unknown", "running"]
    text = render_requests(list(model.requests.values()), 80).plain
    assert "◌ 000007  · state unknown (missed while disconnected)" in text and "● 000008" in text
    model.apply({"type": "status", "status": _status(0.5, 0, node_id="n2")})  # a restarted ring
    pred = model.links["predecessor"]
    assert not pred.frames_hist and pred.frames_s == 0.0 and not model.token_hist and model.token_rate == 0.0


def test_sampling_form_parsing() -> None:
    s = parse_sampling({"temperature": "0.7", "top_k": "20", "top_p": "0.9", "max_tokens": "32", "seed": ""}, True)
    assert s == Sampling(0.7, 20, 0.9, 32, None, True)
    assert s.request("hi") == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "max_tokens": 32,
        "chat": True,
        "prompt": "hi",
    }
    with pytest.raises(ValueError, match="top_p"):
        parse_sampling({"temperature": "0", "top_k": "1", "top_p": "2", "max_tokens": "1"}, True)


def test_replay_then_chat_and_cancel() -> None:
    async def main() -> None:
        source = ReplaySource.from_file(SESSION)
        app = KvasirTUI(source, pace=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await source.replayed.wait()
            await wait_until(lambda: app.model.status is not None)
            assert app.model.window == (6, 12)
            assert app.query_one(CoverageMap).mine == (6, 12)
            await pilot.press("f4")
            await pilot.press("h", "i", "enter")
            await wait_until(lambda: app.answer_done)
            assert source.requests[-1]["prompt"] == "hi"
            assert app.answer_text.startswith("A **ring** of nodes")
            await pilot.press("ctrl+t")
            assert app.theme == "textual-light"
            await pilot.press("f5")
            await pilot.pause()
            await pilot.press("escape")
            await pilot.press("f1")
            await pilot.pause()
            await pilot.press("escape")
            await pilot.pause()
            app.generating = 42
            await pilot.press("escape")  # Esc stops the answer being generated
            await wait_until(lambda: source.cancelled == [42])

    asyncio.run(main())


def test_tab_keys_work_from_every_tab_and_from_the_chat_prompt() -> None:
    """F2/F3/F4 switch tabs from anywhere, the chat prompt's focus included (F2 from the prompt used to flip straight
    back to the chat); F1 and F5 open their screens from the prompt; only F4 focuses the prompt."""

    async def main() -> None:
        source = ReplaySource.from_file(SESSION)
        app = KvasirTUI(source, pace=False)
        async with app.run_test(size=(80, 24)) as pilot:
            await source.replayed.wait()
            tabs = app.query_one(TabbedContent)
            prompt = app.query_one("#prompt", Input)

            async def press(key: str) -> None:
                await pilot.press(key)
                await pilot.pause(0.2)  # the flip back came a few messages later

            for start in ("f2", "f3", "f4"):
                for key, tab in (("f2", "ring"), ("f3", "tokens"), ("f4", "chat"), ("f3", "tokens")):
                    await press(start)
                    if start == "f4":
                        assert app.focused is prompt
                    await press(key)
                    assert tabs.active == tab, f"{start} then {key}: {tabs.active}"
                    assert (app.focused is prompt) == (tab == "chat"), f"{start} then {key}: focus on {app.focused}"
            await press("f4")
            await pilot.press("h", "i")
            await press("f2")
            await press("f4")
            assert prompt.value == "hi"  # typing went to the prompt, and switching tabs kept it
            await press("f1")
            assert isinstance(app.screen, HelpScreen)
            await press("escape")
            await press("f5")
            assert isinstance(app.screen, SettingsScreen)
            await press("escape")
            assert tabs.active == "chat" and app.focused is prompt
            await press("ctrl+t")
            assert app.theme == "textual-light"
            await press("ctrl+l")  # from the prompt too (nothing to clear; it must not type)
            assert prompt.value == "hi"

    asyncio.run(main())


def _shown(app: KvasirTUI, selector: str) -> str:
    return str(app.query_one(selector).render())


def test_stale_while_disconnected() -> None:
    """The node goes away: the header says so in one 80-column line, and the last status is marked as the past."""

    async def main() -> None:
        app = stale_app()
        assert isinstance(app.source, ReplaySource)
        async with app.run_test(size=(80, 24)) as pilot:
            await app.source.replayed.wait()
            await wait_until(lambda: not app.connected and app.model.stale and not app._dirty, limit=10)
            await pilot.pause()
            header = app.header_text()
            assert "disconnected · retrying in 600 s · Ctrl+R: now" in header
            assert len(header) <= 80 - 2  # the #conn bar's padding
            banner = _shown(app, "#stale")
            assert banner.startswith("stale since 12:34:56") and banner.endswith("the node closed the connection")
            for name in ("predecessor", "successor"):
                title = str(app.query_one(f"#link-{name} .title", Label).render())
                assert "○ unknown" in title and "●" not in title, title
                assert "last seen: " in title and ", connected" in title
                assert str(app.query_one(f"#link-{name} .frames", Label).render()).strip() == "- fr/s"
                assert app.query_one(f"#link-{name}").has_class("stale")
            node = str(app.query_one(NodePanel).render())
            assert "stale        since 12:34:56" in node and "up 21 s when last seen" in node and "- tok/s" in node
            tokens = str(app.query_one(TokenStream).render())
            assert "◌ 5b2e45  · state unknown (stale)" in tokens  # last seen running: it may have ended since
            assert "● " not in tokens
            assert app.query_one(CoverageMap).has_class("stale") and app.query_one(RingView).has_class("stale")

    asyncio.run(main())


class FakeRingThread:
    """Two real nodes (FakeStages on memory links) in a trio thread, rank 0 serving the real control socket ``sock``.

    What ``kvasir ring up`` gives a TUI, without a model: a status that follows the node's own schema, on a socket that
    exists while the ring runs and is removed when it stops.
    """

    def __init__(self, sock: Path, name: str) -> None:
        self.sock, self.name = sock, name
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # handed to the test's thread
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        net = MemoryNetwork()
        manifest, stages = fake_ring([(0, 2), (2, 4)], net)
        async with (
            open_node(NodeConfig(manifest, 0, node_id=f"{self.name}0"), stages[0], transport=net) as node,
            open_node(NodeConfig(manifest, 1, node_id=f"{self.name}1"), stages[1], transport=net),
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_control, node, self.sock)
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30), "the fake ring did not start"
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(30)
        assert not self._thread.is_alive() and not self.sock.exists()
        if self._error is not None:
            raise self._error


def test_a_bare_tui_follows_a_ring_restarted_on_new_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bare ``kvasir tui`` finds the node again at each reconnect (Ctrl+R or the backoff), so it follows ``ring up``
    restarted on new ports, hence new socket names; until the new status comes, the old one is shown as stale.
    ``--socket`` keeps its path."""
    runtime = tempfile.mkdtemp(prefix="kvt-")  # short: a socket path has 108 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    first, second, third = (node_socket_path(0, port) for port in (7001, 7002, 7003))

    def node_id(app: KvasirTUI) -> str | None:
        return None if app.model.node is None else app.model.node.node_id

    def live(app: KvasirTUI, name: str) -> bool:
        return app.connected and node_id(app) == name and not app.model.stale

    async def main() -> None:
        ring_a, ring_b, ring_c = FakeRingThread(first, "a"), FakeRingThread(second, "b"), FakeRingThread(third, "c")
        ring_a.start()
        try:
            # Ctrl+R: the backoff is too long to reconnect by itself within the test.
            source = socket_source(None)
            app = KvasirTUI(source, wall_clock=lambda: "12:34:56", backoff=(600, 600))
            async with app.run_test(size=(80, 24)) as pilot:
                await wait_until(lambda: live(app, "a0"), limit=20)
                assert source.path == first and app.sub_title == str(first)
                await asyncio.to_thread(ring_a.stop)
                await wait_until(lambda: not app.connected and app.model.stale, limit=10)
                ring_b.start()
                await pilot.pause(0.5)
                assert node_id(app) == "a0" and app.model.stale  # no reconnect yet: stale, not live
                assert "○ unknown" in str(app.query_one("#link-successor .title", Label).render())
                await pilot.press("ctrl+r")
                await wait_until(lambda: live(app, "b0"), limit=20)
                await wait_until(lambda: not app._dirty, limit=5)
                await pilot.pause()
                assert source.path == second and app.sub_title == str(second)
                assert not app.query_one("#stale").display and "● connected" in _shown(app, "#conn")
                assert "○ unknown" not in str(app.query_one("#link-successor .title", Label).render())
                assert "stale" not in str(app.query_one(NodePanel).render())
            # ``--socket``: the path given, even with another node up.
            fixed = socket_source(first)
            with pytest.raises(SourceError, match=r"rank0-7001\.sock"):
                async for _ in fixed.watch(1.0):
                    pass
            # The backoff alone: the next attempt finds the new socket.
            app = KvasirTUI(socket_source(None), backoff=(0.1, 0.2))
            async with app.run_test(size=(80, 24)):
                await wait_until(lambda: live(app, "b0"), limit=20)
                await asyncio.to_thread(ring_b.stop)
                await wait_until(lambda: not app.connected, limit=10)
                await asyncio.sleep(0.5)
                assert "no running node found" in (app.conn_error or "")
                ring_c.start()
                await wait_until(lambda: live(app, "c0"), limit=20)
            await asyncio.to_thread(ring_c.stop)
        finally:
            for ring in (ring_a, ring_b, ring_c):
                if ring._thread.is_alive():
                    ring.stop()

    asyncio.run(main())


class FloodSource(ReplaySource):
    """A node that sends events far faster than anyone could read them."""

    def __init__(self, n: int) -> None:
        super().__init__([])
        self.n = n

    async def watch(self, interval: float) -> AsyncIterator[Message]:
        yield {"type": "status", "status": _status(1.0, 0)}
        for i in range(self.n):
            yield {"type": "token", "request": 1 + i % 3, "index": i, "token": i, "text": "x"}
        self.replayed.set()
        await asyncio.Event().wait()


def test_event_flood_does_not_freeze() -> None:
    async def main() -> None:
        source = FloodSource(100_000)
        app = KvasirTUI(source, pace=False)
        ticks = 0

        def tick() -> None:
            nonlocal ticks
            ticks += 1

        async with app.run_test(size=(80, 24)):
            app.set_interval(0.02, tick)
            await source.replayed.wait()
            await wait_until(lambda: not app._pending, limit=30)
            assert ticks > 0  # the UI's timers kept running while the flood was read
            assert app.model.events + app.dropped == 100_000

    asyncio.run(main())


def test_disconnected_then_reconnects() -> None:
    status = {"type": "status", "status": _status(1.0, 0)}

    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.readline()
        writer.write(json.dumps(status).encode() + b"\n")
        await writer.drain()
        with contextlib.suppress(ConnectionError):
            await reader.read()

    async def main() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            sock = Path(tmp) / "node.sock"
            app = KvasirTUI(SocketSource(sock))
            server: asyncio.Server | None = None
            async with app.run_test(size=(80, 24)):
                await wait_until(lambda: "disconnected" in app.conn_note, limit=10)
                server = await asyncio.start_unix_server(serve, str(sock))
                await wait_until(lambda: app.connected and app.model.status is not None, limit=10)
                await asyncio.sleep(0.2)
                assert "connected" in str(app.query_one("#conn").render())
            for w in writers:
                w.close()
                with contextlib.suppress(ConnectionError):
                    await w.wait_closed()
            assert server is not None
            server.close()
            await server.wait_closed()

    asyncio.run(main())


@pytest.mark.slow
def test_live_ring(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    """Against a real two-node ring: the ring and this node's window show, a chat prompt streams its answer."""
    with running_ring(tiny_model("llama", "f32"), [(0, 3), (3, 6)], cache_dir) as ring:
        sock = ring.sockets[1]
        expected = ring_generate(sock, PROMPT, max_tokens=12, temperature=0.0, chat=True)["text"]
        assert expected

        async def main() -> None:
            app = KvasirTUI(SocketSource(sock), sampling=Sampling(temperature=0.0, max_tokens=12))
            async with app.run_test(size=(100, 30)) as pilot:
                await wait_until(lambda: app.connected and app.model.status is not None)
                await pilot.pause(0.3)
                assert app.model.window == (3, 6)
                cover = app.query_one(CoverageMap)
                assert (cover.mine, cover.n_layers) == ((3, 6), 6)
                assert [s.holder for s in cover.segments] == ["rank 0", "rank 1"]
                ring_view = app.query_one(RingView)
                assert [r["rank"] for r in ring_view.ranks] == [0, 1] and ring_view.me == 1
                assert "◆you" in str(ring_view.render())
                await pilot.press("f4")
                app.query_one("#prompt").value = PROMPT  # type: ignore[attr-defined]
                await pilot.press("enter")
                await wait_until(lambda: app.answer_done)
                assert app.answer_text == expected
                md = app.query(Markdown).last()
                assert md.source == sanitize(expected)

        asyncio.run(main())


@pytest.mark.slow
def test_live_token_stream(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    """Tokens of a request entered at rank 0 show in the token stream of a TUI watching rank 1."""
    with running_ring(tiny_model("llama", "f32"), [(0, 3), (3, 6)], cache_dir) as ring:

        async def main() -> None:
            app = KvasirTUI(SocketSource(ring.sockets[1]))
            async with app.run_test(size=(100, 30)):
                await wait_until(lambda: app.connected and app.model.status is not None)
                expected = await asyncio.to_thread(ring_generate, ring.sockets[0], PROMPT, 12, temperature=0.0)
                await wait_until(lambda: any(r.state == "ended" for r in app.model.requests.values()), limit=20)
                (req,) = app.model.requests.values()
                assert req.text == expected["text"] and req.entry_rank == 0

        asyncio.run(main())
