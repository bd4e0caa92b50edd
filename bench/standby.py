"""Where a dead window comes back from: a restarted process (``ring up``'s supervisor) vs a loaded standby.

Runs a 3-rank Gemma 3 270M ring of node processes on loopback, streams a greedy answer at rank 0 and SIGKILLs the
holder of the middle window at token 16, ``--repeats`` times per way, and prints per way: the predecessor's stall
(``failover.last_stall_s``: its link lost until the replay was sent), the client's longest gap between two tokens,
and that gap's excess over the fault-free run's longest gap (measured in the same run). Every faulted answer must
equal the fault-free one. The baseline, a restart, is the ring without standbys under the Supervisor.

    python3 bench/standby.py [--repeats 3] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvasir.control.client import ControlClient
from kvasir.core.errors import RingError
from kvasir.demo import demo_model_path
from kvasir.local.launcher import LocalRing, Supervisor, start_ring
from kvasir.shard.cache import default_cache_dir

PROMPT = "The old lighthouse keeper climbed the stairs each night and"
WINDOWS = [(0, 6), (6, 12), (12, 18)]
FAULT_AT = 16


def answer(sock: Path, max_tokens: int, fault: Callable[[], None] | None = None) -> tuple[list[int], float]:
    """The tokens of a greedy answer and the longest gap between two of them (s)."""
    tokens: list[int] = []
    gap, last = 0.0, None
    with ControlClient(sock, timeout=120) as c:
        for msg in c.generate(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0):
            if msg.get("type") == "token" and msg["token"] >= 0:
                now = time.monotonic()
                gap = max(gap, now - last) if last is not None else 0.0
                last = now
                tokens.append(msg["token"])
                if len(tokens) == FAULT_AT and fault is not None:
                    fault()
            elif msg.get("type") == "end":
                if msg.get("error"):
                    raise RingError(f"the answer failed: {msg['error']}")
                return tokens, gap
    raise RingError("no end message")


def status(ring: LocalRing, i: int) -> dict[str, Any]:
    with ControlClient(ring.sockets[i], timeout=30) as c:
        result: dict[str, Any] = c.status()
        return result


def wait_until(cond: Callable[[], bool], limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except (RingError, OSError):
            pass
        time.sleep(0.3)
    raise RingError(f"not settled after {limit:.0f} s")


@contextmanager
def supervised(ring: LocalRing) -> Iterator[None]:
    stop = threading.Event()
    sup = Supervisor(ring, probe_interval_s=0.5, max_delay_s=0.0)  # the baseline is a plain restart: no backoff

    def loop() -> None:
        while not stop.is_set():
            sup.check()
            time.sleep(0.2)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


def run_way(model: Path, cache: Path, *, standby: bool, repeats: int, max_tokens: int) -> dict[str, list[float]]:
    ring = start_ring(model, WINDOWS, cache, threads=1, ctx=512, standby=standby)
    out: dict[str, list[float]] = {"stall": [], "gap": [], "excess": []}
    try:
        ring.wait_ready(timeout=240)
        want, _ = answer(ring.sockets[0], max_tokens)
        for _ in range(repeats):
            _, base_gap = answer(ring.sockets[0], max_tokens)
            if standby:
                assert ring.standby_start is not None
                holders = [1, ring.standby_start + 1]
                victim = next(i for i in holders if status(ring, i)["ready"])
                got, gap = answer(ring.sockets[0], max_tokens, fault=ring.processes[victim].kill)
                ring.restart(victim)  # back as a dormant holder: the next repeat kills the other one
                wait_until(functools.partial(_dormant, ring, victim))
            else:
                with supervised(ring):
                    got, gap = answer(ring.sockets[0], max_tokens, fault=ring.processes[1].kill)
                    wait_until(lambda: all(status(ring, k)["ready"] for k in range(len(WINDOWS))))
            if got != want:
                raise RingError("a faulted answer differs from the fault-free one")
            out["stall"].append(float(status(ring, 0)["failover"]["last_stall_s"]))
            out["gap"].append(gap)
            out["excess"].append(gap - base_gap)
    finally:
        ring.stop()
    return out


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    cache = default_cache_dir()
    model = demo_model_path(cache)
    load = os.getloadavg()
    rows = []
    for name, standby in (("restart (baseline)", False), ("standby", True)):
        r = run_way(model, cache, standby=standby, repeats=args.repeats, max_tokens=args.max_tokens)
        rows.append((name, r))
    table = Table(title=f"SIGKILL of the middle window at token {FAULT_AT}, Gemma 3 270M, 3 ranks, median (min–max) s")
    for col in ("window back from", "predecessor stall", "longest token gap", "gap excess over fault-free"):
        table.add_column(col)
    for name, r in rows:
        table.add_row(name, spread(r["stall"]), spread(r["gap"]), spread(r["excess"]))
    console = Console()
    console.print(table)
    end = os.getloadavg()
    console.print(
        f"{args.repeats} faults per way; load average {load[0]:.1f} at start, {end[0]:.1f} at end, "
        f"{os.cpu_count()} cpus"
    )


if __name__ == "__main__":
    main()


def _dormant(ring: LocalRing, rank: int) -> bool:
    return bool(status(ring, rank)["links"]["successor"]["state"].startswith("dormant"))
