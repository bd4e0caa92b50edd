"""``kvasir tui``: a Textual app attached to one node's control socket.

It never slows the node: it reads one ``watch`` stream in an asyncio task (the node's event hub drops what an
observer does not take in time), queues the messages, and applies them to the model and the widgets at most
``REFRESH_HZ`` times a second. A chat prompt is one ``generate`` op on its own connection; stopping it is a
``cancel`` op on another one.

When the connection is lost it retries with a backoff (the source finds the node again each time: a bare ``kvasir
tui`` follows a restarted ring), and until a fresh status arrives everything on screen is marked stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, Markdown, Static, TabbedContent, TabPane

from kvasir.tui.model import NodeModel, sanitize
from kvasir.tui.screens import HelpScreen, Sampling, SettingsScreen
from kvasir.tui.source import Message, Source, SourceError
from kvasir.tui.widgets import CoverageMap, LinkRow, NodePanel, RingView, TokenStream

REFRESH_HZ = 10
#: Queued watch messages beyond this are dropped (oldest events first) so a flood cannot grow memory.
MAX_PENDING = 20000
#: Reconnect delays: doubles from the first to the last.
BACKOFF = (0.5, 8.0)

DARK, LIGHT = "textual-dark", "textual-light"
#: What each tab focuses when it is chosen (F2/F3/F4, the palette).
TAB_FOCUS = {"ring": "#ring-pane", "tokens": "#tokens-pane", "chat": "#prompt"}


class ChatLog(VerticalScroll):
    DEFAULT_CSS = """
    ChatLog { height: 1fr; padding: 0 1; }
    ChatLog .prompt { color: $text-accent; text-style: bold; margin: 1 0 0 0; }
    ChatLog .meta { color: $text-muted; }
    ChatLog Markdown { margin: 0; padding: 0; }
    """


class KvasirTUI(App[None]):
    TITLE = "Kvasir"
    CSS = """
    Screen { layout: vertical; }
    TabbedContent { height: 1fr; }
    TabPane { padding: 0; }
    #ring-pane VerticalScroll { height: 1fr; }
    .section { color: $text-muted; text-style: bold; padding: 0 1; height: 1; }
    #conn { height: 1; padding: 0 1; background: $boost; }
    #conn.down { background: $error 40%; }
    #stale { height: auto; padding: 0 1; color: $text-warning; background: $warning 15%; }
    /* Stale (disconnected): the past, dimmed; the widgets say "stale" / "unknown" in words too. */
    CoverageMap.stale, RingView.stale, TokenStream.stale, LinkRow.stale > Horizontal { opacity: 50%; }
    #chat-status { height: 1; padding: 0 1; color: $text-muted; }
    #prompt { margin: 0 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("f1,question_mark", "help", "Help", key_display="F1"),
        Binding("f2", "tab('ring')", "Ring", show=False),
        Binding("f3", "tab('tokens')", "Tokens", show=False),
        Binding("f4", "tab('chat')", "Chat", show=False),
        Binding("f5", "settings", "Settings", key_display="F5"),
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+l", "clear_chat", "Clear", show=False),
        Binding("ctrl+t", "toggle_theme", "Theme"),
        Binding("ctrl+r", "reconnect", "Reconnect", show=False),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(
        self,
        source: Source,
        *,
        sampling: Sampling | None = None,
        interval: float = 1.0,
        dark: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], str] = lambda: time.strftime("%H:%M:%S"),
        pace: bool = True,
        backoff: tuple[float, float] = BACKOFF,
    ) -> None:
        """``pace``: read status snapshots no faster than two per ``interval`` (off for replays). ``wall_clock``: the
        time of day a lost connection is stamped with. ``backoff``: the first and the longest reconnect delay."""
        super().__init__()
        self.source = source
        self.sampling = sampling or Sampling()
        self.interval = interval
        self.model = NodeModel()
        self.connected = False
        self.conn_note = "connecting…"
        #: Why the last connection failed or ended (shown in full under the header while disconnected).
        self.conn_error: str | None = None
        self.backoff = backoff
        self.dropped = 0
        self.generating: int | None = None  # request id of the answer being streamed
        self._busy = False
        self._dark = dark
        self._clock = clock
        self._wall_clock = wall_clock
        self._pace = pace
        self._pending: list[Message] = []
        self._dirty = True
        self._wake = asyncio.Event()
        self._answer = ""  # raw text of the answer being streamed
        self._answer_shown = 0  # how much of it the Markdown widget has
        self._answer_md: Markdown | None = None
        self._answer_meta: Static | None = None
        self._answers = 0
        self.answer_done = False  # the last prompt's answer has ended (tests wait on this)

    # ------------------------------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Static("connecting…", id="conn")
        banner = Static("", id="stale")
        banner.display = False
        yield banner
        with TabbedContent(initial="ring"):
            with TabPane("F2 Ring", id="ring"), VerticalScroll(id="ring-pane"):
                yield Static("layers", classes="section")
                yield CoverageMap(id="coverage")
                yield Static("ring and links", classes="section")
                yield RingView(id="ringview")
                yield LinkRow("predecessor", id="link-predecessor")
                yield LinkRow("successor", id="link-successor")
                yield Static("this node", classes="section")
                yield NodePanel(id="node")
            with TabPane("F3 Tokens", id="tokens"), VerticalScroll(id="tokens-pane"):
                yield TokenStream(id="stream")
            with TabPane("F4 Chat", id="chat"), Vertical():
                yield ChatLog(id="chatlog")
                yield Static("", id="chat-status")
                yield Input(placeholder="Ask the ring… (Enter to send, F5 settings)", id="prompt")
        yield Footer()

    def on_mount(self) -> None:
        self.theme = DARK if self._dark else LIGHT
        self.sub_title = self.source.label
        self._update_chat_status()
        self.set_interval(1 / REFRESH_HZ, self.flush)
        self._start_watch()

    def _start_watch(self) -> None:
        self.run_worker(self._watch_loop(), group="watch", exclusive=True, exit_on_error=False)

    # ------------------------------------------------------------------------------------------ watching

    async def _watch_loop(self) -> None:
        delay = self.backoff[0]
        while True:
            self._wake.clear()
            try:
                last_status = -1e9
                n = 0
                async for msg in self.source.watch(self.interval):
                    if not self.connected:
                        self.connected, self.conn_note, delay = True, "connected", self.backoff[0]
                        self.sub_title = self.source.label  # a bare `kvasir tui` may have found another socket
                        self._dirty = True
                    self._queue(msg)
                    n += 1
                    if self._pace and msg.get("type") == "status":
                        # A node that sends snapshots much faster than asked gets read more slowly (TCP holds it).
                        now = self._clock()
                        gap = self.interval / 2 - (now - last_status)
                        last_status = now
                        if gap > 0:
                            await asyncio.sleep(gap)
                            last_status = self._clock()
                    if n % 64 == 0:
                        await asyncio.sleep(0)  # let the UI breathe under a flood
                note = "the node closed the connection"
            except (SourceError, OSError) as exc:
                note = str(exc)
            self._lost(note)
            self.conn_note = f"disconnected · retrying in {delay:g} s · Ctrl+R: now"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
            delay = min(delay * 2, self.backoff[1])
            self.conn_note = "reconnecting…"
            self._dirty = True

    def _lost(self, why: str) -> None:
        """The connection failed or ended: what was read still counts, and from now on it is the past."""
        if self._pending:  # applied now, so that a status of the next connection is the first to clear staleness
            batch, self._pending = self._pending, []
            self.model.apply_all(batch)
        if self.model.status is not None:
            self.model.mark_stale(self._wall_clock())
        self.connected = False
        self.conn_error = why
        self._dirty = True

    def _queue(self, msg: Message) -> None:
        self._pending.append(msg)
        if len(self._pending) > MAX_PENDING:
            # Keep the newest status; drop the oldest events.
            keep = self._pending[len(self._pending) // 2 :]
            dropped = self._pending[: len(self._pending) // 2]
            status = next((m for m in reversed(dropped) if m.get("type") == "status"), None)
            self.dropped += sum(1 for m in dropped if m.get("type") != "status")
            self._pending = ([status] if status is not None else []) + keep

    def flush(self) -> None:
        """Apply the queued messages and redraw what changed (called ``REFRESH_HZ`` times a second)."""
        if self._pending:
            batch, self._pending = self._pending, []
            # Only the last status of a batch matters for the screen, but every one feeds the rates.
            self.model.apply_all(batch)
            self._dirty = True
        self._flush_answer()
        if not self._dirty:
            return
        self._dirty = False
        try:
            self._redraw()
        except NoMatches:  # the app is closing: its widgets are gone
            return

    def header_text(self) -> str:
        st = self.model.status
        if self.connected and st is not None and not self.model.stale:
            ready = "ready" if st.get("ready") else "linking"
            note = f"◆ Kvasir ● connected · {st['model']['name']} · rank {st['rank']}/{st['ring_size']} · {ready}"
            if self.dropped:
                note += f" · {self.dropped} events skipped"
            return note
        if self.connected:
            return "◆ Kvasir ● connected · waiting for status…"
        return f"◆ Kvasir ○ {self.conn_note}"

    def stale_text(self) -> str:
        """The line under the header while the screen is not live: since when, and why (in full: it wraps)."""
        m = self.model
        parts = []
        if m.stale_since is not None:
            parts.append(f"stale since {m.stale_since} (not live)")
        if not self.connected and self.conn_error:
            parts.append(self.conn_error)
        return " · ".join(parts)

    def _redraw(self) -> None:
        m = self.model
        conn = self.query_one("#conn", Static)
        conn.set_class(not self.connected, "down")
        # One line whatever the width: what matters comes first, the rest ends in an ellipsis.
        conn.update(Text(self.header_text(), no_wrap=True, overflow="ellipsis"))
        stale_note = self.stale_text()
        banner = self.query_one("#stale", Static)
        banner.display = bool(stale_note)
        banner.update(Text(stale_note))
        st = m.status
        if st is not None:
            window = m.window
            self.query_one(CoverageMap).set_map(m.coverage(), int(st["model"]["layers"]), window, f"rank {m.rank}")
            self.query_one(RingView).set_ring(m.ranks(), m.rank)
        self.query_one(CoverageMap).set_class(m.stale, "stale")
        self.query_one(RingView).set_class(m.stale, "stale")
        for name, view in m.links.items():
            self.query_one(f"#link-{name}", LinkRow).show(view, m.stale)
        self.query_one(NodePanel).show(m)
        pane = self.query_one("#tokens-pane", VerticalScroll)
        at_end = pane.scroll_y >= pane.max_scroll_y - 1
        self.query_one(TokenStream).show(list(m.requests.values()), m.stale)
        if at_end:
            pane.scroll_end(animate=False)

    # ------------------------------------------------------------------------------------------ chat

    @on(Input.Submitted, "#prompt")
    def _submit(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self._busy:
            self.notify("An answer is still streaming: Esc stops it.", severity="warning")
            return
        event.input.value = ""
        self._busy = True
        self.answer_done = False
        self.run_worker(self._generate(prompt), group="generate", exit_on_error=False)

    async def _generate(self, prompt: str) -> None:
        log = self.query_one(ChatLog)
        self._answers += 1
        self._answer, self._answer_shown = "", 0
        self._answer_md = Markdown("", classes="answer")
        self._answer_meta = Static("waiting for the ring…", classes="meta")
        await log.mount_all([Static(f"▶ {prompt}", classes="prompt", markup=False), self._answer_md, self._answer_meta])
        log.scroll_end(animate=False)
        request = self.sampling.request(prompt)
        final: str | None = None
        meta = ""
        tokens = 0
        try:
            async for msg in self.source.generate(request):
                kind = msg.get("type")
                if kind == "accepted":
                    self.generating = int(msg["request"])
                    self._answer_meta.update(f"request {self.generating:x} · prompt {msg.get('prompt_tokens')} tokens")
                    self._update_chat_status()
                    self.refresh_bindings()
                elif kind == "token":
                    tokens += 1
                    self._answer += str(msg.get("text", ""))
                elif kind == "end":
                    final = str(msg.get("text", self._answer))
                    reason = msg.get("reason")
                    meta = f"{msg.get('generated_tokens', tokens)} tokens · {reason}"
                    if msg.get("error"):
                        meta += f": {msg['error']}"
                elif kind == "error":
                    meta = f"error: {msg.get('error')}"
        except (SourceError, OSError) as exc:
            meta = f"error: {exc}"
        finally:
            self.generating = None
            self._busy = False
            self.refresh_bindings()
        if final is not None:
            self._answer = final
        self._flush_answer(final=True)
        if self._answer_md is not None:
            # Re-render the whole answer once: appending fragments may leave seams in the Markdown layout.
            await self._answer_md.update(sanitize(self._answer))
        self._answer_meta.update(meta)
        self._update_chat_status()
        log.scroll_end(animate=False)
        self.answer_done = True

    def _flush_answer(self, final: bool = False) -> None:
        md = self._answer_md
        if md is None or not md.is_attached or self._answer_shown >= len(self._answer):
            return
        delta = self._answer[self._answer_shown :]
        self._answer_shown = len(self._answer)
        md.append(sanitize(delta))
        if not final and isinstance(md.parent, ChatLog):
            md.parent.scroll_end(animate=False)

    @property
    def answer_text(self) -> str:
        """The raw text of the last (or current) answer."""
        return self._answer

    def _update_chat_status(self) -> None:
        if self.generating is not None:
            note = f"generating (request {self.generating:x}) · Esc to stop"
        else:
            note = f"{self.sampling.describe()} · F5 to change"
        self.query_one("#chat-status", Static).update(note)

    # ------------------------------------------------------------------------------------------ actions

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "stop":
            return self.generating is not None
        return True

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_tab(self, tab: str) -> None:
        """Show ``tab`` and focus what it is used with: the chat prompt, or the pane (↑ ↓ PgUp PgDn scroll it).

        The focus moves at once, not later: a focused widget whose pane gets hidden hands its focus to a sibling in
        that pane (Textual's blur on hide), and a pane holding the focus is made active again (F2 from the chat
        prompt used to flip straight back to the chat).
        """
        self.query_one(TabbedContent).active = tab
        self.screen.set_focus(self.query_one(TAB_FOCUS[tab]))

    def action_settings(self) -> None:
        def apply(result: Sampling | None) -> None:
            if result is not None:
                self.sampling = result
                self._update_chat_status()

        self.push_screen(SettingsScreen(self.sampling), apply)

    def action_stop(self) -> None:
        if self.generating is not None:
            self.run_worker(self._cancel(self.generating), group="cancel", exit_on_error=False)

    async def _cancel(self, request_id: int) -> None:
        try:
            await self.source.cancel(request_id)
        except (SourceError, OSError) as exc:
            self.notify(f"cancel failed: {exc}", severity="error")
            return
        self.notify(f"stopping request {request_id:x}")

    async def action_clear_chat(self) -> None:
        if self._busy:
            return
        await self.query_one(ChatLog).remove_children()
        self._answer_md = self._answer_meta = None

    def action_toggle_theme(self) -> None:
        self.theme = LIGHT if self.theme == DARK else DARK

    def action_reconnect(self) -> None:
        if not self.connected:
            self._wake.set()

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand(
            "Show the ring", "Coverage map, ring, links and this node (F2)", lambda: self.action_tab("ring")
        )
        yield SystemCommand(
            "Show the token stream", "Tokens as they pass this node (F3)", lambda: self.action_tab("tokens")
        )
        yield SystemCommand("Chat with the ring", "Prompt the ring (F4)", lambda: self.action_tab("chat"))
        yield SystemCommand(
            "Sampling settings", "temperature, top_k, top_p, max_tokens, seed (F5)", self.action_settings
        )
        if self.generating is not None:
            yield SystemCommand("Stop generating", "Cancel the answer being streamed (Esc)", self.action_stop)
        yield SystemCommand("Clear the chat", "Remove the conversation (Ctrl+L)", self.action_clear_chat)
        yield SystemCommand(
            "Toggle light/dark theme", "Switch between light and dark (Ctrl+T)", self.action_toggle_theme
        )
        yield SystemCommand(
            "Reconnect now",
            "Retry without waiting; without --socket, find the node again (Ctrl+R)",
            self.action_reconnect,
        )
        yield SystemCommand("Key help", "All key bindings (F1)", self.action_help)
