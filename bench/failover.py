"""Failover on a real ring: how long a client's answer stalls when a node dies mid-answer, and whether it changes.

Part 1 (stall): a 3-process ring of Gemma 3 270M on loopback under ``kvasir ring up``'s Supervisor. For each
context length (prompt tokens) and layer split, one fault-free request, then the same request with the middle rank
SIGKILLed after its 4th token. Printed per row: the fault-free ms/token and time to first token (TTFT: the whole
ring's prefill, an upper bound of the replay's own compute), the client's stall (the longest gap between two tokens
minus the fault-free step), the predecessor's ``last_stall_s`` (link lost → replay sent), the time the supervisor's
restart took to be ready, and whether the text is identical.

Part 2 (soak, ``--soak S``): N concurrent clients (each entering at a random node, own prompt, greedy or T=0.8 with
a seed) for S seconds while one random node is SIGKILLed every ``--every`` seconds; every completed answer is
compared with its fault-free answer; requests that entered at a killed node are counted as lost (their client's
connection died with it, by design).

    python3 bench/failover.py [--contexts 64,512,2048] [--soak 120 --every 10 --clients 8]
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvasir.control.client import ControlClient
from kvasir.demo import demo_model_path
from kvasir.errors import RingError
from kvasir.local.launcher import LocalRing, Supervisor, start_ring
from kvasir.shard.cache import default_cache_dir

SPLITS = {"even 6/6/6": [(0, 6), (6, 12), (12, 18)], "big middle 2/14/2": [(0, 2), (2, 16), (16, 18)]}


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [2, *(rng.randrange(1000, 20000) for _ in range(n - 1))]


def run(sock: Path, tokens: list[int], max_tokens: int, fault: Any = None, at: int = 4, **params: Any) -> dict[str, Any]:
    """One request: its tokens, the times they arrived, its end."""
    got: list[int] = []
    times: list[float] = []
    started = time.perf_counter()
    with ControlClient(sock, timeout=600) as c:
        for msg in c.generate(tokens=tokens, max_tokens=max_tokens, **params):
            if msg.get("type") == "token" and msg["token"] >= 0:
                got.append(msg["token"])
                times.append(time.perf_counter())
                if fault is not None and len(got) == at:
                    fault()
            elif msg.get("type") == "end":
                return {"tokens": got, "times": times, "started": started, "end": msg}
    raise RingError("no end message")


class Supervised:
    """Supervisor.check in a thread, as ``kvasir ring up`` runs it."""

    def __init__(self, ring: LocalRing) -> None:
        self.sup = Supervisor(ring, probe_interval_s=0.5, max_restarts=100)
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.notes.extend(self.sup.check())
            time.sleep(0.1)

    def __enter__(self) -> Supervised:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def ready_after(ring: LocalRing, rank: int, since: float, limit: float = 120) -> float:
    """Seconds from ``since`` until rank ``rank`` answers ready."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with ControlClient(ring.sockets[rank], timeout=2) as c:
                if c.status()["ready"]:
                    return time.perf_counter() - since
        except (RingError, OSError):
            pass
        time.sleep(0.05)
    raise RingError(f"rank {rank} not ready after {limit} s")


def stall_rows(model: Path, contexts: list[int], threads: int) -> list[list[str]]:
    rows = []
    for split_name, windows in SPLITS.items():
        ring = start_ring(model, windows, default_cache_dir(), threads=threads, ctx=max(contexts) + 128)
        try:
            ring.wait_ready(180)
            with Supervised(ring):
                for n in contexts:
                    ids = prompt_ids(n, n)
                    base = run(ring.sockets[0], ids, 12)
                    steps = [b - a for a, b in zip(base["times"], base["times"][1:], strict=False)]
                    step = sorted(steps)[len(steps) // 2]
                    ttft = base["times"][0] - base["started"]
                    killed: dict[str, float] = {}

                    def kill(ring: LocalRing = ring, killed: dict[str, float] = killed) -> None:
                        killed["at"] = time.perf_counter()
                        ring.processes[1].kill()

                    faulted = run(ring.sockets[0], ids, 12, fault=kill)
                    restart = ready_after(ring, 1, killed["at"])
                    gaps = [b - a for a, b in zip(faulted["times"], faulted["times"][1:], strict=False)]
                    with ControlClient(ring.sockets[0], timeout=10) as c:
                        fo = c.status()["failover"]
                    same = faulted["tokens"] == base["tokens"] and faulted["end"].get("error") is None
                    rows.append(
                        [
                            split_name,
                            str(n),
                            f"{step * 1000:.1f}",
                            f"{ttft:.2f}",
                            f"{max(gaps) - step:.2f}",
                            f"{fo['last_stall_s']}",
                            f"{restart:.2f}",
                            "yes" if same else "NO",
                        ]
                    )
                    print(rows[-1], flush=True)
        finally:
            ring.stop()
    return rows


def soak(model: Path, seconds: float, every: float, clients: int, threads: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    windows = SPLITS["even 6/6/6"]
    ring = start_ring(model, windows, default_cache_dir(), threads=threads, ctx=512)
    results: dict[str, Any] = {
        "completed": 0,
        "identical": 0,
        "different": 0,
        "lost_at_killed_entry": 0,
        "entry_down_retried": 0,
        "errors": 0,
        "kills": 0,
    }
    messages: list[str] = []
    try:
        ring.wait_ready(180)
        jobs = []
        for k in range(clients):
            params = {"temperature": 0.0} if k % 2 == 0 else {"temperature": 0.8, "seed": 100 + k}
            ids = prompt_ids(24 + 8 * k, 1000 + k)
            want = run(ring.sockets[0], ids, 48, **params)["tokens"]
            jobs.append((ids, params, want))
        stop = threading.Event()
        lock = threading.Lock()
        killed_ranks: list[tuple[float, int]] = []

        def client(k: int) -> None:
            ids, params, want = jobs[k]
            crng = random.Random(seed * 100 + k)
            while not stop.is_set():
                entry = crng.randrange(len(windows))
                t0 = time.monotonic()
                try:
                    with ControlClient(ring.sockets[entry], timeout=5):
                        pass
                except (RingError, OSError):  # that node is down right now (being restarted): pick another
                    with lock:
                        results["entry_down_retried"] += 1
                    time.sleep(0.5)
                    continue
                try:
                    res = run(ring.sockets[entry], ids, 48, **params)
                except (RingError, OSError, ValueError) as exc:
                    with lock:
                        # Its entry node was killed while it streamed: lost by design. Anything else is an error.
                        if any(r == entry and at >= t0 for at, r in killed_ranks):
                            results["lost_at_killed_entry"] += 1
                        else:
                            results["errors"] += 1
                            messages.append(f"entry {entry}: {exc!r}")
                    time.sleep(1.0)
                    continue
                with lock:
                    if res["end"].get("error") is not None:
                        results["errors"] += 1
                        messages.append(f"entry {entry}: {res['end'].get('code')}: {res['end'].get('error')}")
                    else:
                        results["completed"] += 1
                        results["identical" if res["tokens"] == want else "different"] += 1

        with Supervised(ring) as sup:
            threads_ = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
            for t in threads_:
                t.start()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(every)
                victim = rng.randrange(len(windows))
                with lock:
                    killed_ranks.append((time.monotonic(), victim))
                ring.processes[victim].kill()
                results["kills"] += 1
            stop.set()
            for t in threads_:
                t.join(timeout=300)
            results["restarts"] = sum("exited" in n for n in sup.notes)
    finally:
        ring.stop()
    for m in messages:
        print("error:", m)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--contexts", default="64,512,2048")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--soak", type=float, default=0.0, help="seconds of repeated faults (0: skip)")
    ap.add_argument("--every", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--skip-stall", action="store_true")
    args = ap.parse_args()
    model = args.model or demo_model_path(default_cache_dir())
    console = Console()
    if not args.skip_stall:
        rows = stall_rows(model, [int(x) for x in args.contexts.split(",")], args.threads)
        t = Table(
            "split",
            "context",
            "ms/token",
            "TTFT s",
            "client stall s",
            "pred. stall s",
            "restart s",
            "identical",
            title="SIGKILL of the middle rank after token 4 (Gemma 3 270M, 3 processes, supervised)",
        )
        for r in rows:
            t.add_row(*r)
        console.print(t)
    if args.soak:
        res = soak(model, args.soak, args.every, args.clients, args.threads, args.seed)
        t = Table(*res.keys(), title=f"{args.soak:.0f} s, a random node killed every {args.every:.0f} s")
        t.add_row(*(str(v) for v in res.values()))
        console.print(t)


if __name__ == "__main__":
    main()
