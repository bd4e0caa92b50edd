"""Failover on real rings: node processes on loopback running llama.cpp stages, a supervisor that restarts the dead
and kills the hung (as ``kvasir ring up`` does), and SIGKILL/SIGSTOP mid-answer. The text must not change."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvasir.control.client import ControlClient
from kvasir.local.launcher import LocalRing
from tests.harness import faults
from tests.netns import carrier_nat, netns_unavailable, phone_ring, set_link
from tests.ringutil import running_ring
from tests.test_speculate import REPEATING

PROMPT = "The old lighthouse keeper climbed the stairs each night and"
WINDOWS = [(0, 6), (6, 12), (12, 18)]
MAX_TOKENS = 64
FAULT_AT = 16


def answer(sock: Path, fault: Any = None, prompt: str = PROMPT, **params: Any) -> tuple[list[int], dict[str, Any]]:
    res = faults.stream(sock, prompt=prompt, max_tokens=MAX_TOKENS, fault=fault, at=FAULT_AT, **params)
    return res.tokens, res.end


def failover_status(ring: LocalRing, rank: int) -> dict[str, Any]:
    with ControlClient(ring.sockets[rank], timeout=30) as c:
        status: dict[str, Any] = c.status()["failover"]
        return status


def wait_ready(ring: LocalRing, limit: float = 90.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        try:
            ring.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
            return
        except Exception:  # a rank the supervisor is restarting right now
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture(scope="module")
def gemma_ring(gemma_path: Path, cache_dir: Path) -> Iterator[LocalRing]:
    # 24 sequences for 8 clients: requests that entered at a killed node hold theirs until it is back and the replay
    # of their START tells the ring their client is gone.
    with running_ring(gemma_path, WINDOWS, cache_dir, seqs=24) as ring:
        yield ring


#: Speculative decoding on self-repeating text: the replay carries the verify batches (drafts included) and the steps
#: after rejected drafts, so the new process rebuilds the same cache (truncations included) and re-drafts the same.
SPECULATIVE = {"temperature": 0.0, "speculate": 4, "prompt": REPEATING}


@pytest.mark.parametrize(
    "params", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1234}, SPECULATIVE], ids=["greedy", "t0.8", "spec"]
)
@pytest.mark.parametrize(("victim", "entry"), [(1, 0), (2, 0), (0, 1)], ids=["middle", "last", "rank0"])
def test_sigkill_mid_answer_gives_the_fault_free_text(
    gemma_ring: LocalRing, victim: int, entry: int, params: dict[str, Any]
) -> None:
    """SIGKILL of a rank at token 16 of 64: the supervisor restarts it, its predecessor replays the request into the
    new process, and the client gets exactly the tokens of a run without the fault, with no error."""
    ring = gemma_ring
    wait_ready(ring)
    want, end = answer(ring.sockets[entry], **params)
    assert end["reason"] == "max_tokens" and len(want) == MAX_TOKENS
    predecessor = (victim - 1) % len(WINDOWS)
    before = failover_status(ring, predecessor)["replays"]
    with faults.Supervised(ring) as sup:

        def kill() -> None:
            ring.processes[victim].kill()

        started = time.monotonic()
        got, end = answer(ring.sockets[entry], fault=kill, **params)
        took = time.monotonic() - started
        wait_ready(ring)
    assert end["reason"] == "max_tokens" and end.get("error") is None, end
    assert got == want, f"diverged at {next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)}"
    assert any(f"rank {victim} exited" in n for n in sup.notes), sup.notes
    status = failover_status(ring, predecessor)
    assert status["replays"] > before and status["last_window"] == list(WINDOWS[victim]), status
    print(f"victim {victim} {params}: answer took {took:.2f} s, stall {status['last_stall_s']} s")


@pytest.mark.slow
def test_a_hung_node_is_killed_restarted_and_the_answer_is_unchanged(gemma_ring: LocalRing) -> None:
    """SIGSTOP of the middle rank mid-answer: its neighbours drop it after a few keepalives, the supervisor sees it
    stopped (its process state), kills and restarts it, and the request completes with the fault-free text."""
    ring = gemma_ring
    wait_ready(ring)
    want, _ = answer(ring.sockets[0])
    with faults.Supervised(ring) as sup:
        got, end = answer(ring.sockets[0], fault=lambda: ring.processes[1].send_signal(signal.SIGSTOP))
        wait_ready(ring)
    assert end["reason"] == "max_tokens" and end.get("error") is None, end
    assert got == want
    notes = "\n".join(sup.notes)
    assert "rank 1 was stopped for" in notes and "rank 1 exited" in notes, notes


@pytest.mark.slow  # reads the replays of the faults above, which are slow tests
def test_status_and_the_tui_show_the_failover(gemma_ring: LocalRing) -> None:
    """After the faults above, rank 0 (the middle rank's predecessor) shows its replays in ``kvasir status`` and in
    the TUI's node panel."""
    from kvasir.tui.model import NodeModel
    from kvasir.tui.widgets import render_node
    from tests.conftest import run_cli

    wait_ready(gemma_ring)
    out = run_cli("status", "--socket", str(gemma_ring.sockets[0]))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("failover:"))
    assert re.match(r"failover: [1-9]\d* replays", line) and "last: layers 6:12 back after" in line, line
    with ControlClient(gemma_ring.sockets[0], timeout=30) as c:
        model = NodeModel()
        model.apply({"type": "status", "status": c.status()})
    assert "failover" in render_node(model).plain and "last: layers 6:12" in render_node(model).plain


def test_the_relay_killed_mid_answer_is_restarted_and_the_answer_is_unchanged(
    gemma_path: Path, cache_dir: Path
) -> None:
    """Every link through one relay, which is SIGKILLed at token 16: the supervisor restarts it on its port, every
    edge re-pairs, each node replays into its successor, and the text is the fault-free one."""
    with running_ring(gemma_path, WINDOWS, cache_dir, relay=True) as ring:
        want, _ = answer(ring.sockets[0])
        assert ring.relay is not None
        with faults.Supervised(ring) as sup:
            got, end = answer(ring.sockets[0], fault=lambda: ring.relay.kill() if ring.relay else None)
            wait_ready(ring)
        assert end["reason"] == "max_tokens" and end.get("error") is None, end
        assert got == want
        assert any("the relay exited" in n for n in sup.notes), sup.notes


@pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))
@pytest.mark.slow
def test_a_link_cut_for_ten_seconds_gives_the_fault_free_text(
    gemma_path: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """The phone (rank 1, behind a carrier NAT, both edges through a relay) loses its network for 10 s at token 16:
    its neighbours drop the silent links after a few keepalives and hold the request; when the network is back the
    edges re-pair, the replays bring what was lost in transit, and the text is the fault-free one."""
    with carrier_nat() as nat, phone_ring(nat, gemma_path, WINDOWS, cache_dir, tmp_path) as ring:
        want, _ = answer(ring.sockets[0])
        restored = threading.Event()

        def cut() -> None:
            set_link(nat, up=False)

            def restore() -> None:
                time.sleep(10)
                set_link(nat, up=True)
                restored.set()

            threading.Thread(target=restore, daemon=True).start()

        started = time.monotonic()
        got, end = answer(ring.sockets[0], fault=cut)
        took = time.monotonic() - started
        assert restored.is_set() and took > 10  # the answer went on only after the network came back
        assert end["reason"] == "max_tokens" and end.get("error") is None, end
        assert got == want
        assert failover_status(ring, 0)["replays"] >= 1


@pytest.mark.slow
def test_repeated_faults_under_concurrent_clients(gemma_ring: LocalRing) -> None:
    """A random node SIGKILLed every 10 s for a minute under 8 concurrent clients (half greedy, half T=0.8 with a
    seed), each entering at a random node: no request fails except those whose entry node was killed, and every
    completed answer equals its fault-free answer."""
    wait_ready(gemma_ring)
    res = faults.soak(gemma_ring, seconds=60, every=10, clients=8, seed=5)
    print(res)
    assert res["errors"] == 0, (res["messages"], res["notes"])
    assert res["different"] == 0 and res["completed"] >= 8, res
    assert res["kills"] >= 5 and res["restarts"] >= res["kills"], res
