"""``kvasir tui`` in a real terminal (tmux) against a live ring: type a prompt, find the streamed answer on screen."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.ringutil import ring_generate, running_ring

PROMPTS = ("Tell me about the ring", "Hello ring", "What is a layer?", "Say something")


def _needle(text: str) -> str:
    """The longest run of letters and digits in the answer: it survives Markdown rendering and wrapping."""
    runs = re.findall(r"[A-Za-z0-9]+", text)
    return max(runs, key=len, default="")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_tui_in_tmux(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    with running_ring(tiny_model("llama", "f32"), [(0, 3), (3, 6)], cache_dir) as ring:
        sock = ring.sockets[0]
        for prompt in PROMPTS:
            answer = ring_generate(sock, prompt, max_tokens=12, temperature=0.0, chat=True)["text"]
            needle = _needle(answer)
            if len(needle) >= 3 and needle not in prompt:
                break
        assert len(needle) >= 3, f"no prompt gave an answer with a word to look for: {answer!r}"
        server = f"kvasir-tui-test-{os.getpid()}"
        tmux = ["tmux", "-L", server]
        cmd = shlex.join(
            [sys.executable, "-m", "kvasir", "tui", "--socket", str(sock), "--max-tokens", "12", "--temperature", "0"]
        )
        env = {**os.environ, "TERM": "xterm-256color"}
        subprocess.run(
            [*tmux, "new-session", "-d", "-s", "tui", "-x", "100", "-y", "30", "-c", str(REPO), cmd],
            check=True,
            env=env,
        )
        try:

            def screen() -> str:
                r = subprocess.run([*tmux, "capture-pane", "-p", "-t", "tui"], capture_output=True, text=True)
                return r.stdout

            def wait_for(what: str, limit: float) -> str:
                deadline = time.monotonic() + limit
                while True:
                    shown = screen()
                    if what in shown:
                        return shown
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{what!r} not on screen after {limit:.0f} s:\n{shown}")
                    time.sleep(0.3)

            wait_for("connected", 60)
            subprocess.run([*tmux, "send-keys", "-t", "tui", "F4"], check=True)
            wait_for("Ask the ring", 20)
            subprocess.run([*tmux, "send-keys", "-t", "tui", "-l", prompt], check=True)
            subprocess.run([*tmux, "send-keys", "-t", "tui", "Enter"], check=True)
            wait_for("▶ " + prompt, 30)
            shown = wait_for(" tokens · ", 60)  # the answer's end line
            answer_lines = [line for line in shown.splitlines() if prompt not in line]
            assert any(needle in line for line in answer_lines), f"{needle!r} ({answer!r}) not on screen:\n{shown}"
        finally:
            subprocess.run([*tmux, "kill-server"], capture_output=True)
