"""The fleet emulator (tests/harness/fleet.py): shaping logic, and a real 2-node ring across namespaces."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvasir.control.client import ControlClient
from tests.harness.fleet import (
    PROFILES,
    FleetNode,
    LinkProfile,
    _Direction,
    fleet,
    leftovers,
    start_fleet_ring,
    unavailable,
)

PROMPT = "The ring passes hidden states from node to node:"


def direction(**kw: Any) -> _Direction:
    args: dict[str, Any] = {"dst": -1, "delay_s": 0.010, "jitter_s": 0.0, "loss": 0.0, "rate_bps": None}
    args.update(kw)
    return _Direction(rng=random.Random(1), **args)


def test_delay_jitter_keeps_order() -> None:
    d = direction(jitter_s=0.005)
    for i in range(200):
        d.admit(i * 0.001, bytes([i % 256]))
    dues = [due for due, _ in d.queue]
    assert dues == sorted(dues)  # jitter never reorders
    waits = [due - i * 0.001 for i, due in enumerate(dues)]
    assert min(waits) >= 0.005 - 1e-9
    assert 0.009 < sum(waits) / len(waits) < 0.013  # mean delay about 10 ms (plus the wait behind earlier packets)


def test_rate_serialises_back_to_back_packets() -> None:
    d = direction(delay_s=0.0, rate_bps=8e6)  # 1 byte per µs
    for _ in range(3):
        d.admit(0.0, b"x" * 1000)
    assert [round(due, 6) for due, _ in d.queue] == [0.001, 0.002, 0.003]


def test_loss_drops_about_its_share() -> None:
    d = direction(loss=0.1)
    for i in range(5000):
        d.admit(i * 1e-4, b"p")
    assert d.packets == 5000
    assert 400 < d.dropped < 600
    assert len(d.queue) == 5000 - d.dropped


def test_transfer_ms_counts_segments() -> None:
    lte = PROFILES["lte"]
    assert lte.transfer_ms(1448) == pytest.approx((1448 + 52) * 8 / 10e3)
    assert lte.transfer_ms(1449) == pytest.approx((1449 + 104) * 8 / 10e3)
    assert PROFILES["none"].transfer_ms(10**6) == 0.0


def _decode(sock: Path, tokens: int) -> tuple[list[int], str, float]:
    ids: list[int] = []
    text = ""
    t_first = t_last = 0.0
    with ControlClient(sock, timeout=120) as c:
        for msg in c.generate(prompt=PROMPT, max_tokens=tokens, temperature=0.0):
            if msg["type"] == "token" and msg["token"] >= 0:
                ids.append(msg["token"])
                text += msg.get("text", "")
                t_last = time.perf_counter()
                if len(ids) == 1:
                    t_first = t_last
    return ids, text, (t_last - t_first) * 1e3 / max(1, len(ids) - 1)


def _ring_run(model: Path, cache: Path, tmp: Path, link: LinkProfile, tokens: int) -> tuple[list[int], str, float]:
    nodes = [FleetNode("a", "cpu", PROFILES["none"]), FleetNode("b", "cpu", link, cpu=0.5, memory_bytes=1 << 30)]
    tmp.mkdir()
    with fleet(nodes, tmp) as f:
        ring = start_fleet_ring(f, model, [(0, 2), (2, 4)], cache, tmp)
        ring.wait_ready(timeout=120)
        cpu, mem = f.cgroups[1]
        assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "1000"  # half a core: 1 ms of every 2
        assert (cpu / "cpu.cfs_period_us").read_text().strip() == "2000"
        assert int((mem / "memory.limit_in_bytes").read_text()) == 1 << 30
        for g in (cpu, mem):
            assert str(ring.processes[1].pid) in (g / "cgroup.procs").read_text().split()
        _decode(ring.sockets[0], 2)  # warm up
        out = _decode(ring.sockets[0], tokens)
        tag = f.tag
    assert leftovers(tag) == []
    return out


@pytest.mark.slow
def test_shaped_link_delays_every_hop_and_keeps_tokens(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    why = unavailable()
    if why:
        pytest.skip(f"fleet emulation unavailable: {why}")
    model = tiny_model("llama", n_layer=4)
    delay = 15.0
    plain_ids, plain_text, plain_ms = _ring_run(model, cache_dir, tmp_path / "plain", PROFILES["none"], 16)
    ids, text, ms = _ring_run(model, cache_dir, tmp_path / "shaped", LinkProfile("test", delay), 16)
    # Each token crosses two hops (0 -> 1, 1 -> 0); each crosses node b's access link once.
    assert ms >= 2 * delay, f"{ms:.1f} ms/token through a {delay} ms link"
    assert plain_ms < delay, f"the unshaped fleet already takes {plain_ms:.1f} ms/token"
    assert len(ids) == 16
    assert (ids, text) == (plain_ids, plain_text)


def _generate(sock: Path, prompt: str, tokens: int, speculate: int) -> list[int]:
    with ControlClient(sock, timeout=120) as c:
        msgs = c.generate(prompt=prompt, max_tokens=tokens, temperature=0.0, speculate=speculate)
        return [m["token"] for m in msgs if m["type"] == "token" and m["token"] >= 0]


@pytest.mark.slow
def test_a_speculative_ring_over_a_slow_link_drafts_eagerly(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """Real nodes, a real 10 ms access link: a step takes over 20 ms to come back round the ring, a tiny model's
    row well under a millisecond, so the last rank's auto policy (the default) drafts eagerly, by its own timing.
    The answer is the plain ring's."""
    why = unavailable()
    if why:
        pytest.skip(f"fleet emulation unavailable: {why}")
    model = tiny_model("llama", n_layer=4)
    prompt = "one two three four one two three four one two three four one two three"
    nodes = [FleetNode("a", "cpu", PROFILES["none"]), FleetNode("b", "cpu", LinkProfile("test", 10.0))]
    with fleet(nodes, tmp_path) as f:
        ring = start_fleet_ring(f, model, [(0, 2), (2, 4)], cache_dir, tmp_path)
        ring.wait_ready(timeout=120)
        plain = _generate(ring.sockets[0], prompt, 24, 0)
        spec = _generate(ring.sockets[0], prompt, 24, 4)
        with ControlClient(ring.sockets[1], timeout=30) as c:
            counters = c.status()["requests"]
        tag = f.tag
    assert leftovers(tag) == []
    assert len(plain) == 24 and spec == plain
    assert counters["eager_steps"] > 0, counters
