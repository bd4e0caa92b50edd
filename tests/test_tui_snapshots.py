"""SVG snapshots of the TUI from a recorded session (tests/data/tui_session.jsonl), dark theme.

Textual runs on asyncio; these are plain synchronous tests (``snap_compare`` drives the app itself), apart from
the project's trio tests. Update after an intended change with ``pytest tests/test_tui_snapshots.py
--snapshot-update`` and look at the SVGs in tests/__snapshots__/.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from textual.pilot import Pilot

from kvasir.tui.screenshots import app_for, replay_app, show

SnapCompare = Callable[..., bool]


def _before(screen: str) -> Callable[[Pilot[None]], Any]:
    async def run_before(pilot: Pilot[None]) -> None:
        await show(pilot, screen)

    return run_before


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_ring_screen(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    assert snap_compare(replay_app(), terminal_size=size, run_before=_before("ring"))


@pytest.mark.parametrize("screen", ["tokens", "chat", "help", "settings"])
def test_screen_80x24(snap_compare: SnapCompare, screen: str) -> None:
    assert snap_compare(replay_app(), terminal_size=(80, 24), run_before=_before(screen))


def test_chat_120x40(snap_compare: SnapCompare) -> None:
    assert snap_compare(replay_app(), terminal_size=(120, 40), run_before=_before("chat"))


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_stale_screen(snap_compare: SnapCompare, size: tuple[int, int]) -> None:
    """The node went away after the recording: header, the stale line under it, and the ring tab marked stale."""
    assert snap_compare(app_for("stale"), terminal_size=size, run_before=_before("stale"))
