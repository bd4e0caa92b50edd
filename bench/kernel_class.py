"""Which factors change a window's output bits? The measurement behind a "kernel class" (docs/verification.md).

Run: ``python bench/kernel_class.py [--model M.gguf] [--prompt-tokens N]`` (about 1-2 minutes on the demo model).
The middle window of a 3-way split is run on the same input boundaries (rank 0's output, computed once) under
one factor changed at a time, against a reference (2 threads, the 64-token prefill schedule, sequence 0 alone,
n_ctx 1024); then one decode step after the prefill. Printed per factor: whether every output bit is equal, and
the largest absolute difference. Same machine, same llama.cpp build: what differs is what the factor changes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)

from kvasir.demo import demo_model_path  # noqa: E402
from kvasir.shard.cache import default_cache_dir, stage_files  # noqa: E402
from kvasir.shard.gguf_file import describe  # noqa: E402
from kvasir.stage.engine import Stage, StageConfig  # noqa: E402

F32 = np.ndarray


def run_window(
    path: Path,
    inputs: F32,
    next_input: F32,
    *,
    threads: int = 2,
    chunk: int = 64,
    seq: int = 0,
    n_ctx: int = 1024,
    n_seq_max: int = 4,
    busy_neighbour: bool = False,
) -> tuple[F32, F32]:
    """(prefill output of the last chunk, the decode step's output) of the window at ``path``."""
    with Stage.load(StageConfig(path, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=threads)) as stage:
        if busy_neighbour:  # another request's state in the same context first
            other = 1 if seq != 1 else 2
            stage.forward(other, 0, hidden=inputs[: min(40, len(inputs))])
        out = None
        for i in range(0, len(inputs), chunk):
            out = stage.forward(seq, i, hidden=inputs[i : i + chunk])
        out = _boundary(out)
        step = _boundary(stage.forward(seq, len(inputs), hidden=next_input))
        return np.array(out[-1:], copy=True), np.array(step, copy=True)


def _boundary(out: F32 | None) -> F32:
    assert out is not None  # only the last stage returns None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="whole GGUF (default: the demo Gemma 3 270M)")
    parser.add_argument("--prompt-tokens", type=int, default=150)
    args = parser.parse_args()
    cache = default_cache_dir()
    model = args.model or demo_model_path(cache)
    n = describe(model).n_main
    cuts = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    first, middle, _ = stage_files(model, cuts, cache)
    rng = np.random.default_rng(0)
    with Stage.load(StageConfig(first, n_ctx=1024, n_seq_max=1, n_threads=2)) as s0:
        tokens = [int(t) for t in rng.integers(100, 20000, size=args.prompt_tokens)]
        chunks = [_boundary(s0.forward(0, i, tokens=tokens[i : i + 64])) for i in range(0, len(tokens), 64)]
        inputs: F32 = np.concatenate(chunks)
        next_input = _boundary(s0.forward(0, len(tokens), tokens=[4242]))

    reference = run_window(middle, inputs, next_input)
    factors: list[tuple[str, Callable[[], tuple[F32, F32]]]] = [
        ("same settings again (noise floor)", lambda: run_window(middle, inputs, next_input)),
        ("threads 1", lambda: run_window(middle, inputs, next_input, threads=1)),
        ("threads 3", lambda: run_window(middle, inputs, next_input, threads=3)),
        ("prefill chunk 32", lambda: run_window(middle, inputs, next_input, chunk=32)),
        ("prefill chunk 16", lambda: run_window(middle, inputs, next_input, chunk=16)),
        ("prefill in one batch", lambda: run_window(middle, inputs, next_input, chunk=len(inputs))),
        ("sequence slot 3", lambda: run_window(middle, inputs, next_input, seq=3)),
        ("another request in the context", lambda: run_window(middle, inputs, next_input, busy_neighbour=True)),
        ("n_ctx 2048", lambda: run_window(middle, inputs, next_input, n_ctx=2048)),
        ("n_seq_max 8", lambda: run_window(middle, inputs, next_input, n_seq_max=8)),
    ]
    print(f"{model.name}: window {cuts[1]} of {n} layers, {len(inputs)}-token prompt, then one decode step")
    print(f"{'factor':<36}{'prefill bits':>14}{'max |diff|':>12}{'decode bits':>13}{'max |diff|':>12}")
    for name, run in factors:
        pre, step = run()
        cells = []
        for got, want in ((pre, reference[0]), (step, reference[1])):
            equal = got.shape == want.shape and got.tobytes() == want.tobytes()
            diff = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan")
            cells += ["equal" if equal else "DIFFER", f"{diff:.3g}"]
        print(f"{name:<36}{cells[0]:>14}{cells[1]:>12}{cells[2]:>13}{cells[3]:>12}")


if __name__ == "__main__":
    main()
