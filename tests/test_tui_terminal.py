"""``kvasir tui`` in a real terminal (tmux) against live rings: type a prompt, find the streamed answer on screen;
switch tabs from the chat prompt; stop the ring and see the screen marked stale; start another ring (new ports, so new
socket names) and see the bare ``kvasir tui`` follow it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.ringutil import ring_generate, running_ring

PROMPTS = ("Tell me about the ring", "Hello ring", "What is a layer?", "Say something")
#: The terminal: the size the review reproduced the tab and header bugs at.
COLS, ROWS = 80, 24


def _needle(text: str) -> str:
    """The longest run of letters and digits in the answer: it survives Markdown rendering and wrapping."""
    runs = re.findall(r"[A-Za-z0-9]+", text)
    return max(runs, key=len, default="")


class Terminal:
    """One tmux session on a private server, running ``cmd``."""

    def __init__(self, cmd: str, env: dict[str, str]) -> None:
        self.tmux = ["tmux", "-L", f"kvasir-tui-test-{os.getpid()}"]
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", "tui", "-x", str(COLS), "-y", str(ROWS), "-c", str(REPO), cmd],
            check=True,
            env=env,
        )

    def screen(self) -> str:
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True).stdout

    def wait_for(self, what: str, limit: float) -> str:
        deadline = time.monotonic() + limit
        while True:
            shown = self.screen()
            if what in shown:
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(f"{what!r} not on screen after {limit:.0f} s:\n{shown}")
            time.sleep(0.3)

    def keys(self, *keys: str, literal: bool = False) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", "tui", *(["-l"] if literal else []), *keys], check=True)

    def close(self) -> None:
        subprocess.run([*self.tmux, "kill-server"], capture_output=True)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tui_in_tmux(tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A runtime directory of its own (short: socket paths have 108 bytes), so the bare command finds this ring only.
    monkeypatch.setenv("XDG_RUNTIME_DIR", tempfile.mkdtemp(prefix="kvt-"))
    model = tiny_model("llama", "f32")
    with running_ring(model, [(0, 3), (3, 6)], cache_dir, default_control=True) as ring:
        sock = ring.sockets[0]
        for prompt in PROMPTS:
            answer = ring_generate(sock, prompt, max_tokens=12, temperature=0.0, chat=True)["text"]
            needle = _needle(answer)
            if len(needle) >= 3 and needle not in prompt:
                break
        assert len(needle) >= 3, f"no prompt gave an answer with a word to look for: {answer!r}"
        # As a user types it: no --socket.
        cmd = shlex.join([sys.executable, "-m", "kvasir", "tui", "--max-tokens", "12", "--temperature", "0"])
        term = Terminal(cmd, {**os.environ, "TERM": "xterm-256color"})
        try:
            term.wait_for("● connected", 60)
            term.keys("F4")
            term.wait_for("Ask the ring", 20)
            term.keys(prompt, literal=True)
            term.keys("Enter")
            term.wait_for("▶ " + prompt, 30)
            shown = term.wait_for(" tokens · ", 60)  # the answer's end line
            answer_lines = [line for line in shown.splitlines() if prompt not in line]
            assert any(needle in line for line in answer_lines), f"{needle!r} ({answer!r}) not on screen:\n{shown}"
            # Tab keys with the chat prompt focused (F2 and F3 used to do nothing there).
            term.keys("F2")
            term.wait_for("ring and links", 10)
            term.keys("F3")
            term.wait_for("entered at rank 0", 10)  # the token stream: the request that passed this node
            term.keys("F4")
            term.wait_for("Ask the ring", 10)
            term.keys("F2")
            term.wait_for("layers 0:3 of 6", 10)
            ring.stop()
            # Disconnected: the header says so within 80 columns, and the last status is marked stale.
            shown = term.wait_for("stale since", 30)
            header = next(line for line in shown.splitlines() if "Kvasir" in line)
            assert "disconnected · retrying in" in header and "…" not in header, shown
            assert shown.count("○ unknown") == 2 and "● direct" not in shown and "fr/s" in shown, shown
            assert " - fr/s" in shown and "when last seen" in shown, shown
        except BaseException:
            term.close()
            raise
    try:
        # `ring up` again: new ports, so new socket names. The bare TUI finds the new ring by itself.
        with running_ring(model, [(0, 2), (2, 6)], cache_dir, default_control=True) as ring:
            assert ring.sockets[0] != sock
            shown = term.wait_for("layers 0:2 of 6", 60)
            assert "● connected" in shown and "stale" not in shown and "unknown" not in shown, shown
    finally:
        term.close()
