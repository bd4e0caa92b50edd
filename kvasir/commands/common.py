"""Argument helpers shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvasir.core.errors import InputError
from kvasir.core.sampling import SamplingError, SamplingParams
from kvasir.core.speculate import DRAFT_POLICIES, K_LIMIT
from kvasir.demo import default_model_path
from kvasir.shard.cache import default_cache_dir, parse_splits
from kvasir.shard.gguf_file import describe

Window = tuple[int, int]


def add_model_arg(p: argparse.ArgumentParser, *, optional: bool) -> None:
    if optional:
        p.add_argument(
            "model", nargs="?", type=Path, metavar="MODEL.gguf", help="default: Gemma 3 270M (chat: SmolLM2-135M)"
        )
    else:
        p.add_argument("model", type=Path, metavar="MODEL.gguf")


def resolve_model(arg: Path | None, *, chat: bool = False) -> Path:
    return arg if arg is not None else default_model_path(default_cache_dir(), chat=chat)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingParams.GREEDY
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=d.top_k)
    g.add_argument("--top-p", type=float, default=d.top_p)
    g.add_argument("--min-p", type=float, default=d.min_p)
    g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def add_speculate_arg(p: argparse.ArgumentParser, what: str) -> None:
    """``--speculate K`` for the ring's commands (``generate`` has its own: there None and 0 differ)."""

    def k(text: str) -> int:
        value = int(text)
        if not 0 <= value <= K_LIMIT:
            raise argparse.ArgumentTypeError(f"must be in [0, {K_LIMIT}]")
        return value

    p.add_argument(
        "--speculate",
        type=k,
        metavar="K",
        default=0,
        help=f"{what}: draft up to K tokens per step by prompt lookup, verified in one ring pass through every window "
        f"(0..{K_LIMIT}; default 0, plain steps; the answer is the same either way; docs/speculation.md)",
    )
    p.add_argument(
        "--draft-policy",
        choices=DRAFT_POLICIES,
        default="auto",
        help="how the last rank drafts for speculative requests: eagerly (guesses from single-token matches, K kept "
        "high) when the ring's round trip outweighs the rows a wrong guess wastes, else adaptively (auto, the "
        "default), or always one way; fixed: eagerly with K always at its maximum (the latency law's assumption, "
        "for benchmarks); the answer is the same either way",
    )
    p.add_argument(
        "--draft-model",
        type=Path,
        metavar="FILE",
        default=None,
        help="the last rank drafts with this GGUF (a whole model with the model's vocabulary, greedily) instead of "
        "prompt lookup; other ranks ignore it",
    )
    p.add_argument(
        "--draft-mtp",
        action="store_true",
        help="the last rank drafts with the model's own MTP block (Qwen3.5 models that carry one; needs --speculate K) "
        "instead of prompt lookup; other ranks ignore it (docs/mtp.md)",
    )
    p.add_argument(
        "--draft-oracle",
        type=Path,
        metavar="FILE",
        default=None,
        help="BENCHMARK INSTRUMENT, not for serving: the last rank drafts the known answer (a JSON file of plain "
        "runs, right with probability alpha per token; kvasir/core/oracle.py)",
    )


def add_batch_arg(p: argparse.ArgumentParser) -> None:
    """``--batch N`` for ``node`` and ``ring up``: batched decode across requests (kvasir.ring.batching)."""

    def n(text: str) -> int:
        value = int(text)
        if not 1 <= value <= 64:
            raise argparse.ArgumentTypeError("must be in [1, 64]")
        return value

    p.add_argument(
        "--batch",
        type=n,
        metavar="N",
        default=1,
        help="compute up to N requests' decode steps in one llama_decode: more tokens/s under concurrent requests, "
        "but answers are no longer bit-exact against `kvasir generate` (default 1: exact; docs/speculation.md)",
    )


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    if args.max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    try:
        return SamplingParams.GREEDY.with_fields(vars(args))
    except SamplingError as exc:
        raise InputError(f"--{exc.field.replace('_', '-')} {exc.reason}") from None


def add_text_args(
    p: argparse.ArgumentParser, *, prompt_required: bool, prompt_help: str | None, json_help: str
) -> None:
    """What ``generate`` and ``ring up`` share: the prompt, its form, the output form, threads, context, sampling."""
    p.add_argument("--prompt", required=prompt_required, help=prompt_help)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    p.add_argument("--json", action="store_true", help=json_help)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="llama.cpp threads per stage (default: all cores, shared among ring up's nodes)",
    )
    p.add_argument("--ctx", type=int, default=2048, help="context length (default 2048)")
    add_sampling_args(p)


def model_windows(
    args: argparse.Namespace, default: Callable[[int], list[Window]], *, chat: bool = False
) -> tuple[Path, list[Window]]:
    """The model (the demo, or for ``chat`` the chat demo, when none is given) and its windows: ``--splits``, else
    ``default(main layer count)``."""
    model = resolve_model(args.model, chat=chat)
    n_main = describe(model).n_main
    return model, parse_splits(args.splits, n_main) if args.splits else default(n_main)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout)
    sys.stdout.write("\n")


def print_window_result(as_json: bool, path: Path, window: Window, fields: dict[str, Any], line: str) -> None:
    """A stage file written: with ``--json`` one object (``path``, ``layers``, ``fields``), else one line."""
    if as_json:
        print_json({"path": str(path), "layers": list(window), **fields})
    else:
        print(f"{path}: layers {window[0]}:{window[1]}, {line}")
