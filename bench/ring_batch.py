"""Batched decode on a ``ring up``-style ring: tokens/s of 1 and 8 concurrent API requests, ``--batch`` off vs on.

Two rings of three node processes each on this machine (Gemma 3 270M by default, ``ring up``'s thread split), one
with ``--batch 1`` (exact: one sequence per llama_decode), one with ``--batch 8``, both up for the whole run and
measured in interleaved rounds (off 1, on 1, off 8, on 8, repeated) so that the machine's other load hits both
alike. Each round sends N completions at once through rank 0's OpenAI-compatible API (greedy, distinct prompts,
``--tokens`` each) and counts completion tokens over the wall time from the first send to the last reply. Every
answer of the batching ring is compared with the exact ring's answer to the same prompt. "busy ms/token" is each
rank's time in stage calls per completion token (rank 0 / 1 / 2): what batching saves in compute, apart from the
scheduling. The load average is printed
before and after: the machine is shared.

    python3 bench/ring_batch.py [--model PATH] [--tokens 32] [--repeats 3] [--batch 8]
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
from kvasir.local.launcher import LocalRing, default_threads, free_ports, start_ring
from kvasir.shard.cache import default_cache_dir, even_splits
from kvasir.shard.gguf_file import describe

PROMPT = "Request {i}: write a short story about a ring of devices that pass hidden states to each other:"
LEVELS = (1, 8)


def one_request(base: str, i: int, tokens: int) -> tuple[int, str]:
    body = {"model": "x", "prompt": PROMPT.format(i=i), "max_tokens": tokens, "temperature": 0}
    r = httpx.post(f"{base}/completions", json=body, timeout=600)
    r.raise_for_status()
    reply = r.json()
    return int(reply["usage"]["completion_tokens"]), str(reply["choices"][0]["text"])


def one_round(base: str, n: int, tokens: int) -> tuple[float, list[str]]:
    with ThreadPoolExecutor(n) as pool:
        t0 = time.perf_counter()
        replies = list(pool.map(lambda i: one_request(base, i, tokens), range(n)))
        elapsed = time.perf_counter() - t0
    if any(c != tokens for c, _ in replies):
        raise SystemExit(f"a request stopped early: {[c for c, _ in replies]}")
    return sum(c for c, _ in replies) / elapsed, [text for _, text in replies]


def busy(ring: LocalRing) -> list[float]:
    """Each node's seconds spent in stage calls so far (its ``busy_s``: wall time in the worker thread)."""
    out = []
    for sock in ring.sockets:
        with ControlClient(sock) as c:
            out.append(float(c.status()["busy_s"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: the Gemma 3 270M demo")
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="the batching ring's --batch")
    ap.add_argument("--threads", type=int, default=None, help="threads per node (default: ring up's)")
    args = ap.parse_args()
    cache = default_cache_dir()
    model = args.model or demo_model_path(cache)
    windows = even_splits(describe(model).n_main, 3)
    threads = args.threads or default_threads(len(windows))
    load_before = os.getloadavg()
    modes = {"off": 1, "on": args.batch}
    rings: dict[str, LocalRing] = {}
    bases: dict[str, str] = {}
    rates: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in LEVELS}
    texts: dict[str, list[list[str]]] = {m: [] for m in modes}
    #: Per mode and level: each node's busy seconds per completion token, summed over the rounds.
    busy_s: dict[tuple[str, int], list[float]] = {(m, n): [0.0, 0.0, 0.0] for m in modes for n in LEVELS}
    try:
        for mode, batch in modes.items():
            (port,) = free_ports(1)
            extra = ("--batch", str(batch)) if batch > 1 else ()
            rings[mode] = start_ring(model, windows, cache, api_port=port, threads=threads, seqs=8, extra_args=extra)
            bases[mode] = f"http://127.0.0.1:{port}/v1"
        for mode in modes:
            rings[mode].wait_ready(timeout=180)
            one_request(bases[mode], 0, 4)  # warm-up: first contexts, first links
        for _ in range(args.repeats):
            for n in LEVELS:
                for mode in modes:
                    before = busy(rings[mode])
                    rate, answers = one_round(bases[mode], n, args.tokens)
                    spent = [b - a for a, b in zip(before, busy(rings[mode]), strict=True)]
                    busy_s[mode, n] = [t + d for t, d in zip(busy_s[mode, n], spent, strict=True)]
                    rates[mode, n].append(rate)
                    if n == max(LEVELS):
                        texts[mode].append(answers)
    finally:
        for ring in rings.values():
            ring.stop()
    load_after = os.getloadavg()
    exact = texts["off"][0]
    stable = all(t == exact for t in texts["off"])  # the exact ring: every round the same answers
    changed = [sum(a != b for a, b in zip(t, exact, strict=True)) for t in texts["on"]]
    base_rate = statistics.median(rates["off", 1])
    table = Table(
        title=f"{model.name}: 3 nodes x {threads} threads on {os.cpu_count()} cores, {args.tokens} tokens per "
        f"request, {args.repeats} interleaved rounds; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after"
    )
    cols = ("--batch", "concurrent requests", "total tokens/s", "spread", "vs 1 request, batch off", "busy ms/token")
    for col in cols:
        table.add_column(col, justify="right")
    for (mode, n), values in rates.items():
        rate = statistics.median(values)
        per_token = " / ".join(f"{1000 * b / (n * args.tokens * args.repeats):.1f}" for b in busy_s[mode, n])
        table.add_row(
            str(modes[mode]),
            str(n),
            f"{rate:.1f}",
            f"{min(values):.1f}–{max(values):.1f}",
            f"{rate / base_rate:.2f}x",
            per_token,
        )
    console = Console(width=160)
    console.print(table)
    same = "identical" if stable else "NOT identical"
    console.print(
        f"exact ring (--batch 1): the {max(LEVELS)} answers {same} in every round;"
        f" batching ring (--batch {args.batch}): answers differing from the exact ones per round: {changed}"
        f" (of {max(LEVELS)})"
    )


if __name__ == "__main__":
    main()
