"""What the TUI knows about the node, built only from the control socket's messages (no Textual here).

Everything is derived from the messages' contents, never from the wall clock: rates come from the difference of
two status snapshots' counters over the difference of their ``uptime_s``, so a recorded stream replays to the same
screen every time. The one exception is handed in by the app: when the connection is lost, the time it was lost
(:meth:`NodeModel.mark_stale`); until the next status, what the model holds is the past, not the node's state.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvasir.core.errors import InputError
from kvasir.ring.events import NodeEvent, RequestEnded, RequestStarted, TokenPassed, event_from_wire
from kvasir.ring.status import LinkStatus, NodeStatus

#: How many samples the sparklines keep.
HISTORY = 60
#: Requests kept in the token stream view.
MAX_REQUESTS = 12
#: Characters of streamed text kept per request.
MAX_TEXT = 4000
#: Two snapshots closer than this (in node uptime) are not used for a rate: too noisy.
MIN_RATE_DT = 0.5


@dataclass(frozen=True)
class Segment:
    """A run of layers on the coverage map: ``[start, end)`` held by ``holder`` (None: nobody holds it)."""

    start: int
    end: int
    holder: str | None
    reward: float | None = None


def coverage_from_status(status: Mapping[str, Any] | NodeStatus) -> list[Segment]:
    """The ring's windows as segments covering ``0..layers``; layers no rank holds become ``holder=None``.

    With a market (``status.market``, a self-enrolled node) the map is the market's: each window's holder (None
    while nobody serves it) and the reward it pays; without one, the rank manifest's windows.
    """
    node = status if isinstance(status, NodeStatus) else NodeStatus.from_wire(status)
    if node.market:
        segments = fill_gaps(
            ((w.layers[0], w.layers[1], f"rank {w.rank}" if w.holder else None) for w in node.market), node.n_layers
        )
        rewards = {w.layers[0]: w.reward for w in node.market}
        return [Segment(g.start, g.end, g.holder, rewards.get(g.start)) for g in segments]
    return fill_gaps(((r.layers[0], r.layers[1], f"rank {r.rank}") for r in node.ranks), node.n_layers)


def fill_gaps(windows: Iterable[tuple[int, int, str | None]], n_layers: int) -> list[Segment]:
    """Segments sorted by start, with the uncovered stretches of ``0..n_layers`` made explicit."""
    out: list[Segment] = []
    at = 0
    for start, end, holder in sorted(windows, key=lambda w: (w[0], w[1])):
        if start > at:
            out.append(Segment(at, start, None))
        out.append(Segment(start, end, holder))
        at = max(at, end)
    if at < n_layers:
        out.append(Segment(at, n_layers, None))
    return out


def sanitize(text: str) -> str:
    """Control characters (a tiny model emits them) as visible control pictures; newlines and tabs kept."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        o = ord(ch)
        if ch in "\n\t" or ch.isprintable():
            out.append(ch)
        elif o < 0x20:
            out.append(chr(0x2400 + o))
        elif o == 0x7F:
            out.append("\u2421")
        else:
            out.append("\ufffd")
    return "".join(out)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


@dataclass
class LinkView:
    """One of this node's two links: its last state and the history of its rates."""

    name: str
    state: str = "unknown"
    kind: str | None = None
    peer: str | None = None
    rtt_ms: float | None = None
    frames_s: float = 0.0
    bytes_s: float = 0.0
    frames_hist: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    bytes_hist: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    rtt_hist: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))

    @property
    def connected(self) -> bool:
        return self.state.startswith("connected")


@dataclass
class RequestView:
    request: int
    text: str = ""
    tokens: int = 0
    #: "running", "ended", or "unknown" (last seen running before the connection was lost).
    state: str = "running"
    reason: str | None = None
    prompt_tokens: int | None = None
    entry_rank: int | None = None

    @property
    def short_id(self) -> str:
        return f"{self.request:016x}"[-6:]


def _counters(link: LinkStatus) -> tuple[int, int]:
    return link.frames_in + link.frames_out, link.bytes_in + link.bytes_out


@dataclass
class NodeModel:
    """The node's state as the TUI shows it; fed with the ``watch`` stream's messages in order."""

    #: The last status as sent (the widgets read it) and as parsed with the node's own schema.
    status: dict[str, Any] | None = None
    node: NodeStatus | None = None
    #: Status messages and events that did not parse (skipped).
    bad_status: int = 0
    bad_events: int = 0
    links: dict[str, LinkView] = field(
        default_factory=lambda: {"predecessor": LinkView("predecessor"), "successor": LinkView("successor")}
    )
    requests: OrderedDict[int, RequestView] = field(default_factory=OrderedDict)
    token_rate: float = 0.0
    token_hist: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    events: int = 0
    #: When the connection was lost ("HH:MM:SS", the app's clock); None while the status is live. The next status
    #: that parses clears it.
    stale_since: str | None = None
    _sample: tuple[float, dict[str, tuple[int, int]], int] | None = None

    def mark_stale(self, since: str) -> None:
        """The connection is lost: everything held is from before ``since`` (kept if already stale)."""
        if self.stale_since is None:
            self.stale_since = since

    @property
    def stale(self) -> bool:
        return self.stale_since is not None

    def apply(self, msg: Mapping[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "status" and isinstance(msg.get("status"), dict):
            self.apply_status(msg["status"])
        elif kind in ("token", "request"):
            try:
                event = event_from_wire(msg)
            except InputError:
                self.bad_events += 1
                return
            self.events += 1
            self.apply_event(event)

    def apply_event(self, event: NodeEvent) -> None:
        if isinstance(event, TokenPassed):
            view = self._view(event.request)
            view.tokens += 1
            if view.state == "unknown":  # still going after all
                view.state = "running"
            view.text = (view.text + event.text)[-MAX_TEXT:]
        elif isinstance(event, RequestStarted):
            view = self._view(event.request)
            view.state = "running"
            view.prompt_tokens = event.prompt_tokens
            view.entry_rank = event.entry_rank
        elif isinstance(event, RequestEnded):
            view = self._view(event.request)
            view.state = "ended"
            view.reason = event.reason

    def apply_all(self, msgs: Iterable[Mapping[str, Any]]) -> None:
        for m in msgs:
            self.apply(m)

    def apply_status(self, status: dict[str, Any]) -> None:
        try:
            node = NodeStatus.from_wire(status)
        except InputError:  # the schema's SchemaError, naming the field
            self.bad_status += 1
            return
        if self.node is not None and node.node_id != self.node.node_id:
            # Another node (a restarted ring): counters start over, and the old node's history is not this one's.
            self._sample = None
            self.token_rate = 0.0
            self.token_hist.clear()
            for view in self.links.values():
                view.frames_s = view.bytes_s = 0.0
                view.frames_hist.clear()
                view.bytes_hist.clear()
                view.rtt_hist.clear()
        if self.stale_since is not None:
            # Back after a lost connection: a request last seen running may have ended unseen.
            for req in self.requests.values():
                if req.state == "running":
                    req.state = "unknown"
        self.status, self.node = status, node
        self.stale_since = None
        uptime = node.uptime_s
        links = {"predecessor": node.predecessor, "successor": node.successor}
        for name, view in self.links.items():
            link = links[name]
            view.state = link.state
            view.kind = link.kind
            view.peer = link.peer
            view.rtt_ms = link.rtt_ms
        counters = {name: _counters(links[name]) for name in self.links}
        tokens = node.requests.tokens
        if self._sample is None or uptime < self._sample[0]:
            self._sample = (uptime, counters, tokens)
            return
        t0, c0, tok0 = self._sample
        dt = uptime - t0
        if dt < MIN_RATE_DT:
            return
        for name, view in self.links.items():
            f0, b0 = c0[name]
            f1, b1 = counters[name]
            # A counter that went down is a new link: count from zero.
            view.frames_s = (f1 - f0 if f1 >= f0 else f1) / dt
            view.bytes_s = (b1 - b0 if b1 >= b0 else b1) / dt
            view.frames_hist.append(view.frames_s)
            view.bytes_hist.append(view.bytes_s)
            view.rtt_hist.append(view.rtt_ms or 0.0)
        self.token_rate = (tokens - tok0 if tokens >= tok0 else tokens) / dt
        self.token_hist.append(self.token_rate)
        self._sample = (uptime, counters, tokens)

    def _view(self, request: int) -> RequestView:
        view = self.requests.get(request)
        if view is None:
            view = self.requests[request] = RequestView(request)
            while len(self.requests) > MAX_REQUESTS:
                self.requests.popitem(last=False)
        return view

    # ------------------------------------------------------------------------------------------ derived

    @property
    def rank(self) -> int | None:
        return None if self.node is None else self.node.rank

    @property
    def window(self) -> tuple[int, int] | None:
        return None if self.node is None else self.node.window

    def coverage(self) -> list[Segment]:
        return [] if self.node is None else coverage_from_status(self.node)

    def ranks(self) -> Sequence[Mapping[str, Any]]:
        return [] if self.status is None else list(self.status.get("ranks", ()))
