"""The ring tax: whole model vs the same model cut into 2, 4 and 8 stages chained in one process.

Prints decode ms/token and prefill tokens/s (median over repeats, with min–max), and the ratio to the whole model
measured in the same run, on a generated 1B-class model (hidden 2048, 16 layers, Q4_K_M) and Gemma 3 270M.

    python3 bench/ring_tax.py [--repeats 3] [--decode 32] [--prompt 128] [--threads N] [--models 1b,gemma]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvasir.demo import demo_model_path
from kvasir.shard.cache import default_cache_dir, even_splits, stage_files
from kvasir.shard.gguf_file import describe
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.testing.tinymodels import bench_1b_cached

TEXT = "The quick brown fox jumps over the lazy dog while the ring passes hidden states along. " * 40


def measure(
    paths: Sequence[Path], prompt_len: int, n_decode: int, repeats: int, threads: int
) -> tuple[list[float], list[float]]:
    decode, prefill = [], []
    with contextlib.ExitStack() as stack:
        stages = [
            stack.enter_context(
                Stage.load(StageConfig(p, n_ctx=prompt_len + n_decode + 8, n_seq_max=1, n_threads=threads))
            )
            for p in paths
        ]
        pipe = LocalPipeline(stages)
        prompt = stages[0].vocab.tokenize(TEXT)[:prompt_len]
        for r in range(repeats + 1):  # first run warms caches and page-ins; not counted
            t0 = time.perf_counter()
            pipe.prefill(0, prompt)
            t1 = time.perf_counter()
            for i in range(n_decode):
                pipe.step(0, prompt_len + i, [prompt[i % len(prompt)]])
            t2 = time.perf_counter()
            pipe.free(0)
            if r:
                prefill.append(prompt_len / (t1 - t0))
                decode.append((t2 - t1) * 1e3 / n_decode)
    return decode, prefill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--models", default="1b,gemma")
    args = ap.parse_args()
    cache = default_cache_dir()
    models = {}
    if "1b" in args.models:
        models["1B-class llama Q4_K_M (2048×16)"] = bench_1b_cached(cache / "tiny")
    if "gemma" in args.models:
        models["Gemma 3 270M Q4_K_M"] = demo_model_path(cache)
    console = Console(width=150)
    for name, model in models.items():
        n = describe(model).n_layer
        table = Table(
            title=f"{name} — {args.threads} threads, prompt {args.prompt}, {args.decode} decode tokens, "
            f"{args.repeats} repeats"
        )
        for col in ("config", "decode ms/token", "spread", "ratio", "prefill tok/s", "spread", "ratio"):
            table.add_column(col, justify="right")
        base_d = base_p = 0.0
        for stages in (1, 2, 4, 8):
            paths = stage_files(model, even_splits(n, stages), cache)
            d, p = measure(paths, args.prompt, args.decode, args.repeats, args.threads)
            md, mp = statistics.median(d), statistics.median(p)
            if stages == 1:
                base_d, base_p = md, mp
            table.add_row(
                "whole model" if stages == 1 else f"ring of {stages}",
                f"{md:.2f}",
                f"{min(d):.2f}–{max(d):.2f}",
                f"{md / base_d:.3f}x",
                f"{mp:.1f}",
                f"{min(p):.1f}–{max(p):.1f}",
                f"{mp / base_p:.3f}x",
            )
        console.print(table)


if __name__ == "__main__":
    main()
