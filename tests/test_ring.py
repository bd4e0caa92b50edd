"""Real node processes on loopback: the ring gives exactly the whole model's greedy tokens."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.control.client import ControlClient
from kvasir.local.launcher import LocalRing
from tests.conftest import run_cli
from tests.ringutil import ring_generate, running_ring, whole_model, whole_model_tokens

PROMPTS = [
    "The ring passes the hidden state on",
    "Once upon a time",
    "Numbers: 1, 2, 3,",
    "A stage holds a window of layers",
    "Tokens travel back to the first rank",
    "Hello world",
    "The last rank samples",
    "Every node sees the stream",
]


@pytest.mark.parametrize(
    ("arch", "windows"), [("llama", [(0, 2), (2, 4), (4, 6)]), ("gemma3", [(0, 1), (1, 3), (3, 5), (5, 6)])]
)
def test_ring_matches_whole_model(
    arch: str, windows: list[tuple[int, int]], tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    model = tiny_model(arch, "q8_0")
    want = whole_model_tokens(model, PROMPTS[0], 16)
    with running_ring(model, windows, cache_dir) as ring:
        got = ring_generate(ring.sockets[0], PROMPTS[0], 16)
        assert got["tokens"] == want and got["reason"] in ("max_tokens", "eog")
        # A request may enter at any node: here the last one and a middle one.
        for k in (len(windows) - 1, 1):
            assert ring_generate(ring.sockets[k], PROMPTS[0], 16)["tokens"] == want


def test_gemma_three_process_ring(gemma_path: Path, cache_dir: Path) -> None:
    prompt = "The capital of France is"
    want = whole_model_tokens(gemma_path, prompt, 10)
    with running_ring(gemma_path, [(0, 6), (6, 12), (12, 18)], cache_dir) as ring:
        got = ring_generate(ring.sockets[1], prompt, 10)
        assert got["tokens"] == want
        assert got["text"].strip()
        # Where each node's time went (status): compute, the worker-thread hand-offs around it, link sends.
        for sock in ring.sockets:
            with ControlClient(sock) as c:
                st = c.status()
            assert 0 < st["handoff_s"] < st["busy_s"] and 0 < st["send_s"] < st["busy_s"], st


def test_eight_concurrent_requests_each_equal_solo(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("qwen3", "f32")
    solo = [whole_model_tokens(model, p, 10) for p in PROMPTS]
    results: list[dict[str, object] | None] = [None] * len(PROMPTS)
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir) as ring:

        def one(i: int) -> None:
            results[i] = ring_generate(ring.sockets[i % 3], PROMPTS[i], 10)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        for i, r in enumerate(results):
            assert r is not None and r["tokens"] == solo[i], f"request {i}"
        with ControlClient(ring.sockets[2]) as c:
            st = c.status()
        assert st["requests"]["in_flight"] == 0 and st["requests"]["free_sequences"] == 8


def test_cancel_one_of_several(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("llama", "f32")
    solo = [whole_model_tokens(model, p, 40) for p in PROMPTS[:3]]
    with running_ring(model, [(0, 3), (3, 6)], cache_dir) as ring:
        results: dict[int, dict[str, object]] = {}

        def one(i: int) -> None:
            results[i] = ring_generate(ring.sockets[0], PROMPTS[i], 40)

        threads = [threading.Thread(target=one, args=(i,)) for i in (0, 2)]
        for t in threads:
            t.start()
        with ControlClient(ring.sockets[1], timeout=60) as c:
            stream = c.generate(prompt=PROMPTS[1], max_tokens=40)
            accepted = next(stream)
            assert accepted["type"] == "accepted"
            for msg in stream:
                if msg["type"] == "token":
                    break
            with ControlClient(ring.sockets[1]) as c2:
                c2.send({"op": "cancel", "request": accepted["request"]})
                assert c2.read()["type"] == "cancelled"
            end = next(m for m in stream if m["type"] == "end")
            assert end["reason"] == "cancelled"
        for t in threads:
            t.join(timeout=120)
        assert results[0]["tokens"] == solo[0] and results[2]["tokens"] == solo[2]
        for sock in ring.sockets:
            with ControlClient(sock) as c:
                status = c.node_status()  # the node's JSON read back with its own schema (the TUI's parser)
                assert status.requests.in_flight == 0 and status.requests.free_sequences > 0 and status.ready


def test_bf16_boundaries_halve_the_bytes(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("llama", "f32")
    sent = {}
    for dtype in ("f32", "bf16"):
        with running_ring(model, [(0, 3), (3, 6)], cache_dir, extra_args=["--boundary-dtype", dtype]) as ring:
            got = ring_generate(ring.sockets[0], PROMPTS[0], 8)
            assert len(got["tokens"]) == 8 or got["reason"] == "eog"
            with ControlClient(ring.sockets[0]) as c:
                link = c.status()["links"]["successor"]
            sent[dtype] = link["bytes_out"] / max(1, link["frames_out"])
    assert sent["bf16"] < 0.75 * sent["f32"], sent


def test_stop_strings_and_status_cli(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("llama", "f32")
    full = ring_free = None
    with running_ring(model, [(0, 3), (3, 6)], cache_dir) as ring:
        full = ring_generate(ring.sockets[0], PROMPTS[0], 16)
        text = full["text"]
        assert isinstance(text, str) and len(text) > 4
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = ring_generate(ring.sockets[1], PROMPTS[0], 16, stop=[stop])
        assert cut["reason"] == "stop" and cut["text"] == text[: text.index(stop)]
        r = run_cli("status", "--socket", str(ring.sockets[1]), "--json")
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["rank"] == 1 and st["ready"] and st["window"] == [3, 6]
        assert st["links"]["successor"]["frames_out"] > 0 and st["contribution"]["tokens"] > 0
        ring_free = st["requests"]["free_sequences"]
        human = run_cli("status", "--socket", str(ring.sockets[1]))
        assert human.returncode == 0, human.stderr
        assert f"time: compute {st['busy_s']:.2f} s" in human.stdout and "worker hand-off" in human.stdout
    assert ring_free == 8


def test_sigterm_gives_in_flight_requests_an_error_reply(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("llama", "f32")
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir) as ring, ControlClient(ring.sockets[0], 60) as c:
        stream = c.generate(prompt=PROMPTS[0], max_tokens=400)
        assert next(stream)["type"] == "accepted"
        assert next(stream)["type"] == "token"
        ring.processes[1].send_signal(signal.SIGTERM)
        end = next(m for m in stream if m["type"] == "end")
        assert end["reason"] == "error" and "shutting down" in end["error"]
        assert ring.processes[1].wait(timeout=20) == 0


def test_long_prompt_is_prefilled_in_overlapping_chunks_and_stays_exact(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """A prompt of several prefill chunks: the ring's stages overlap on it, and the answer is still exact."""
    model = tiny_model("gemma3", "q8_0")
    prompt = " ".join(PROMPTS) * 4
    want = whole_model(model, prompt, 10)
    assert want.prompt_tokens > 2 * 64
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir) as ring:
        got = ring_generate(ring.sockets[2], prompt, 10)
        with ControlClient(ring.sockets[1]) as c:
            boundaries = c.status()["requests"]["boundaries"]
    assert got["tokens"] == want.tokens and got["prompt_tokens"] == want.prompt_tokens
    assert boundaries >= want.prompt_tokens // 64 + 9  # prefill arrived in chunks, then one per decoded token


def test_a_killed_node_restarts_and_the_ring_relinks(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("qwen2", "f32")
    want = whole_model_tokens(model, PROMPTS[3], 10)
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir) as ring:
        assert ring_generate(ring.sockets[0], PROMPTS[3], 10)["tokens"] == want
        ring.processes[1].kill()  # no goodbye: its neighbours see the links drop
        ring.processes[1].wait()
        ring.restart(1)
        ring.wait_ready(timeout=60)
        assert ring_generate(ring.sockets[2], PROMPTS[3], 10)["tokens"] == want


def test_a_request_another_node_refuses_ends_with_its_error_code(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """Rank 1 runs a smaller context than the entry node: it refuses the request and the client learns why."""
    model = tiny_model("llama", "f32")
    with running_ring(model, [(0, 3), (3, 6)], cache_dir) as ring:
        ring.processes[1].terminate()
        ring.processes[1].wait()
        cmd, _env = ring.commands[1]
        cmd[cmd.index("--ctx") + 1] = "64"
        ring.restart(1)
        ring.wait_ready(timeout=60)
        end = ring_generate(ring.sockets[0], PROMPTS[0], 100)
        assert end["reason"] == "error" and end["code"] == "context_full" and "context of 64" in end["error"]
        assert ring_generate(ring.sockets[0], PROMPTS[0], 10)["reason"] in ("max_tokens", "eog")  # still serving


def test_a_killed_node_that_stays_away_fails_in_flight_requests_and_frees_every_node(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """SIGKILL of the middle rank mid-answer, and nothing brings it back: the client gets an error once the failover
    wait is over (not the 120 s stall timer), the other nodes stay up with every sequence free, and once the rank is
    back the ring answers as before. (With the rank restarted in time, the answer goes on: tests/test_failover.py.)"""
    model = tiny_model("llama", "f32")
    with (
        running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir, extra_args=FAST_FAILOVER) as ring,
        ControlClient(ring.sockets[0], 60) as c,
    ):
        stream = c.generate(prompt=PROMPTS[0], max_tokens=400)
        assert next(stream)["type"] == "accepted"
        assert next(stream)["type"] == "token"
        killed_at = time.monotonic()
        ring.processes[1].kill()
        ring.processes[1].wait(timeout=10)
        end = next(m for m in stream if m["type"] == "end")
        waited = time.monotonic() - killed_at
        assert end["reason"] == "error" and end["code"] == "link_lost", end
        assert waited < 15, f"the error took {waited:.1f} s"
        for k in (0, 2):
            assert ring.processes[k].poll() is None
            with ControlClient(ring.sockets[k], 10) as s:
                assert s.status()["requests"]["free_sequences"] == 8
        ring.restart(1)
        ring.wait_ready(timeout=60)
        expected = whole_model_tokens(model, PROMPTS[0], 8)
        assert ring_generate(ring.sockets[0], PROMPTS[0], 8)["tokens"] == expected


#: Requests wait this long for a lost window to come back before they fail (the default is 15 s).
FAST_FAILOVER = ("--failover-wait", "3")


def _free_everywhere(ring: LocalRing, ranks: tuple[int, ...], limit: float = 20.0) -> None:
    deadline = time.monotonic() + limit
    while True:
        free = []
        for k in ranks:
            with ControlClient(ring.sockets[k], 10) as s:
                free.append(s.status()["requests"]["free_sequences"])
        if free == [8] * len(ranks):
            return
        assert time.monotonic() < deadline, f"sequences still held: {free}"
        time.sleep(0.2)


def test_a_hung_node_is_dropped_and_the_ring_relinks_when_it_wakes(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """SIGSTOP of the middle rank, with no supervisor: its neighbours notice within a few keepalives, the request in
    flight fails with an error after the failover wait instead of hanging, no other node stops; after SIGCONT the
    ring relinks and answers exactly."""
    model = tiny_model("llama", "f32")
    with (
        running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir, extra_args=FAST_FAILOVER) as ring,
        ControlClient(ring.sockets[0], 60) as c,
    ):
        stream = c.generate(prompt=PROMPTS[0], max_tokens=400)
        assert next(stream)["type"] == "accepted"
        assert next(stream)["type"] == "token"
        stopped_at = time.monotonic()
        ring.processes[1].send_signal(signal.SIGSTOP)
        try:
            end = next(m for m in stream if m["type"] == "end")
            waited = time.monotonic() - stopped_at
            assert end["reason"] == "error" and end["code"] == "link_lost", end
            assert waited < 15, f"the error took {waited:.1f} s"
            assert ring.processes[0].poll() is None and ring.processes[2].poll() is None
            _free_everywhere(ring, (0, 2))
        finally:
            ring.processes[1].send_signal(signal.SIGCONT)
        ring.wait_ready(timeout=60)
        expected = whole_model_tokens(model, PROMPTS[0], 8)
        assert ring_generate(ring.sockets[0], PROMPTS[0], 8)["tokens"] == expected


def test_an_entry_node_crash_frees_its_orphaned_requests_everywhere(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """Requests that entered at a node that then died are freed on every other node within seconds (they held
    every sequence for minutes before), so the ring serves new clients as soon as the node is back."""
    model = tiny_model("llama", "f32")
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir, extra_args=FAST_FAILOVER) as ring:
        clients = [ControlClient(ring.sockets[1], 60) for _ in range(3)]
        streams = [cl.generate(prompt=PROMPTS[0], max_tokens=400) for cl in clients]
        for s in streams:
            assert next(s)["type"] == "accepted"
        ring.processes[1].kill()
        ring.processes[1].wait(timeout=10)
        for cl in clients:
            cl.close()
        _free_everywhere(ring, (0, 2))
        ring.restart(1)
        ring.wait_ready(timeout=60)
        expected = whole_model_tokens(model, PROMPTS[0], 8)
        assert ring_generate(ring.sockets[2], PROMPTS[0], 8)["tokens"] == expected
