"""Argument helpers shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvasir.demo import default_model_path
from kvasir.errors import InputError, ProtocolError
from kvasir.shard.cache import default_cache_dir
from kvasir.wire import SamplingParams


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
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    if args.max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    fields: dict[str, Any] = {
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "repeat_penalty": args.repeat_penalty,
        "seed": args.seed,
    }
    try:
        return SamplingParams(**fields)
    except ProtocolError as exc:
        raise InputError(str(exc).replace("START frame: ", "invalid ")) from None


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout)
    sys.stdout.write("\n")
