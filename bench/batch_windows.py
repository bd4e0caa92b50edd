"""Batched decode per window: ms per token of one decode step computed alone vs in batches of 2–8 sequences, for
each window of a 3-stage Gemma 3 270M ring (0–6 token input, 6–12 middle, 12–18 with the norm, the 262k-row head
and a greedy sample). Where batching pays and where it does not (docs/benchmarks.md § Batched decode).

Eight sequences with prompts of different lengths are prefilled alone; each measurement runs ``--steps`` decode
steps of the first k sequences (one by one, or in one ``forward_batch`` per step) and rolls them back; the sizes are
interleaved and repeated, the median shown.

    python3 bench/batch_windows.py [--threads 1] [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from kvasir.demo import demo_model_path
from kvasir.shard.cache import default_cache_dir, stage_files
from kvasir.stage.engine import BatchItem, Stage, StageConfig
from kvasir.wire import SamplingParams

SIZES = (1, 2, 4, 6, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cache = default_cache_dir()
    paths = stage_files(demo_model_path(cache), [(0, 6), (6, 12), (12, 18)], cache)
    stages = [Stage.load(StageConfig(p, n_ctx=256, n_seq_max=8, n_threads=args.threads)) for p in paths]
    first, middle, last = stages
    try:
        samplers = [last.new_sampler(SamplingParams(temperature=0.0)) for _ in range(8)]
        lens = []
        for s in range(8):
            tokens = last.vocab.tokenize(f"Request {s}: a short story about a ring of devices " + "word " * (3 * s))
            hidden = first.forward(s, 0, tokens=tokens)
            hidden = middle.forward(s, 0, hidden=hidden)
            last.forward(s, 0, hidden=hidden)
            lens.append(len(tokens))
        row = first.forward(0, lens[0], tokens=[5])
        assert row is not None
        row = row.copy()
        first.truncate(0, lens[0])

        def step(stage: Stage, seqs: list[int], pos: int, batched: bool) -> None:
            def item(s: int) -> BatchItem:
                if stage is first:
                    return BatchItem(s, lens[s] + pos, tokens=[5])
                return BatchItem(s, lens[s] + pos, hidden=row)

            if batched:
                stage.forward_batch([item(s) for s in seqs])
                if stage is last:
                    for i, s in enumerate(seqs):
                        stage.sample(samplers[s], Stage.batch_index(i, 1))
                return
            for s in seqs:
                it = item(s)
                stage.forward(s, it.pos0, tokens=it.tokens, hidden=it.hidden)
                if stage is last:
                    stage.sample(samplers[s])

        times: dict[tuple[int, int, bool], list[float]] = {}
        for _ in range(args.repeats):
            for k in SIZES:
                seqs = list(range(k))
                for w, stage in enumerate(stages):
                    for batched in (False, True) if k > 1 else (False,):
                        t0 = time.perf_counter()
                        for pos in range(args.steps):
                            step(stage, seqs, pos, batched)
                        elapsed = time.perf_counter() - t0
                        for s in seqs:
                            stage.truncate(s, lens[s])
                        times.setdefault((w, k, batched), []).append(1000 * elapsed / (args.steps * k))
    finally:
        for stage in stages:
            stage.close()
    table = Table(title=f"ms per token, {args.threads} thread(s), median of {args.repeats}: alone / batched")
    table.add_column("window")
    for k in SIZES:
        table.add_column(f"{k} seq" if k == 1 else f"{k} seqs", justify="right")
    for w, name in enumerate(("0–6 (tokens in)", "6–12", "12–18 + head + sample")):
        cells = []
        for k in SIZES:
            alone = statistics.median(times[w, k, False])
            cells.append(f"{alone:.1f}" if k == 1 else f"{alone:.1f} / {statistics.median(times[w, k, True]):.1f}")
        table.add_row(name, *cells)
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
