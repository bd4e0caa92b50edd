"""``kvasir generate [MODEL.gguf] [--splits 0,6,12,18] --prompt TEXT``: the stages chained in one process."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from kvasir.commands.common import add_model_arg, add_text_args, model_windows, print_json, sampling_from_args
from kvasir.core.errors import InputError
from kvasir.core.speculate import K_LIMIT
from kvasir.shard.cache import default_cache_dir, stage_files
from kvasir.stage.draftmodel import DraftModel
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.mtp import MtpHead
from kvasir.stage.mtp_pipeline import generate_mtp
from kvasir.stage.pipeline import LocalPipeline


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text with the model's stages chained in this process")
    add_model_arg(p, optional=True)
    p.add_argument("--splits", help="layer cuts, e.g. 0,6,12,18 (default: one stage, the whole model)")
    add_text_args(
        p, prompt_required=True, prompt_help=None, json_help="print one JSON object instead of streaming text"
    )
    p.add_argument("--gpu-layers", type=int, default=0, help="layers to offload to a GPU backend (-1: all)")
    p.add_argument(
        "--speculate",
        type=int,
        metavar="K",
        default=None,
        help=f"draft up to K tokens per step (by prompt lookup, or --draft-model) and verify them in one step "
        f"(0..{K_LIMIT}; the answer is the plain one's, docs/speculation.md)",
    )
    p.add_argument(
        "--draft-model",
        type=Path,
        metavar="FILE",
        default=None,
        help="with --speculate: draft with this GGUF (any whole model with the model's vocabulary), greedily",
    )
    p.add_argument(
        "--mtp",
        type=int,
        metavar="K",
        default=None,
        help=f"draft up to K tokens per step with the model's own MTP block (Qwen3.5; 1..{K_LIMIT}; the answer is "
        "the plain one's, docs/mtp.md)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    if args.speculate is not None and not 0 <= args.speculate <= K_LIMIT:
        raise InputError(f"--speculate must be in [0, {K_LIMIT}]")
    if args.mtp is not None and not 1 <= args.mtp <= K_LIMIT:
        raise InputError(f"--mtp must be in [1, {K_LIMIT}]")
    if args.mtp is not None and args.speculate is not None:
        raise InputError("--mtp and --speculate are two drafters: pass one")
    k = args.mtp or args.speculate or 0
    if args.draft_model is not None and args.speculate is None:
        raise InputError("--draft-model drafts for --speculate K: pass both")
    model, windows = model_windows(args, lambda n_main: [(0, n_main)], chat=args.chat)
    paths = stage_files(model, windows, default_cache_dir())
    with contextlib.ExitStack() as stack:
        stages = [
            stack.enter_context(
                Stage.load(
                    StageConfig(
                        p,
                        n_ctx=args.ctx,
                        n_seq_max=1,
                        n_threads=args.threads,
                        n_gpu_layers=args.gpu_layers,
                        mtp=args.mtp is not None and i == len(paths) - 1,
                        rollback=k + 1 if k else 0,  # hybrid windows roll drafts back from snapshots
                    )
                )
            )
            for i, p in enumerate(paths)
        ]
        pipe = LocalPipeline(stages)
        vocab = stages[0].vocab
        sources = None
        if args.draft_model is not None:
            draft = DraftModel.load(args.draft_model, stages[-1].vocab, n_ctx=args.ctx, n_threads=args.threads)
            stack.callback(draft.close)
            sources = draft.source
        if args.chat:
            prompt = vocab.chat_tokens([("user", args.prompt)], stages[0].chat_template())
        else:
            prompt = vocab.tokenize(args.prompt, add_special=True, parse_special=False)

        def echo(_token: int, delta: str) -> None:
            sys.stdout.write(delta)
            sys.stdout.flush()

        if args.mtp is not None:
            head = stack.enter_context(MtpHead(pipe.last))
            result, _ = generate_mtp(
                pipe,
                head,
                prompt,
                params,
                args.max_tokens,
                args.mtp,
                stop=args.stop,
                on_token=None if args.json else echo,
            )
        else:
            result = pipe.generate(
                prompt,
                params,
                args.max_tokens,
                stop=args.stop,
                on_token=None if args.json else echo,
                speculate=args.speculate,
                draft_sources=sources,
            )
    if args.json:
        print_json(result.to_json())
    else:
        sys.stdout.write("\n")
        spec = result.speculation
        accepted = "" if spec is None else f", drafts accepted {spec.accepted}/{spec.drafted}"
        print(
            f"[{len(result.tokens)} tokens, prefill {result.prefill_ms:.1f} ms, "
            f"decode {result.decode_ms_per_token:.1f} ms/token{accepted}, stop: {result.stop_reason}]",
            file=sys.stderr,
        )
    return 0
