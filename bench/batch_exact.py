"""Batched decode at the stage level: does one llama_decode over several sequences change a sequence's bits, and
what does it gain?

Gemma 3 270M split in two stages (0,9,18: the first takes token ids and outputs boundaries, the last takes
boundaries and outputs logits), 8 sequences with different prompts prefilled alone. For each batch size 1..8 and
several neighbour sets, one decode step of a target sequence batched with its neighbours is compared byte for byte
(first stage's boundary, last stage's logits) with the same step computed alone. Then decode tokens/s: one sequence
alone, 8 sequences one after another, 8 sequences in one batch per step (the same runs interleaved, median, min–max).

    python3 bench/batch_exact.py [--threads 2] [--steps 16] [--repeats 3] [--trials 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
from rich.console import Console
from rich.table import Table

from kvasir.demo import demo_model_path
from kvasir.shard.cache import default_cache_dir, parse_splits, stage_files
from kvasir.stage.engine import BatchItem, FloatArray, Stage, StageConfig

PROMPTS = (
    "The quick brown fox jumps over the lazy dog",
    "In the beginning the universe was created",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Les sanglots longs des violons de l'automne",
    "A ring of devices passes hidden states along",
    "Once upon a time, in a land far away, there lived",
    "SELECT name, count(*) FROM users GROUP BY",
    "The mitochondria is the powerhouse of the cell, and",
)
N_SEQ = len(PROMPTS)


class Chain:
    def __init__(self, a: Stage, b: Stage) -> None:
        self.a, self.b = a, b

    def alone(self, seq: int, pos: int, token: int) -> tuple[FloatArray, FloatArray]:
        hidden = self.a.forward(seq, pos, tokens=[token])
        assert hidden is not None
        self.b.forward(seq, pos, hidden=hidden)
        return hidden.copy(), self.b.logits()

    def batched(self, items: Sequence[tuple[int, int, int]]) -> list[tuple[FloatArray, FloatArray]]:
        hidden = self.a.forward_batch([BatchItem(s, p, tokens=[t]) for s, p, t in items])
        self.b.forward_batch([BatchItem(s, p, hidden=h) for (s, p, _), h in zip(items, hidden, strict=True)])
        out = []
        for i, h in enumerate(hidden):
            assert h is not None
            out.append((h.copy(), self.b.logits(Stage.batch_index(i, 1))))
        return out

    def truncate(self, seq: int, pos: int) -> None:
        self.a.truncate(seq, pos)
        self.b.truncate(seq, pos)


def exactness(console: Console, chain: Chain, prompts: list[list[int]], trials: int) -> None:
    rng = random.Random(7)
    lens = [len(p) for p in prompts]
    nxt = [p[-1] for p in prompts]  # the token decoded next: any valid id works for a bit comparison
    ref = []
    for s in range(N_SEQ):
        ref.append(chain.alone(s, lens[s], nxt[s]))
        chain.truncate(s, lens[s])
    table = Table(title="Batched vs alone: one decode step of a target sequence, by batch size (Gemma 3 270M, 0,9,18)")
    for col in ("batch", "comparisons", "boundary bit-equal", "logits bit-equal", "max |Δ logit|", "argmax equal"):
        table.add_column(col, justify="right")
    for size in range(1, N_SEQ + 1):
        n = b_eq = l_eq = arg_eq = 0
        worst = 0.0
        for _ in range(trials):
            members = sorted(rng.sample(range(N_SEQ), size))  # forward_batch takes ascending ids
            got = chain.batched([(s, lens[s], nxt[s]) for s in members])
            for s, (h, logits) in zip(members, got, strict=True):
                rh, rl = ref[s]
                n += 1
                b_eq += h.tobytes() == rh.tobytes()
                l_eq += logits.tobytes() == rl.tobytes()
                arg_eq += int(np.argmax(logits)) == int(np.argmax(rl))
                worst = max(worst, float(np.max(np.abs(logits - rl))))
            for s in members:
                chain.truncate(s, lens[s])
        table.add_row(str(size), str(n), f"{b_eq}/{n}", f"{l_eq}/{n}", f"{worst:.3g}", f"{arg_eq}/{n}")
    console.print(table)


def ordering(console: Console, chain: Chain, prompts: list[list[int]]) -> None:
    """llama.cpp puts each run of consecutive sequence ids into one micro-batch (its split for per-sequence caches).
    Which compositions keep the bits?"""
    lens = [len(p) for p in prompts]
    nxt = [p[-1] for p in prompts]
    ref = []
    for s in range(N_SEQ):
        ref.append(chain.alone(s, lens[s], nxt[s]))
        chain.truncate(s, lens[s])
    table = Table(title="Batched vs alone by composition (first stage's boundary, last stage's logits)")
    for col in ("sequences", "boundary bit-equal", "logits bit-equal", "max |Δ logit|"):
        table.add_column(col, justify="right")
    for members in ([0, 1, 2], [0, 1, 2, 3], [0, 2, 4, 6], [0, 1, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]):
        got = chain.batched([(s, lens[s], nxt[s]) for s in members])
        b_eq = sum(h.tobytes() == ref[s][0].tobytes() for s, (h, _) in zip(members, got, strict=True))
        l_eq = sum(lg.tobytes() == ref[s][1].tobytes() for s, (_, lg) in zip(members, got, strict=True))
        worst = max(float(np.max(np.abs(lg - ref[s][1]))) for s, (_, lg) in zip(members, got, strict=True))
        for s in members:
            chain.truncate(s, lens[s])
        n = len(members)
        table.add_row(",".join(map(str, members)), f"{b_eq}/{n}", f"{l_eq}/{n}", f"{worst:.3g}")
    console.print(table)


def throughput(console: Console, chain: Chain, prompts: list[list[int]], steps: int, repeats: int) -> None:
    lens = [len(p) for p in prompts]

    def run(fn: Callable[[int], None], seqs: Sequence[int]) -> tuple[float, float]:
        """Tokens per wall-clock second and per CPU-second of this process (steadier on a shared machine)."""
        t0, c0 = time.perf_counter(), time.process_time()
        for step in range(steps):
            fn(step)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        for s in seqs:
            chain.truncate(s, lens[s])
        return len(seqs) * steps / dt, len(seqs) * steps / dc

    def one(step: int) -> None:
        chain.alone(0, lens[0] + step, prompts[0][step % lens[0]])

    def sequential(step: int) -> None:
        for s in range(N_SEQ):
            chain.alone(s, lens[s] + step, prompts[s][step % lens[s]])

    def batched(step: int) -> None:
        chain.batched([(s, lens[s] + step, prompts[s][step % lens[s]]) for s in range(N_SEQ)])

    results: dict[str, list[tuple[float, float]]] = {"1 sequence": [], "8 sequential": [], "8 batched": []}
    run(batched, range(N_SEQ))  # warm-up, not counted
    for _ in range(repeats):
        results["1 sequence"].append(run(one, [0]))
        results["8 sequential"].append(run(sequential, range(N_SEQ)))
        results["8 batched"].append(run(batched, range(N_SEQ)))
    base = statistics.median(w for w, _ in results["1 sequence"])
    base_cpu = statistics.median(c for _, c in results["1 sequence"])
    table = Table(title=f"Decode tokens/s through both stages, {steps} steps, {repeats} repeats (interleaved)")
    for col in ("mode", "tokens/s", "spread", "vs 1 sequence", "tokens/CPU-s", "vs 1 sequence"):
        table.add_column(col, justify="right")
    for mode, pairs in results.items():
        values = [w for w, _ in pairs]
        m, mc = statistics.median(values), statistics.median(c for _, c in pairs)
        table.add_row(
            mode,
            f"{m:.1f}",
            f"{min(values):.1f}–{max(values):.1f}",
            f"{m / base:.2f}x",
            f"{mc:.1f}",
            f"{mc / base_cpu:.2f}x",
        )
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--skip-throughput", action="store_true")
    args = ap.parse_args()
    cache = default_cache_dir()
    paths = stage_files(demo_model_path(cache), parse_splits("0,9,18", 18), cache)
    configs = [StageConfig(p, n_ctx=256, n_seq_max=N_SEQ, n_threads=args.threads) for p in paths]
    with Stage.load(configs[0]) as a, Stage.load(configs[1]) as b:
        chain = Chain(a, b)
        prompts = [b.vocab.tokenize(p) for p in PROMPTS]
        for s, p in enumerate(prompts):
            hidden = a.forward(s, 0, tokens=p)
            assert hidden is not None
            b.forward(s, 0, hidden=hidden)
        console = Console(width=150)
        exactness(console, chain, prompts, args.trials)
        ordering(console, chain, prompts)
        if not args.skip_throughput:
            throughput(console, chain, prompts, args.steps, args.repeats)


if __name__ == "__main__":
    main()
