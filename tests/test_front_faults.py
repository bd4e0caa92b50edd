"""Nodes killed under `kvasir ring up --api-port`'s front: no request refused, a cut stream ends with an error event,
answers stay those of the fault-free ring; with `--standby`, a killed rank 0 costs seconds, not the API."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasir.local.launcher import free_ports
from tests.test_ring_service import RingUp, ring_up, wait_for

PROMPT = "The ring passes the hidden state on"
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}


def _complete(url: str, timeout: float = 60) -> tuple[int, str]:
    r = httpx.post(url + "/completions", json=BODY, timeout=timeout)
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def _stream_cut_by(url: str, kill: Callable[[], None]) -> list[dict[str, Any]]:
    """A long stream; ``kill`` once its first token is in; every event it then got."""
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 1.0, "seed": 7, "stream": True}  # 200, no EOS
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/completions", json=body, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 1:
                kill()
    return events


def _served_after_kill(url: str, expected: str, seconds: float) -> list[float]:
    """Requests back to back for ``seconds``: each must be served (200, the fault-free text); their latencies."""
    latencies: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        status, text = _complete(url)
        assert (status, text) == (200, expected), f"request {len(latencies)} after the kill"
        latencies.append(time.monotonic() - t0)
    return latencies


class _Client:
    """Another client sending requests back to back from a thread until stopped: every (status, text) it got."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[int, str]] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.answers.append(_complete(self.url))
            except httpx.HTTPError as exc:  # a refused or cut connection: what the front is there to prevent
                self.answers.append((0, repr(exc)))

    def stop(self) -> list[tuple[int, str]]:
        self.stopped.set()
        self.thread.join(90)
        return self.answers


def _front(up: RingUp) -> str:
    match = re.search(r"OpenAI API: (http://\S+/v1)", up.stdout())
    assert match, up.stdout()
    return match.group(1)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [0, 1])
def test_a_node_killed_under_the_front_refuses_no_request(
    victim: int, tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """The review's entry crash: with rank 0 killed, 130 of 190 requests were refused and streams cut mid-chunk."""
    (port,) = free_ports(1)
    model = tiny_model("llama", "f32")
    with ring_up(model, tmp_path, cache_dir, "--stages=3", f"--api-port={port}", "--max-restart-delay=1") as up:
        url = _front(up)
        status, expected = _complete(url)
        assert status == 200, expected
        reference = "".join(e["choices"][0]["text"] for e in _stream_cut_by(url, lambda: None))
        pid = up.pids()[f"rank {victim}"]
        killed_at: list[float] = []
        others: list[_Client] = []

        def kill() -> None:
            others.append(_Client(url))  # its requests go to rank 1 (fewest in flight), then wherever is live
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        # An idle front sends a request to rank 0 first: this stream entered there.
        events = _stream_cut_by(url, kill)
        texts = "".join(e["choices"][0]["text"] for e in events if "choices" in e)
        if victim == 0:  # its entry is gone: what it sent, then one error event, not a cut connection
            assert "error" in events[-1], events[-3:]
            assert events[-1]["error"]["code"] == "entry_lost" and "rank 0" in events[-1]["error"]["message"]
            assert reference.startswith(texts)
        else:  # a node behind the entry: the ring replays its requests into the restarted node
            assert texts == reference
        first = time.monotonic()
        latencies = _served_after_kill(url, expected, 8)
        print(f"rank {victim} killed: first request served {first + latencies[0] - killed_at[0]:.2f} s after the kill")
        assert len(latencies) >= 2
        answers = others[0].stop()
        assert len(answers) >= 3 and set(answers) == {(200, expected)}, answers  # none refused, none different
        wait_for(lambda: f"rank {victim} exited with code -9" in up.stderr(), 10, "the supervisor's note")


@pytest.mark.slow
def test_with_standbys_a_killed_rank_0_costs_seconds_and_its_dormant_restart_no_request(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """The review's standby case: the restarted rank 0 came back dormant with the API, every request waited 30 s."""
    (port,) = free_ports(1)
    model = tiny_model("llama", "f32")
    with ring_up(model, tmp_path, cache_dir, "--stages=3", "--standby", f"--api-port={port}") as up:
        url = _front(up)
        status, expected = _complete(url)
        assert status == 200, expected
        os.kill(up.pids()["rank 0"], signal.SIGKILL)
        killed = time.monotonic()
        status, text = _complete(url, timeout=10)
        assert (status, text) == (200, expected)
        print(f"first request after the kill served in {time.monotonic() - killed:.2f} s")
        wait_for(lambda: "rank 0 restarted" in up.stderr() or "rank 0 exited" in up.stderr(), 10, "the restart")
        # The restarted primary is dormant beside its linked standby: never chosen, so no request waits on it.
        latencies = _served_after_kill(url, expected, 10)
        assert max(latencies) < 10, latencies  # one sent to the dormant primary would wait link_wait, 30 s
        sock = re.search(r"^\s+rank 0: .* control (\S+)$", up.stdout(), re.M)  # the primary's, not the standby's
        assert sock, up.stdout()
        st = up.kvasir("status", "--json", "--socket", sock.group(1))
        assert st.returncode == 0, st.stderr
        status_of_primary = json.loads(st.stdout)
        assert status_of_primary["links"]["successor"]["state"].startswith("dormant"), st.stdout
        assert status_of_primary["requests"]["requests"] == 0  # not one request entered there
        up.proc.send_signal(signal.SIGTERM)  # the front's thread ends with the ring
        assert up.proc.wait(timeout=30) == 0, up.stderr()
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/models", timeout=5)
