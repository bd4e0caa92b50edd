"""Check the planner's decode estimate against decode times measured on this machine, in the same run.

The planner models decode as memory-bandwidth bound: ms/token = bytes a token reads / effective bandwidth (+ link
time). Calibrate the bandwidth on one model's measured whole-model decode, then predict the other model, and the
in-process rings of both (zero link time), and print measured vs predicted.

    python3 bench/planner_check.py [--threads N] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from kvasir.demo import demo_model_path
from kvasir.planner.devices import Device
from kvasir.planner.estimate import estimate
from kvasir.planner.profile import profile_from_gguf
from kvasir.shard.cache import default_cache_dir, even_splits, stage_files
from kvasir.testing.tinymodels import bench_1b_cached

if TYPE_CHECKING:  # mypy reads bench/ as a package; run as a script, this file's folder is on sys.path
    from bench.ring_tax import measure
else:
    from ring_tax import measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cache = default_cache_dir()
    models = {"1B-class llama Q4_K_M": bench_1b_cached(cache / "tiny"), "Gemma 3 270M": demo_model_path(cache)}
    measured: dict[tuple[str, int], float] = {}
    for name, path in models.items():
        n = profile_from_gguf(path).n_layers
        for stages in (1, 4):
            d, _ = measure(stage_files(path, even_splits(n, stages), cache), 64, 24, args.repeats, args.threads)
            measured[name, stages] = statistics.median(d)
    calib_name = "1B-class llama Q4_K_M"
    calib = profile_from_gguf(models[calib_name])

    def device(bandwidth: float, k: int = 0) -> Device:
        return Device(f"cpu{k}", "cpu", 20.0, bandwidth, 1e-9, 1e9, hop_overhead_ms=0.0)  # stages in one process

    unit = estimate(calib, [(device(1.0), 0, calib.n_layers)]).ms_per_token  # ms per token at 1 GB/s
    bandwidth = unit / measured[calib_name, 1]
    table = Table(
        title=f"planner estimate vs measured decode ({args.threads} threads; effective bandwidth "
        f"{bandwidth:.1f} GB/s calibrated on the {calib_name} whole model)"
    )
    for col in ("model", "config", "measured ms/token", "estimated ms/token", "error"):
        table.add_column(col, justify="right")
    for name, path in models.items():
        prof = profile_from_gguf(path)
        for stages in (1, 4):
            windows = even_splits(prof.n_layers, stages)
            est = estimate(prof, [(device(bandwidth, k), a, b) for k, (a, b) in enumerate(windows)]).ms_per_token
            got = measured[name, stages]
            note = " (calibration)" if (name, stages) == (calib_name, 1) else ""
            table.add_row(
                name,
                "whole" if stages == 1 else f"ring of {stages}",
                f"{got:.2f}",
                f"{est:.2f}",
                f"{(est - got) / got:+.1%}{note}",
            )
    Console(width=150).print(table)


if __name__ == "__main__":
    main()
