"""Speculative decoding across the ring: decode tokens/s of a ring of node processes on loopback with and without
``--speculate K``, in the same run. The layers are split as ``ring up`` splits them (balanced by measured stage
costs; ``--split even`` for equal layer counts).

Per model (Gemma 3 270M, SmolLM2-135M-Instruct, and a tiny random 8-layer llama whose compute is small next to the
ring's per-step costs), one ring; each request asks its K through the control socket (0 = the plain ring), plain and
speculative requests interleaved, ``--repeats`` of each; the nodes draft by ``--draft-policy`` (auto: eagerly on a
latency-bound ring). Text kinds (``--kinds``): self-repeating (asked to copy code; greedy; drafts mostly accepted),
verbatim (a paragraph given twice, then begun a third time; greedy) and "drafts fail" (sampled at T=1
with a fixed seed: drafts proposed from repeated n-grams and mostly rejected). Per kind: median tokens/s with
min–max, the per-repeat ratio's median and min–max, acceptance and eager steps (the last rank's counters) and
whether every speculative answer equals the plain one. Then what a verify batch costs the whole model in one process
(1 row; n rows one at a time, as a verify batch runs them; n rows in one llama_decode).

    python3 bench/ring_speculate.py [--models gemma,smol,tiny] [--stages 3] [--k 6] [--tokens 96] [--repeats 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)  # run as a script: tests.harness comes from the checkout

from kvasir.control.client import ControlClient  # noqa: E402
from kvasir.core.speculate import DRAFT_POLICIES  # noqa: E402
from kvasir.demo import chat_model_path, demo_model_path  # noqa: E402
from kvasir.local.balance import SPLIT_MODES, split_windows  # noqa: E402
from kvasir.local.launcher import start_ring  # noqa: E402
from kvasir.shard.cache import default_cache_dir  # noqa: E402
from kvasir.stage.engine import BatchItem, Stage, StageConfig  # noqa: E402
from kvasir.testing.tinymodels import tiny_model_cached  # noqa: E402
from tests.harness.fleet import PROFILES, FleetNode, fleet, start_fleet_ring  # noqa: E402

REPEATING = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
    "Copy the three functions above exactly:\n\ndef add(a, b):\n"
)
PARAGRAPH = (
    "The keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote the weather in the log: wind from "
    "the west, a long swell, three fishing boats home before dark and one still out beyond the point."
)
VERBATIM = f"{PARAGRAPH}\n\nThe same paragraph, repeated word for word:\n\n{PARAGRAPH}\n\nAnd once more:\n\nThe keeper"
STORY = "Write a short story about a lighthouse keeper who finds a strange map washed up on the shore."
#: (prompt, sampling) per text kind.
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "self-repeating": (REPEATING, {"temperature": 0.0}),
    "verbatim": (VERBATIM, {"temperature": 0.0}),
    "drafts fail": (STORY, {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7}),
}


def model_path(name: str, cache: Path) -> Path:
    if name == "gemma":
        return demo_model_path(cache)
    if name == "smol":
        return chat_model_path()
    if name == "tiny":  # 8 layers, 256 wide: a few hundred µs per token, so the ring's hops dominate
        return tiny_model_cached(cache / "tiny", "llama", "q8_0", n_layer=8, n_embd=256)
    return Path(name)


def run_once(sock: Path, prompt: str, tokens: int, k: int, sampling: dict[str, Any]) -> tuple[float, list[int]]:
    """Decode tokens/s of one request (first token to last, prefill excluded) and its tokens."""
    out: list[int] = []
    t_first = t_last = 0.0
    with ControlClient(sock, timeout=600) as c:
        for msg in c.generate(prompt=prompt, max_tokens=tokens, speculate=k, **sampling):
            if msg["type"] == "token" and msg["token"] >= 0:
                out.append(msg["token"])
                t_last = time.perf_counter()
                if len(out) == 1:
                    t_first = t_last
            elif msg["type"] == "end" and msg["reason"] == "error":
                raise RuntimeError(msg.get("error"))
    return (len(out) - 1) / (t_last - t_first) if len(out) > 1 else 0.0, out


def counters(sock: Path) -> dict[str, Any]:
    with ControlClient(sock, timeout=60) as c:
        requests: dict[str, Any] = c.status()["requests"]
        return requests


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def bench_ring(table: Table, name: str, model: Path, args: argparse.Namespace, cache: Path) -> None:
    # ring up's split (balanced by measured stage costs unless --split even): the ring a user gets.
    windows = split_windows(model, cache, args.stages, split=args.split, threads=args.threads)
    table.caption = (table.caption or "") + f"{name}: layers {' '.join(f'{a}:{b}' for a, b in windows)}  "
    policy = ("--draft-policy", args.draft_policy)
    with contextlib.ExitStack() as stack:
        if args.fleet is None:
            ring = start_ring(model, windows, cache, threads=args.threads, ctx=1024, extra_args=policy)
        else:  # each node in its own network namespace behind an emulated access link (tests/harness/fleet.py)
            run_dir = Path(tempfile.mkdtemp(prefix="kvasir-spec-fleet-"))
            nodes = [FleetNode(f"n{k}", "cpu", PROFILES[args.fleet]) for k in range(len(windows))]
            f = stack.enter_context(fleet(nodes, run_dir))
            ring = start_fleet_ring(
                f, model, windows, cache, run_dir, threads=args.threads, ctx=1024, extra_args=policy
            )
        stack.callback(ring.stop)
        ring.wait_ready(timeout=300)
        first, last = ring.sockets[0], ring.sockets[-1]
        for kind in args.kinds.split(","):
            prompt, base = KINDS[kind]
            sampling = {**base, "chat": name == "smol"}  # an instruct model: through its chat template
            run_once(first, prompt, 8, 0, sampling)  # warm-up: pages in, caches filled
            plain: list[float] = []
            spec: list[float] = []
            same = True
            before = counters(last)
            for _ in range(args.repeats):
                p, plain_tokens = run_once(first, prompt, args.tokens, 0, sampling)
                s, spec_tokens = run_once(first, prompt, args.tokens, args.k, sampling)
                plain.append(p)
                spec.append(s)
                same = same and plain_tokens == spec_tokens
            after = counters(last)
            drafted = after["drafted"] - before["drafted"]
            accepted = after["accepted"] - before["accepted"]
            batches = after["verify_batches"] - before["verify_batches"]
            eager = after["eager_steps"] - before["eager_steps"]
            ratios = [s / p for s, p in zip(spec, plain, strict=True) if p > 0]
            table.add_row(
                name,
                kind,
                spread(plain),
                spread(spec),
                spread(ratios, "{:.2f}x") if ratios else "-",
                f"{accepted}/{drafted} ({accepted / drafted:.0%})" if drafted else "no drafts",
                str(batches),
                str(eager),
                "yes" if same else "NO",
            )


SIZES = (2, 3, 4, 7, 8)


def verify_cost(table: Table, name: str, model: Path, threads: int) -> None:
    """ms of one step of the whole model: 1 row (``forward``); n rows as a verify batch computes them (one row at a
    time: ``forward_verify``); n rows in one llama_decode with every row an output (what a batched verify would
    cost: not bit-exact, docs/speculation.md § Why row by row)."""
    with Stage.load(StageConfig(model, n_ctx=1024, n_seq_max=1, n_threads=threads)) as stage:
        prompt = stage.vocab.tokenize(REPEATING)
        stage.forward(0, 0, tokens=prompt)
        pos = len(prompt)

        def batched(seq: int, pos0: int, *, tokens: list[int]) -> None:
            stage._decode([BatchItem(seq, pos0, tokens, None)], all_outputs=True)

        def timed(call: Callable[..., object], n: int) -> str:
            ts = []
            for _ in range(9):
                t0 = time.perf_counter()
                call(0, pos, tokens=list(range(10, 10 + n)))
                ts.append((time.perf_counter() - t0) * 1e3)
                stage.truncate(0, pos)
            return spread(ts, "{:.1f}")

        cells = [timed(stage.forward, 1)]
        cells += [f"{timed(stage.forward_verify, n)} / {timed(batched, n)}" for n in SIZES]
        table.add_row(name, *cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gemma,smol,tiny", help="gemma, smol, tiny or GGUF paths, comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"text kinds, comma-separated: {', '.join(KINDS)}")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="threads per node process")
    ap.add_argument("--draft-policy", choices=DRAFT_POLICIES, default="auto", help="the nodes' drafting policy")
    ap.add_argument("--split", choices=SPLIT_MODES, default="balanced", help="how the layers are split (as ring up)")
    ap.add_argument(
        "--fleet",
        choices=sorted(PROFILES),
        default=None,
        help="run the rings on an emulated fleet with this link profile (root; wan: 20 ms round trip per hop)",
    )
    ap.add_argument("--no-cost", dest="cost", action="store_false", help="skip the verify-batch cost table")
    args = ap.parse_args()
    if unknown := set(args.kinds.split(",")) - set(KINDS):
        ap.error(f"unknown text kind(s): {', '.join(sorted(unknown))}")
    cache = default_cache_dir()
    models = {name: model_path(name, cache) for name in args.models.split(",")}
    console = Console(width=170)
    table = Table(
        title=f"ring of {args.stages} processes "
        f"{'on loopback' if args.fleet is None else f'on an emulated {args.fleet} fleet'} "
        f"({args.threads} thread(s) each), {args.tokens} tokens, "
        f"--speculate {args.k} vs 0, {args.repeats} interleaved repeats: median (min–max)"
    )
    cols: tuple[str, ...] = (
        "model",
        "text",
        "plain tok/s",
        f"K={args.k} tok/s",
        "ratio",
        "acceptance",
        "verify batches",
    )
    cols += ("eager steps", "same")
    for col in cols:
        table.add_column(col, justify="right")
    cost = Table(title=f"one step of the whole model in one process, {args.threads} thread(s): ms, median (min–max)")
    for col in ("model", "1 row", *(f"{n} rows: by row / batched" for n in SIZES)):
        cost.add_column(col, justify="right")
    for name, model in models.items():
        bench_ring(table, name, model, args, cache)
        if args.cost:
            verify_cost(cost, name, model, args.threads)
    console.print(table)
    if args.cost:
        console.print(cost)


if __name__ == "__main__":
    main()
