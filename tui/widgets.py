"""The TUI's widgets. Each draws from plain data (``kvasir.tui.model``) handed to it; none reads the socket."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import Label, Sparkline, Static

from kvasir.ring.status import SupervisorStatus, speculation_line, supervisor_lines
from kvasir.tui.model import LinkView, NodeModel, RequestView, Segment, human_bytes, sanitize

#: Holder colours, in order of first appearance on the map (uncovered layers are drawn apart, in red hatching).
PALETTE = ("#4f8fea", "#3fb950", "#d29922", "#a371f7", "#39c5cf", "#db61a2", "#8ddb3a", "#f0883e")
UNCOVERED = "#f85149"


def holder_colours(segments: Sequence[Segment]) -> dict[str, str]:
    colours: dict[str, str] = {}
    for seg in segments:
        if seg.holder is not None and seg.holder not in colours:
            colours[seg.holder] = PALETTE[len(colours) % len(PALETTE)]
    return colours


def render_coverage(
    segments: Sequence[Segment],
    n_layers: int,
    width: int,
    mine: tuple[int, int] | None = None,
    mine_holder: str | None = None,
) -> Text:
    """The coverage strip: one cell per layer (or per group of layers when there are more layers than cells)."""
    text = Text(no_wrap=True, overflow="crop")
    if n_layers <= 0 or width <= 0:
        return text.append("no model", style="dim")
    colours = holder_colours(segments)
    cells = max(1, min(width, n_layers * 4 if n_layers * 4 <= width else width))

    def layer_at(cell: int) -> int:
        return min(n_layers - 1, cell * n_layers // cells)

    def segment_of(layer: int) -> Segment | None:
        for seg in segments:
            if seg.start <= layer < seg.end:
                return seg
        return None

    strip = Text(no_wrap=True)
    marks = Text(no_wrap=True)
    prev_seg: Segment | None = None
    for cell in range(cells):
        layer = layer_at(cell)
        seg = segment_of(layer)
        is_mine = mine is not None and mine[0] <= layer < mine[1]
        if seg is None or seg.holder is None:
            strip.append("░", style=f"bold {UNCOVERED}")
        else:
            edge = seg is not prev_seg and cell > 0
            strip.append("▌" if edge else " ", style=f"#000000 on {colours[seg.holder]}")
        marks.append("▔" if is_mine else " ", style="bold" if is_mine else "")
        prev_seg = seg
    text.append_text(strip)
    text.append("\n")
    text.append_text(marks)
    text.append("\n")
    # The scale: each segment's start under its first cell, the total at the end.
    scale = [" "] * (cells + 8)
    for seg in segments:
        first = next((c for c in range(cells) if layer_at(c) >= seg.start), None)
        if first is not None:
            for i, ch in enumerate(str(seg.start)):
                if first + i < len(scale):
                    scale[first + i] = ch
    end_label = str(n_layers)
    pos = max(0, cells - len(end_label))
    for i, ch in enumerate(end_label):
        scale[pos + i] = ch
    text.append("".join(scale).rstrip(), style="dim")
    text.append("\n")
    # Legend.
    legend = Text(no_wrap=False)
    for seg in segments:
        if seg.holder is None:
            legend.append("░ ", style=f"bold {UNCOVERED}")
            legend.append(f"{seg.start}:{seg.end} uncovered", style=f"bold {UNCOVERED}")
        else:
            legend.append("■ ", style=colours[seg.holder])
            label = f"{seg.holder} {seg.start}:{seg.end}"
            legend.append(label, style="bold" if seg.holder == mine_holder else "")
            if seg.holder == mine_holder:
                legend.append(" (this node)", style="bold")
        if seg.reward is not None:
            legend.append(f" ¤{seg.reward:g}", style="dim")
        legend.append("  ")
    text.append_text(legend)
    return text


class CoverageMap(Widget):
    """The model's layers as a strip, each window coloured by its holder; this node's window underlined.

    Fed a list of :class:`Segment` (``start, end, holder|None, reward|None``), so a market-provided map can be
    shown the same way as the ring's own manifest.
    """

    DEFAULT_CSS = """
    CoverageMap { height: auto; min-height: 4; padding: 0 1; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.segments: list[Segment] = []
        self.n_layers = 0
        self.mine: tuple[int, int] | None = None
        self.mine_holder: str | None = None

    def set_map(
        self, segments: Sequence[Segment], n_layers: int, mine: tuple[int, int] | None, mine_holder: str | None
    ) -> None:
        new = (list(segments), n_layers, mine, mine_holder)
        if new != (self.segments, self.n_layers, self.mine, self.mine_holder):
            self.segments, self.n_layers, self.mine, self.mine_holder = new
            self.refresh(layout=True)

    def render(self) -> Text:
        return render_coverage(self.segments, self.n_layers, self.size.width, self.mine, self.mine_holder)


def render_ring(ranks: Sequence[Mapping[str, Any]], me: int | None, width: int) -> Text:
    """The loop of ranks: ``╭▶ [r0 0:6] ──▶ [r1 6:12] ┄┄▶ … ─╮`` with this node marked."""
    text = Text(no_wrap=True, overflow="ellipsis")
    if not ranks:
        return text.append("no ring yet", style="dim")
    boxes: list[Text] = []
    for r in ranks:
        a, b = r["layers"]
        box = Text()
        label = f"[{r['rank']}: {a}:{b}{' ◆you' if r['rank'] == me else ''}]"
        box.append(label, style="bold reverse" if r["rank"] == me else "bold")
        boxes.append(box)
    line = Text(no_wrap=True)
    line.append("╭▶", style="dim")
    for k, box in enumerate(boxes):
        line.append_text(box)
        if k + 1 < len(boxes):
            relay = ranks[k + 1].get("link") == "relay"
            line.append(" ┄┄▶ " if relay else " ──▶ ", style="yellow" if relay else "")
    line.append(" ─╮", style="dim")
    if line.cell_len > width:
        line.truncate(max(4, width - 2), overflow="ellipsis")
        line.append("╮", style="dim")
    text.append_text(line)
    text.append("\n")
    inner = max(0, min(line.cell_len, width) - 2)
    note = f" {len(ranks)} nodes · ─▶ direct · ┄▶ relay "
    if len(note) + 4 > inner:
        note = f" {len(ranks)} nodes "
    text.append("╰──" + note + "─" * max(0, inner - len(note) - 2) + "╯", style="dim")
    return text


class RingView(Widget):
    """The nodes around the loop, this node marked; each arrow is a link (direct or relay)."""

    DEFAULT_CSS = """
    RingView { height: 2; padding: 0 1; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.ranks: list[Mapping[str, Any]] = []
        self.me: int | None = None

    def set_ring(self, ranks: Sequence[Mapping[str, Any]], me: int | None) -> None:
        if (list(ranks), me) != (self.ranks, self.me):
            self.ranks, self.me = list(ranks), me
            self.refresh()

    def render(self) -> Text:
        return render_ring(self.ranks, self.me, max(10, self.size.width))


def link_title(view: LinkView, stale: bool = False) -> Text:
    """``◀ from predecessor ● direct   connected to …``; while the status is stale the link's state is unknown, so
    it says that, with the last state seen after it (dim)."""
    arrow = "◀ from" if view.name == "predecessor" else "▶ to"
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(f"{arrow} {view.name:<11} ", style="bold")
    if stale:
        t.append("○ unknown", style="bold yellow")
        t.append(f"   last seen: {view.kind or '-'}, {view.state}", style="dim")
        return t
    dot_style = "green" if view.connected else "red"
    t.append("● ", style=dot_style)
    t.append(view.kind or "-", style="yellow" if view.kind == "relay" else "")
    t.append(" ")
    t.append(f"  {view.state}", style="dim")
    return t


class LinkRow(Widget):
    """One link: its state line, then frames/s, bytes/s and rtt with sparklines."""

    DEFAULT_CSS = """
    LinkRow { height: 2; padding: 0 1; }
    LinkRow > Horizontal { height: 1; }
    LinkRow .value { width: auto; min-width: 12; padding: 0 1 0 0; }
    LinkRow Sparkline { width: 1fr; height: 1; margin: 0 2 0 0; }
    """

    def __init__(self, name: str, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.link_name = name

    def compose(self) -> ComposeResult:
        yield Label("", classes="title")
        with Horizontal():
            yield Label("", classes="value frames")
            yield Sparkline([], summary_function=max, classes="frames")
            yield Label("", classes="value bytes")
            yield Sparkline([], summary_function=max, classes="bytes")
            yield Label("", classes="value rtt")
            yield Sparkline([], summary_function=max, classes="rtt")

    def show(self, view: LinkView, stale: bool = False) -> None:
        """``stale``: the rates and rtt are not shown (they are from before the connection was lost); the sparklines
        keep their history, dimmed."""
        self.set_class(stale, "stale")
        self.query_one(".title", Label).update(link_title(view, stale))
        self.query_one("Label.frames", Label).update("     - fr/s" if stale else f"{view.frames_s:6.1f} fr/s")
        self.query_one("Label.bytes", Label).update("- B/s" if stale else f"{human_bytes(view.bytes_s)}/s")
        rtt = "rtt -" if stale or view.rtt_ms is None else f"rtt {view.rtt_ms:.2f} ms"
        self.query_one("Label.rtt", Label).update(rtt)
        self.query_one("Sparkline.frames", Sparkline).data = list(view.frames_hist) or [0.0]
        self.query_one("Sparkline.bytes", Sparkline).data = list(view.bytes_hist) or [0.0]
        self.query_one("Sparkline.rtt", Sparkline).data = list(view.rtt_hist) or [0.0]


def render_node(model: NodeModel) -> Text:
    st = model.status
    t = Text()
    if st is None:
        return t.append("waiting for the node's status…", style="dim")
    a, b = st["window"]
    req = st.get("requests", {})
    contrib = st.get("contribution", {})
    rss = st.get("memory", {}).get("rss_bytes")
    since = model.stale_since
    # Stale: the counters are as last seen, the uptime is that of the last status, and there is no rate.
    up = f"up {st.get('uptime_s', 0):.0f} s" + ("" if since is None else " when last seen")
    rows = [
        ("window", f"layers {a}:{b} of {st['model']['layers']} · rank {st['rank']}/{st['ring_size']}"),
        ("backend", f"{st.get('backend', '?')} · {st.get('threads', '?')} threads · {up}"),
        ("memory", "-" if rss is None else f"{human_bytes(float(rss))} resident"),
        (
            "contribution",
            f"{contrib.get('tokens', 0)} tokens · {contrib.get('layer_tokens', 0)} layer-tokens"
            f" · {'-' if since is not None else f'{model.token_rate:.1f}'} tok/s",
        ),
        (
            "requests",
            f"{req.get('in_flight', 0)} in flight · {req.get('free_sequences', 0)} free seqs · "
            f"{req.get('requests', 0)} total · {req.get('errors', 0)} errors",
        ),
    ]
    if st.get("busy_s"):  # where the node's time went (docs/benchmarks.md § The ring on loopback)
        rows.append(
            (
                "time",
                f"compute {st['busy_s']:.1f} s · worker hand-off {st.get('handoff_s', 0.0):.1f} s"
                f" · link sends {st.get('send_s', 0.0):.1f} s",
            )
        )
    if req.get("verify_batches") or req.get("eager_steps"):  # the last rank of a ring that speculates
        rows.append(("speculation", speculation_line(req)))
    fo = st.get("failover") or {}
    if fo.get("replays"):  # shown once this node has replayed requests into a successor that came back
        window = fo.get("last_window") or ("?", "?")
        rows.append(
            (
                "failover",
                f"{fo['replays']} replays · {fo.get('requests', 0)} requests · last: layers {window[0]}:{window[1]}"
                f" back after {fo.get('last_stall_s')} s",
            )
        )
    sup = st.get("supervisor")
    if sup:  # under `kvasir ring up`: its supervisor's view (a window down, and when it is retried)
        rows += [("ring up", line) for line in supervisor_lines(SupervisorStatus.from_wire(sup))]  # checked by apply
    if since is not None:
        t.append(f"{'stale':<13}", style="bold yellow")
        t.append(f"since {since}: the last status seen\n", style="yellow")
    for k, (name, value) in enumerate(rows):
        t.append(f"{name:<13}", style="bold dim" if since else "bold")
        t.append(value, style="dim" if since else "")
        if k + 1 < len(rows):
            t.append("\n")
    return t


class NodePanel(Static):
    DEFAULT_CSS = """
    NodePanel { height: auto; padding: 0 1; }
    """

    def show(self, model: NodeModel) -> None:
        self.update(render_node(model))


def render_requests(requests: Sequence[RequestView], width: int, stale: bool = False) -> Text:
    """One block per request; ``stale``: a request last seen running may have ended since, so it says unknown."""
    t = Text()
    if not requests:
        return t.append("no tokens have passed this node yet", style="dim")
    for k, req in enumerate(requests):
        running = req.state == "running"
        unknown = req.state == "unknown" or (running and stale)
        if unknown:
            t.append(f"◌ {req.short_id} ", style="bold yellow")
        else:
            t.append(f"{'●' if running else '○'} {req.short_id} ", style="bold green" if running else "bold")
        extra = f" · state unknown ({'stale' if stale else 'missed while disconnected'})" if unknown else ""
        extra += f" · {req.tokens} tokens"
        if req.prompt_tokens is not None:
            extra += f" · prompt {req.prompt_tokens}"
        if req.entry_rank is not None:
            extra += f" · entered at rank {req.entry_rank}"
        if req.reason:
            extra += f" · {req.reason}"
        t.append(extra + "\n", style="dim")
        t.append(sanitize(req.text) or "…")
        if k + 1 < len(requests):
            t.append("\n")
    return t


class TokenStream(Static):
    """Tokens as they pass this node, one block per request (newest last)."""

    DEFAULT_CSS = """
    TokenStream { height: auto; padding: 0 1; }
    """

    def show(self, requests: Sequence[RequestView], stale: bool = False) -> None:
        self.set_class(stale, "stale")
        self.update(render_requests(requests, self.size.width, stale))
