"""Modal screens: the key help, and the sampling settings form."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, Switch

from kvasir.core.sampling import SamplingParams

#: (keys, what they do): the help screen and docs/tui.md list these.
KEYS: tuple[tuple[str, str], ...] = (
    ("F1  ?", "this help (? outside the chat prompt)"),
    ("F2", "Ring tab: coverage map, ring, links, this node"),
    ("F3", "Tokens tab: tokens as they pass this node"),
    ("F4", "Chat tab: prompt the ring (focuses the prompt)"),
    ("↑ ↓ PgUp PgDn", "scroll the Ring or Tokens tab"),
    ("F5", "sampling settings (temperature, top_k, top_p, max_tokens, seed)"),
    ("Enter", "send the prompt (chat input)"),
    ("Esc", "stop the answer being generated (closes a dialog)"),
    ("Ctrl+L", "clear the chat"),
    ("Ctrl+T", "toggle light / dark theme"),
    ("Ctrl+R", "reconnect now (finding the socket again)"),
    ("Ctrl+P", "command palette (every action above, searchable)"),
    ("Tab  Shift+Tab", "move the focus"),
    ("← →", "switch tabs (tab bar focused)"),
    ("Ctrl+Q", "quit"),
)


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 76; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,f1,question_mark,q", "dismiss", "Close"),
    ]

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=False, padding=(0, 2, 0, 0), expand=False)
        table.add_column(style="bold")
        table.add_column()
        for keys, what in KEYS:
            table.add_row(keys, what)
        with VerticalScroll() as scroll:
            scroll.border_title = "Kvasir TUI · keys"
            scroll.border_subtitle = "Esc to close"
            yield Static(table)
            yield Static(
                "[dim]The TUI only watches the node; each chat prompt is one `generate` request.[/]",
                markup=True,
            )

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)


_DEFAULTS = SamplingParams.GREEDY  # the CLI's and the control socket's defaults too
#: The wire's MAX_NEW_TOKENS (a test checks they agree); spelled here so the TUI does not load the frame codec.
MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class Sampling:
    """The chat's sampling settings, sent with each ``generate`` op."""

    temperature: float = _DEFAULTS.temperature
    top_k: int = _DEFAULTS.top_k
    top_p: float = _DEFAULTS.top_p
    max_tokens: int = 128
    seed: int | None = None
    chat: bool = True

    def request(self, prompt: str) -> dict[str, Any]:
        req = asdict(self)
        if self.seed is None:
            del req["seed"]
        req["prompt"] = prompt
        return req

    def describe(self) -> str:
        seed = "-" if self.seed is None else str(self.seed)
        return (
            f"T={self.temperature:g} top_k={self.top_k} top_p={self.top_p:g} max={self.max_tokens} seed={seed}"
            f"{'' if self.chat else ' raw'}"
        )


def parse_sampling(values: dict[str, str], chat: bool) -> Sampling:
    """The form's fields as settings; ValueError names the field that is wrong.

    The ranges are the node's own (:class:`SamplingParams` validates), so the form cannot save a value the node
    would refuse.
    """

    def number(name: str, kind: type[float] | type[int]) -> Any:
        raw = values.get(name, "").strip()
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{name}: {raw!r} is not a{'n integer' if kind is int else ' number'}") from None

    seed_raw = values.get("seed", "").strip()
    fields = {
        "temperature": number("temperature", float),
        "top_k": number("top_k", int),
        "top_p": number("top_p", float),
        "seed": None if seed_raw in ("", "-") else number("seed", int),
    }
    params = _DEFAULTS.with_fields(fields)  # SamplingError (a ValueError) names the field
    max_tokens = number("max_tokens", int)
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise ValueError(f"max_tokens must be between 1 and {MAX_TOKENS}")
    return Sampling(params.temperature, params.top_k, params.top_p, max_tokens, params.seed, chat)


class SettingsScreen(ModalScreen[Sampling | None]):
    """A small form; Enter (or Save) applies, Esc cancels."""

    DEFAULT_CSS = """
    SettingsScreen { align: center middle; }
    SettingsScreen > Vertical {
        width: 60; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }
    SettingsScreen Grid { grid-size: 2; grid-columns: 16 1fr; grid-rows: 1; grid-gutter: 1 0; height: auto; }
    SettingsScreen Switch { height: 1; border: none; padding: 0; }
    SettingsScreen #error { color: $error; height: auto; }
    SettingsScreen Horizontal { height: auto; align-horizontal: right; }
    SettingsScreen Button { margin: 0 0 0 1; min-width: 10; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: Sampling) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        c = self.current
        fields = {
            "temperature": f"{c.temperature:g}",
            "top_k": str(c.top_k),
            "top_p": f"{c.top_p:g}",
            "max_tokens": str(c.max_tokens),
            "seed": "" if c.seed is None else str(c.seed),
        }
        with Vertical() as box:
            box.border_title = "Sampling settings"
            box.border_subtitle = "Enter save · Esc cancel"
            with Grid():
                for name, value in fields.items():
                    yield Label(name)
                    placeholder = "random" if name == "seed" else ""
                    yield Input(value, id=name, placeholder=placeholder, compact=True)
                yield Label("chat template")
                yield Switch(c.chat, id="chat")
            yield Static("", id="error")
            with Horizontal():
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def _values(self) -> dict[str, str]:
        return {i.id or "": i.value for i in self.query(Input)}

    def _save(self) -> None:
        try:
            sampling = parse_sampling(self._values(), self.query_one("#chat", Switch).value)
        except ValueError as exc:
            self.query_one("#error", Static).update(str(exc))
            return
        self.dismiss(sampling)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self._save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "save":
            self._save()
        else:
            self.dismiss(None)

    def action_cancel(self) -> None:
        self.dismiss(None)
