"""Argument helpers shared by subcommands."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvasir.core.sampling import SamplingError, SamplingParams
from kvasir.demo import demo_model_path
from kvasir.errors import InputError
from kvasir.shard.cache import default_cache_dir


def add_model_arg(p: argparse.ArgumentParser, *, optional: bool) -> None:
    if optional:
        p.add_argument("model", nargs="?", type=Path, metavar="MODEL.gguf", help="default: the Gemma 3 270M demo")
    else:
        p.add_argument("model", type=Path, metavar="MODEL.gguf")


def resolve_model(arg: Path | None) -> Path:
    return arg if arg is not None else demo_model_path(default_cache_dir())


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


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    if args.max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    try:
        return SamplingParams.GREEDY.with_fields(vars(args))
    except SamplingError as exc:
        raise InputError(f"--{exc.field.replace('_', '-')} {exc.reason}") from None


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout)
    sys.stdout.write("\n")
