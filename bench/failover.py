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
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)  # run as a script: tests.harness comes from the checkout

from kvasir.control.client import ControlClient  # noqa: E402
from kvasir.core.errors import RingError  # noqa: E402
from kvasir.demo import demo_model_path  # noqa: E402
from kvasir.local.launcher import LocalRing, start_ring  # noqa: E402
from kvasir.shard.cache import default_cache_dir  # noqa: E402
from tests.harness.faults import Supervised, prompt_ids, soak, stream  # noqa: E402

SPLITS = {"even 6/6/6": [(0, 6), (6, 12), (12, 18)], "big middle 2/14/2": [(0, 2), (2, 16), (16, 18)]}


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
                    base = stream(ring.sockets[0], tokens=ids, max_tokens=12)
                    steps = [b - a for a, b in zip(base.times, base.times[1:], strict=False)]
                    step = sorted(steps)[len(steps) // 2]
                    ttft = base.times[0] - base.started
                    killed: dict[str, float] = {}

                    def kill(ring: LocalRing = ring, killed: dict[str, float] = killed) -> None:
                        killed["at"] = time.perf_counter()
                        ring.processes[1].kill()

                    faulted = stream(ring.sockets[0], tokens=ids, max_tokens=12, fault=kill, at=4)
                    restart = ready_after(ring, 1, killed["at"])
                    gaps = [b - a for a, b in zip(faulted.times, faulted.times[1:], strict=False)]
                    with ControlClient(ring.sockets[0], timeout=10) as c:
                        fo = c.status()["failover"]
                    same = faulted.tokens == base.tokens and faulted.ok
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


def soak_run(model: Path, seconds: float, every: float, clients: int, threads: int, seed: int) -> dict[str, Any]:
    # Sequences for the orphans of a killed entry too (they hold theirs until the ring frees them), as the test has.
    ring = start_ring(model, SPLITS["even 6/6/6"], default_cache_dir(), threads=threads, ctx=512, seqs=3 * clients)
    try:
        ring.wait_ready(180)
        res = soak(ring, seconds=seconds, every=every, clients=clients, seed=seed)
    finally:
        ring.stop()
    for m in res.pop("messages"):
        print("error:", m)
    for n in res.pop("notes"):
        print("supervisor:", n)
    return res


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
        res = soak_run(model, args.soak, args.every, args.clients, args.threads, args.seed)
        t = Table(*res.keys(), title=f"{args.soak:.0f} s, a random node killed every {args.every:.0f} s")
        t.add_row(*(str(v) for v in res.values()))
        console.print(t)


if __name__ == "__main__":
    main()
