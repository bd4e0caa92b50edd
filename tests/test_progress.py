"""Progress bars for the slow file work: a stage cut reports its bytes (and writes the same file), and the bar shows
only when stderr is a terminal."""

from __future__ import annotations

import os
import pty
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.shard.slice import slice_model
from kvasir.util.progress import byte_bar


@pytest.mark.parametrize("window", [(0, 2), (4, 6)], ids=["first", "last"])
def test_stage_cut_reports_its_bytes(tiny_model: Callable[..., Path], tmp_path: Path, window: tuple[int, int]) -> None:
    model = tiny_model("llama", "f32")
    seen: list[tuple[int, int]] = []
    slice_model(model, *window, tmp_path / "reported.gguf", progress=lambda done, total: seen.append((done, total)))
    plain = slice_model(model, *window, tmp_path / "plain.gguf")
    assert (tmp_path / "reported.gguf").read_bytes() == plain.path.read_bytes()
    totals = {total for _, total in seen}
    dones = [done for done, _ in seen]
    assert len(totals) == 1 and dones == sorted(dones) and dones[-1] == totals.pop() > 0


def test_no_bar_unless_stderr_is_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    with byte_bar("cutting") as progress:
        assert progress is None
    primary, secondary = pty.openpty()
    try:
        with os.fdopen(secondary, "w", closefd=False) as tty:
            monkeypatch.setattr(sys, "stderr", tty)
            with byte_bar("cutting") as progress:
                assert progress is not None
                progress(5, 10)
            tty.flush()
        assert b"cutting" in os.read(primary, 65536)
    finally:
        os.close(primary)
        os.close(secondary)
