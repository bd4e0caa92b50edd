"""Concurrency on a ``ring up``-style ring: total tokens/s with 1, 2, 4 and 8 concurrent API requests.

Three node processes on this machine, started as ``kvasir ring up`` starts them (:func:`start_ring` with
:func:`default_threads`: the cores shared among the nodes, never oversubscribed), the OpenAI-compatible API on rank 0.
Each level sends N completions at once (greedy, distinct prompts, ``--tokens`` each) and counts the completion tokens
over the wall time from the first send to the last reply; the ratio is against one request alone. Bounded: one
warm-up request, ``--repeats`` rounds per level (median and min–max shown), well under two minutes on the demo model.

    python3 bench/ring_concurrency.py [--model PATH] [--tokens 32] [--repeats 3] [--threads N]
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

from kvasir.demo import demo_model_path
from kvasir.local.launcher import default_threads, free_ports, start_ring
from kvasir.shard.cache import default_cache_dir, even_splits
from kvasir.shard.gguf_file import describe

PROMPT = "Request {i}: write a short story about a ring of devices that pass hidden states to each other:"
LEVELS = (1, 2, 4, 8)


def one_request(base: str, i: int, tokens: int) -> int:
    body = {"model": "x", "prompt": PROMPT.format(i=i), "max_tokens": tokens, "temperature": 0}
    r = httpx.post(f"{base}/completions", json=body, timeout=300)
    r.raise_for_status()
    n: int = r.json()["usage"]["completion_tokens"]
    return n


def round_tokens_per_s(base: str, n: int, tokens: int) -> float:
    with ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        counts = list(pool.map(lambda i: one_request(base, i, tokens), range(n)))
        elapsed = time.perf_counter() - t0
    if any(c != tokens for c in counts):
        raise SystemExit(f"a request stopped early: {counts}")
    return sum(counts) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the Gemma 3 270M demo")
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="threads per node (default: ring up's)")
    args = ap.parse_args()
    cache = default_cache_dir()
    model = args.model or demo_model_path(cache)
    windows = even_splits(describe(model).n_main, 3)
    threads = args.threads or default_threads(len(windows))
    (port,) = free_ports(1)
    ring = start_ring(model, windows, cache, api_port=port, threads=threads, seqs=8)
    try:
        ring.wait_ready(timeout=120)
        base = f"http://127.0.0.1:{port}/v1"
        one_request(base, 0, 4)  # warm-up: first contexts, first links
        results = {n: [round_tokens_per_s(base, n, args.tokens) for _ in range(args.repeats)] for n in LEVELS}
    finally:
        ring.stop()
    base_rate = statistics.median(results[1])
    table = Table(
        title=f"{model.name}: 3 nodes x {threads} threads on {os.cpu_count()} cores, {args.tokens} tokens per request"
    )
    for col in ("concurrent requests", "total tokens/s", "spread", "ratio"):
        table.add_column(col, justify="right")
    for n, rates in results.items():
        rate = statistics.median(rates)
        table.add_row(str(n), f"{rate:.1f}", f"{min(rates):.1f}–{max(rates):.1f}", f"{rate / base_rate:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
