"""The chaos benchmark's stall, replayed on a real `kvasir ring up --standby` (docs/benchmarks.md § Chaos).

Ten minutes of random SIGKILL/SIGSTOP stopped the ring for good at 360 s. The cause: a node SIGSTOPped while it was
loading after a restart has no control socket yet, so it never missed a probe, and the supervisor left it stopped
forever. Once both holders of a window were stopped that way, nothing could hold it again. This replays the shortest
such sequence on rank 1's window: its primary killed, its restart stopped while loading; then its standby (holding
the window since) killed, and its restart stopped while loading too.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvasir.local.launcher import free_ports, process_stopped
from tests.test_ring_service import RingUp, ring_up, wait_for

BODY = {"prompt": "The ring passes the hidden state on", "max_tokens": 8, "temperature": 0}


def _node(up: RingUp, rank: int, *, standby: bool) -> int | None:
    """The pid of ``ring up``'s child that runs rank ``rank``'s primary (or standby), None if there is none now."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if int(stat[stat.rindex(")") + 2 :].split()[1]) != up.proc.pid or "--rank" not in argv:
            continue
        if argv[argv.index("--rank") + 1] == str(rank) and ("--standby" in argv) == standby:
            return int(entry.name)
    return None


def _kill_then_stop_its_restart(up: RingUp, rank: int, *, standby: bool, stopped: list[int]) -> int:
    """SIGKILL the node, then SIGSTOP its restart the moment it exists (long before it loaded and answered); its pid
    goes into ``stopped`` (killed at the end whatever happens: ``ring up`` never kills a node it left stopped)."""
    old = _node(up, rank, standby=standby)
    assert old is not None
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (new := _node(up, rank, standby=standby)) in (None, old):
        assert time.monotonic() < deadline, "the supervisor did not restart it"
        time.sleep(0.005)
    assert new is not None
    stopped.append(new)
    os.kill(new, signal.SIGSTOP)
    wait_for(lambda: process_stopped(new), 10, "the restart to be stopped")
    return new


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _complete(url: str, timeout: float) -> tuple[int, str]:
    r = httpx.post(url + "/completions", json=BODY, timeout=timeout)
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


@pytest.mark.slow
def test_both_holders_of_a_window_stopped_while_loading_are_killed_and_the_ring_serves_again(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    (port,) = free_ports(1)
    model = tiny_model("llama", "f32")
    extra = ("--stages=3", "--standby", f"--api-port={port}", "--max-restart-delay=1")
    stopped: list[int] = []
    with contextlib.ExitStack() as cleanup:
        up = cleanup.enter_context(ring_up(model, tmp_path, cache_dir, *extra))
        cleanup.callback(_kill_all, stopped)
        match = re.search(r"OpenAI API: (http://\S+/v1)", up.stdout())
        assert match, up.stdout()
        url = match.group(1)
        status, expected = _complete(url, 60)
        assert status == 200, expected
        primary = _kill_then_stop_its_restart(up, 1, standby=False, stopped=stopped)
        wait_for(lambda: _complete(url, 60) == (200, expected), 60, "the standby to serve rank 1's window")
        standby = _kill_then_stop_its_restart(up, 1, standby=True, stopped=stopped)
        stopped_at = time.monotonic()
        # Both holders of rank 1's window stopped before they answered: the supervisor kills and restarts each
        # (6 s stopped), and the ring serves the fault-free answer again. Left alone, it never did.
        wait_for(lambda: _complete(url, 60) == (200, expected), 90, "the ring to serve again")
        print(f"served again {time.monotonic() - stopped_at:.1f} s after both holders were stopped")
        notes = up.stderr()
        assert "rank 1 was stopped for" in notes and "rank 1's standby was stopped for" in notes, notes
        assert not process_stopped(primary) and not process_stopped(standby)
