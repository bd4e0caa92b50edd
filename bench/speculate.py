"""Speculative decoding (prompt lookup) against the plain one-token loop, in the same process and run.

Per model (Gemma 3 270M, SmolLM2-135M-Instruct) and prompt kind (self-repeating, non-repeating): decode tokens/s of
plain `generate` and of `generate --speculate K` (runs interleaved, median with min–max), the drafts' acceptance,
and the ratio (wall clock, and tokens per CPU-second of the process: steadier on a shared machine). Then, over
many prompts: greedy tokens where the speculative output differs from the plain one (none expected: verify rows are
computed as plain one-token steps, docs/speculation.md § Why row by row), and whether a speculative rerun with the
same K is identical.

    python3 bench/speculate.py [--repeats 3] [--tokens 96] [--k 6] [--threads 2] [--prompts 16] [--models gemma,smol]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvasir.core.sampling import SamplingParams
from kvasir.demo import chat_model_path, demo_model_path
from kvasir.shard.cache import default_cache_dir
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import GenerationResult, LocalPipeline

REPEATING = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
    "Copy the three functions above exactly:\n\ndef add(a, b):\n"
)
NON_REPEATING = "Write a short story about a lighthouse keeper who finds a strange map washed up on the shore."
#: Divergence prompts: mixed kinds, so that drafts are accepted, rejected and absent.
TOPICS = (
    "the history of the printing press",
    "how bees communicate",
    "a recipe for bread",
    "the rules of chess",
    "why the sky is blue",
    "a day in the life of a sailor",
    "the water cycle",
    "how to learn a language",
    "the moons of Jupiter",
    "a letter to a friend",
    "the causes of inflation",
    "how a bicycle works",
    "the life of a tree",
    "a train journey across the mountains",
    "the invention of the telephone",
    "how volcanoes form",
    "a list of ten fruits and their colours",
    "the days of the week in French, Spanish and German",
)


def divergence_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        out.append(f"Write about {topic}." if i % 2 == 0 else f"{topic.capitalize()}: {topic}, {topic}, and")
    return out


def first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def tokens_per_s(r: GenerationResult) -> float:
    return 1e3 / r.decode_ms_per_token if r.decode_ms_per_token else 0.0


def bench_model(console: Console, name: str, path: Path, args: argparse.Namespace, *, chat: bool = False) -> None:
    greedy = SamplingParams.GREEDY
    with Stage.load(StageConfig(path, n_ctx=1024, n_seq_max=1, n_threads=args.threads)) as stage:
        pipe = LocalPipeline([stage])
        vocab = stage.vocab

        def encode(text: str) -> list[int]:
            if not chat:
                return vocab.tokenize(text, add_special=True, parse_special=False)
            return vocab.chat_tokens([("user", text)], stage.chat_template())

        table = Table(
            title=f"{name}: plain vs --speculate {args.k}, {args.tokens} tokens, {args.threads} threads, "
            f"{args.repeats} repeats (interleaved)"
        )
        cols = (
            "prompt",
            "plain tok/s",
            "spread",
            f"K={args.k} tok/s",
            "spread",
            "ratio",
            "CPU ratio",
            "acceptance",
            "same",
        )
        for col in cols:
            table.add_column(col, justify="right")
        # A small base model soon loops on any prompt under greedy decoding, so the case where drafts fail is
        # sampled text (T=1, seeded: plain and speculative draw the same tokens where the logits agree).
        sampled = SamplingParams.GREEDY.with_fields({"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 1})
        cases = (
            ("self-repeating, greedy", REPEATING, greedy),
            ("story, greedy", NON_REPEATING, greedy),
            ("story, T=1 sampled", NON_REPEATING, sampled),
        )
        for label, text, params in cases:
            prompt = encode(text)
            pipe.generate(prompt, params, 8)  # warm caches and page-ins; not counted
            plain, spec, plain_cpu, spec_cpu = [], [], [], []
            rp = rs = None
            for _ in range(args.repeats):
                c0 = time.process_time()
                rp = pipe.generate(prompt, params, args.tokens)
                c1 = time.process_time()
                rs = pipe.generate(prompt, params, args.tokens, speculate=args.k)
                c2 = time.process_time()
                plain.append(tokens_per_s(rp))
                spec.append(tokens_per_s(rs))
                # Tokens per CPU-second of this process (prefill included, the same in both): on a machine
                # shared with other work this is steadier than wall-clock tokens/s.
                plain_cpu.append(len(rp.tokens) / (c1 - c0))
                spec_cpu.append(len(rs.tokens) / (c2 - c1))
            assert rp is not None and rs is not None and rs.speculation is not None
            mp, ms = statistics.median(plain), statistics.median(spec)
            table.add_row(
                label,
                f"{mp:.1f}",
                f"{min(plain):.1f}–{max(plain):.1f}",
                f"{ms:.1f}",
                f"{min(spec):.1f}–{max(spec):.1f}",
                f"{ms / mp:.2f}x" if mp else "n/a",
                f"{statistics.median(spec_cpu) / statistics.median(plain_cpu):.2f}x",
                f"{rs.speculation.accepted}/{rs.speculation.drafted}",
                "yes" if rp.tokens == rs.tokens else f"from token {first_diff(rp.tokens, rs.tokens)}",
            )
        console.print(table)

        diverged = differing = total = reruns_equal = drafted = accepted = 0
        firsts: list[int] = []
        for text in divergence_prompts(args.prompts):
            prompt = encode(text)
            rp = pipe.generate(prompt, greedy, args.div_tokens)
            rs = pipe.generate(prompt, greedy, args.div_tokens, speculate=args.k)
            rr = pipe.generate(prompt, greedy, args.div_tokens, speculate=args.k)
            assert rs.speculation is not None
            drafted += rs.speculation.drafted
            accepted += rs.speculation.accepted
            reruns_equal += rs.tokens == rr.tokens
            total += len(rp.tokens)
            d = first_diff(rp.tokens, rs.tokens)
            if d is not None:
                diverged += 1
                firsts.append(d)
                differing += sum(x != y for x, y in zip(rp.tokens, rs.tokens, strict=False))
        div = Table(title=f"{name}: greedy --speculate {args.k} vs plain over {args.prompts} prompts")
        for col in (
            "prompts",
            "tokens",
            "drafts accepted",
            "outputs differing",
            "first differing token",
            "rerun equal",
        ):
            div.add_column(col, justify="right")
        div.add_row(
            str(args.prompts),
            str(total),
            f"{accepted}/{drafted}",
            f"{diverged} ({differing} positions)",
            ", ".join(map(str, sorted(firsts))) or "-",
            f"{reruns_equal}/{args.prompts}",
        )
        console.print(div)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--div-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--models", default="gemma,smol")
    args = ap.parse_args()
    console = Console(width=150)
    if "gemma" in args.models:
        bench_model(console, "Gemma 3 270M Q4_K_M", demo_model_path(default_cache_dir()), args)
    if "smol" in args.models:
        bench_model(console, "SmolLM2-135M-Instruct Q4_1 (chat template)", chat_model_path(), args, chat=True)


if __name__ == "__main__":
    main()
