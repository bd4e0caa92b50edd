"""SVG screenshots of each screen from a recorded session (docs/tui-*.svg; the snapshot tests use ``show``).

``python -m kvasir.tui.screenshots [SESSION.jsonl] [OUT_DIR]`` (defaults: tests/data/tui_session.jsonl, docs/), 100×30.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from textual.pilot import Pilot
from textual.widgets import Input

from kvasir.tui.app import KvasirTUI
from kvasir.tui.source import ReplaySource

REPO = Path(__file__).resolve().parent.parent
SESSION = REPO / "tests" / "data" / "tui_session.jsonl"
#: Screen name: what ``show`` does to reach it. "stale": the ring tab after the node has gone away.
SCREENS = ("ring", "tokens", "chat", "help", "settings", "stale")


def replay_app(session: Path = SESSION) -> KvasirTUI:
    return KvasirTUI(ReplaySource.from_file(session), pace=False)


def app_for(screen: str, session: Path = SESSION) -> KvasirTUI:
    return stale_app(session) if screen == "stale" else replay_app(session)


def stale_app(session: Path = SESSION) -> KvasirTUI:
    """The recorded session, after which the node goes away: the stale screen, with a fixed time and a retry far
    enough off that the picture stays still."""
    return KvasirTUI(
        ReplaySource.from_file(session, hang_up=True), pace=False, wall_clock=lambda: "12:34:56", backoff=(600, 600)
    )


async def show(pilot: Pilot[None], screen: str) -> None:
    """Wait for the recorded watch stream to be replayed and drawn, then go to ``screen``."""
    app = pilot.app
    assert isinstance(app, KvasirTUI) and isinstance(app.source, ReplaySource)
    await app.source.replayed.wait()
    for _ in range(500):  # a node that goes away after the recording: until the app has noticed (up to 10 s)
        if not app.source.hang_up or (not app.connected and app.model.stale):
            break
        await pilot.pause(0.02)
    app.flush()
    await pilot.pause()
    if screen == "tokens":
        await pilot.press("f3")
    elif screen == "chat":
        await pilot.press("f4")
        await pilot.pause()
        for key in "How does the ring work?":
            await pilot.press("space" if key == " " else "question_mark" if key == "?" else key)
        await pilot.press("enter")
        for _ in range(1500):  # up to 30 s: a loaded machine replays slowly, and the picture needs the whole answer
            await pilot.pause(0.02)
            if app.answer_done:
                break
    elif screen == "help":
        await pilot.press("f1")
    elif screen == "settings":
        await pilot.press("f5")
    for field in app.screen.query(Input):  # a still picture: the cursor shown, whatever the blink's phase
        field.cursor_blink = False
    app.flush()
    await pilot.pause()
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


async def screenshot(screen: str, size: tuple[int, int], session: Path = SESSION) -> str:
    app = app_for(screen, session)
    async with app.run_test(size=size) as pilot:
        await show(pilot, screen)
        return app.export_screenshot(title=f"kvasir tui · {screen}")


def main(argv: list[str]) -> int:
    session = Path(argv[0]) if argv else SESSION
    out = Path(argv[1]) if len(argv) > 1 else REPO / "docs"
    for screen in SCREENS:
        svg = asyncio.run(screenshot(screen, (100, 30), session))
        path = out / f"tui-{screen}.svg"
        path.write_text(svg)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
