"""Even vs balanced stages on a ``ring up``-style ring: tokens/s under concurrent requests, per-rank busy fraction,
and one request's ms/token.

Two rings of ``--stages`` node processes run side by side on this machine, started as ``kvasir ring up`` starts them
(:func:`start_ring`, :func:`default_threads` threads per node, the API on rank 0): one with the layers split evenly
(the baseline, ``--split even``), one balanced by the measured stage costs (``--split balanced``, the default;
calibrated on first use and cached). The rounds alternate between the rings so that a noisy neighbour on a shared
machine slows both alike. Each round sends N completions at once (greedy, distinct prompts, ``--tokens`` each) and
counts the completion tokens over the wall time; each rank's busy fraction is its node's ``busy_s`` (time in stage
compute) over the round's wall time, and the busiest rank's ms/token its ``busy_s`` per token generated: what bounds
throughput where every node has cores of its own (on a machine with fewer cores than nodes the total does).
Single-request ms/token is the decode time between first and last token through the control socket. The two rings'
answers are compared: the windows change, the tokens must not.

    python3 bench/balance.py [--model PATH] [--stages 3] [--tokens 32] [--repeats 3] [--levels 4,8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from kvasir.control.client import ControlClient
from kvasir.demo import demo_model_path
from kvasir.local.balance import ring_costs, split_windows
from kvasir.local.launcher import LocalRing, default_threads, free_ports, start_ring
from kvasir.shard.cache import default_cache_dir, even_splits
from kvasir.shard.gguf_file import describe

PROMPT = "Request {i}: write a short story about a ring of devices that pass hidden states to each other:"


def one_request(base: str, i: int, tokens: int) -> tuple[int, str]:
    body = {"model": "x", "prompt": PROMPT.format(i=i), "max_tokens": tokens, "temperature": 0}
    r = httpx.post(f"{base}/completions", json=body, timeout=600)
    r.raise_for_status()
    doc = r.json()
    return int(doc["usage"]["completion_tokens"]), str(doc["choices"][0]["text"])


def busy(ring: LocalRing) -> list[float]:
    out = []
    for sock in ring.sockets:
        with ControlClient(sock, timeout=30) as c:
            out.append(float(c.status()["busy_s"]))
    return out


def loaded_round(ring: LocalRing, base: str, n: int, tokens: int) -> tuple[float, list[float], float, list[str]]:
    """Total tokens/s of ``n`` concurrent requests, each rank's busy fraction, the busiest rank's compute ms per
    token, and the answers."""
    before = busy(ring)
    with ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda i: one_request(base, i, tokens), range(n)))
        elapsed = time.perf_counter() - t0
    after = busy(ring)
    if any(count != tokens for count, _ in results):
        raise SystemExit(f"a request stopped early: {[c for c, _ in results]}")
    spent = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(c for c, _ in results)
    return total / elapsed, [x / elapsed for x in spent], max(spent) * 1e3 / total, [text for _, text in results]


def single_ms_per_token(ring: LocalRing, tokens: int) -> tuple[float, list[int]]:
    with ControlClient(ring.sockets[0], timeout=600) as c:
        stamps: list[float] = []
        ids: list[int] = []
        for msg in c.generate(prompt=PROMPT.format(i=0), max_tokens=tokens, temperature=0.0):
            if msg["type"] == "token" and msg["token"] >= 0:
                stamps.append(time.perf_counter())
                ids.append(msg["token"])
            elif msg["type"] == "end":
                break
    return (stamps[-1] - stamps[0]) * 1e3 / max(len(stamps) - 1, 1), ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the Gemma 3 270M demo")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--levels", default="4,8", help="concurrent requests per round, comma-separated")
    ap.add_argument("--threads", type=int, default=None, help="threads per node (default: ring up's)")
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    cache = default_cache_dir()
    model = args.model or demo_model_path(cache)
    n_main = describe(model).n_main
    threads = args.threads or default_threads(args.stages)
    costs = ring_costs(model, cache, threads=threads)
    splits = {
        "even": even_splits(n_main, args.stages),
        "balanced": split_windows(model, cache, args.stages, split="balanced", threads=threads),
    }
    rings: dict[str, LocalRing] = {}
    bases: dict[str, str] = {}
    try:
        for name, windows in splits.items():
            (port,) = free_ports(1)
            rings[name] = start_ring(model, windows, cache, api_port=port, threads=threads, seqs=max(levels))
            bases[name] = f"http://127.0.0.1:{port}/v1"
        for name, ring in rings.items():
            ring.wait_ready(timeout=180)
            one_request(bases[name], 0, 4)  # warm-up: first contexts, first links
        single: dict[str, list[float]] = {name: [] for name in rings}
        single_ids: dict[str, list[int]] = {}
        rates: dict[tuple[str, int], list[float]] = {(name, n): [] for name in rings for n in levels}
        fractions: dict[tuple[str, int], list[list[float]]] = {(name, n): [] for name in rings for n in levels}
        busiest: dict[tuple[str, int], list[float]] = {(name, n): [] for name in rings for n in levels}
        answers: dict[tuple[str, int], list[str]] = {}
        for _ in range(args.repeats):
            for name, ring in rings.items():  # alternating: drift on a shared machine hits both
                ms, ids = single_ms_per_token(ring, args.tokens)
                single[name].append(ms)
                single_ids[name] = ids
            for n in levels:
                for name, ring in rings.items():
                    rate, busy_fraction, worst, texts = loaded_round(ring, bases[name], n, args.tokens)
                    rates[name, n].append(rate)
                    busiest[name, n].append(worst)
                    fractions[name, n].append(busy_fraction)
                    answers[name, n] = texts
    finally:
        for ring in rings.values():
            ring.stop()

    exact = single_ids["even"] == single_ids["balanced"] and all(
        answers["even", n] == answers["balanced", n] for n in levels
    )
    console = Console(width=160)
    table = Table(
        title=f"{model.name}: {args.stages} nodes x {threads} threads on {os.cpu_count()} cores, "
        f"{args.tokens} tokens per request, {args.repeats} rounds (median, min–max)"
    )
    for col in ("split", "windows", "predicted bottleneck ms", "1 request ms/token"):
        table.add_column(col, justify="right")
    for n in levels:
        table.add_column(f"{n} concurrent tokens/s", justify="right")
        table.add_column(f"busy per rank at {n}", justify="right")
        table.add_column(f"busiest rank ms/token at {n}", justify="right")
    base_rate = {n: statistics.median(rates["even", n]) for n in levels}
    for name, windows in splits.items():
        row = [
            name,
            " ".join(f"{a}:{b}" for a, b in windows),
            f"{costs.bottleneck_ms(windows):.1f}",
            f"{statistics.median(single[name]):.1f} ({min(single[name]):.1f}–{max(single[name]):.1f})",
        ]
        for n in levels:
            r = rates[name, n]
            rate = statistics.median(r)
            row.append(f"{rate:.1f} ({min(r):.1f}–{max(r):.1f}) {rate / base_rate[n]:.2f}x")
            per_rank = [statistics.median(f[k] for f in fractions[name, n]) for k in range(len(windows))]
            row.append(" ".join(f"{x:.0%}" for x in per_rank))
            w = busiest[name, n]
            row.append(f"{statistics.median(w):.1f} ({min(w):.1f}–{max(w):.1f})")
        table.add_row(*row)
    console.print(table)
    console.print(
        f"stage costs ({costs.source}, {threads} threads): "
        f"layer {min(costs.layer_ms):.2f}–{max(costs.layer_ms):.2f} ms, "
        f"embedding {costs.embed_ms:.2f} ms, head {costs.head_ms:.2f} ms, per stage {costs.stage_ms:.2f} ms; "
        f"answers identical across splits: {exact}"
    )
    if not exact:
        raise SystemExit("the balanced ring answered differently from the even one")


if __name__ == "__main__":
    main()
