"""MTP drafting at the last rank: what a drafted token costs against the last window's compute, and exactness.

The model is the synthetic Qwen3.5-122B-A10B shape (the real qwen35moe architecture: 48 main layers, full attention
every 4th, routed MoE plus a shared expert, and one MTP block) at tiny width with random weights, cut into the
windows of a 4-node ring; the vocabulary is sized so the output head weighs against one layer about as the real
model's does (248k x 3072 head against ~0.2 B active parameters per layer: ~4 layers' worth), because every MTP draft
runs that head. Per K: the last window's compute per row (timed in a plain run), the MTP's cost per drafted token
(true pairs and chain links, prompt excluded), the prompt's pairs, the recurrent-state snapshots the hybrid windows
before the last copy per decode (their rollback, kvasir.stage.rollback), acceptance, and whether greedy and seeded
answers equal plain ``generate`` token for token.

Acceptance on random weights says nothing about a real model's (the MTP block was never trained to agree with the
trunk): only the costs and the exactness are measurements of the machinery.

    python3 bench/mtp_draft.py [--tokens 64] [--ks 1,2,4] [--threads 1] [--vocab 12288]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from kvasir.core.sampling import SamplingParams
from kvasir.shard.cache import default_cache_dir
from kvasir.shard.slice import slice_model
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.mtp import MtpHead
from kvasir.stage.mtp_pipeline import generate_mtp
from kvasir.stage.pipeline import LocalPipeline
from kvasir.testing.tinymodels import tiny_model_cached

SHAPE: dict[str, Any] = {
    "quant": "q8_0",
    "n_layer": 48,
    "n_nextn": 1,
    "n_embd": 256,
    "n_head": 4,
    "n_head_kv": 2,
    "full_attention_interval": 4,
    "n_expert": 16,
    "n_expert_used": 2,
}
WINDOWS = [(0, 12), (12, 24), (24, 36), (36, 48)]
PROMPT = "Write a short story about a ring of devices that pass hidden states to each other, one layer at a time."


def _timed(fn: Callable[..., Any], spent: list[tuple[float, float]]) -> Callable[..., Any]:
    """``fn``, appending (wall, CPU-of-this-thread) seconds per call to ``spent``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent.append((time.perf_counter() - t0, time.thread_time() - c0))

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=12288)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    cache = default_cache_dir()
    model = tiny_model_cached(cache / "tiny", "qwen35moe", n_vocab=args.vocab, **SHAPE)
    out = cache / "bench-mtp"
    out.mkdir(parents=True, exist_ok=True)
    paths = [slice_model(model, a, b, out / f"{model.stem}-{a}-{b}.gguf").path for a, b in WINDOWS]

    def load(mtp: bool, rollback: int) -> LocalPipeline:
        return LocalPipeline(
            [
                Stage.load(
                    StageConfig(
                        p, n_ctx=512, n_seq_max=1, n_threads=args.threads, mtp=mtp and p == paths[-1], rollback=rollback
                    )
                )
                for p in paths
            ]
        )

    plain = load(False, 0)
    spec = load(True, max(ks) + 1)
    head = MtpHead(spec.last)
    prompt = plain.last.vocab.tokenize(PROMPT, add_special=True)
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)

    # The last window's compute per decoded row, in a plain run (its forward calls after the prefill).
    spent: list[tuple[float, float]] = []
    setattr(plain.last, "forward", _timed(plain.last.forward, spent))  # noqa: B010 - an instance-level timer
    want = {p.seed: plain.generate(prompt, p, args.tokens) for p in (greedy, seeded)}
    steps = spent[1 : 1 + len(want[greedy.seed].tokens)]
    row_ms = 1e3 * sum(w for w, _ in steps) / len(steps)
    row_cpu_ms = 1e3 * sum(c for _, c in steps) / len(steps)

    table = Table(title=f"MTP drafting at the last rank ({model.name}, windows {WINDOWS}, {args.threads} thread(s))")
    for col in (
        "K",
        "last window ms/row",
        "MTP ms/drafted token",
        "draft/row",
        "CPU: row / draft ms",
        "draft/row (CPU)",
        "prompt pairs ms",
        "snapshots KiB/decode",
        "snapshot ms/decode",
        "acceptance (random weights)",
        "greedy = plain",
        "seeded = plain",
    ):
        table.add_column(col, justify="right")
    for k in ks:
        snaps = [s.snapshots for s in spec.stages[:-1] if s.snapshots is not None]
        before = [(s.bytes_copied, s.seconds) for s in snaps]
        decodes = 0
        results = {}
        costs = []
        for params in (greedy, seeded):
            got, cost = generate_mtp(spec, head, prompt, params, args.tokens, k)
            results[params.seed] = got
            costs.append(cost)
            assert got.speculation is not None
            decodes += len(prompt) // spec.chunk + 1 + got.speculation.drafted + got.speculation.verify_batches
        drafted = sum(c.drafted for c in costs)
        draft_ms = 1e3 * sum(c.draft_s - c.prompt_s for c in costs) / max(1, drafted)
        draft_cpu_ms = 1e3 * sum(c.draft_cpu_s - c.prompt_cpu_s for c in costs) / max(1, drafted)
        snap_bytes = sum(s.bytes_copied - b[0] for s, b in zip(snaps, before, strict=True))
        snap_s = sum(s.seconds - b[1] for s, b in zip(snaps, before, strict=True))
        n_snap = max(1, decodes * len(snaps))
        spec_g = results[greedy.seed].speculation
        assert spec_g is not None
        table.add_row(
            str(k),
            f"{row_ms:.2f}",
            f"{draft_ms:.2f}",
            f"{draft_ms / row_ms:.2f}",
            f"{row_cpu_ms:.2f} / {draft_cpu_ms:.2f}",
            f"{draft_cpu_ms / row_cpu_ms:.2f}",
            f"{1e3 * costs[0].prompt_s:.1f}",
            f"{snap_bytes / n_snap / 1024:.0f}",
            f"{1e3 * snap_s / n_snap:.3f}",
            f"{spec_g.acceptance:.3f}",
            "yes" if results[greedy.seed].tokens == want[greedy.seed].tokens else "NO",
            "yes" if results[seeded.seed].tokens == want[seeded.seed].tokens else "NO",
        )
    Console(width=200).print(table)
    head.close()
    for pipe in (plain, spec):
        for stage in pipe.stages:
            stage.close()


if __name__ == "__main__":
    main()
