"""``kvasir slice MODEL.gguf --layers A:B -o STAGE.gguf``: write the stage mini-GGUF for one window."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvasir.commands.common import print_window_result
from kvasir.core.errors import WindowError
from kvasir.shard.cache import default_cache_dir, model_sha256
from kvasir.shard.gguf_file import describe
from kvasir.shard.slice import check_window, slice_model


def parse_window(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise WindowError(f"--layers {text!r}: expected A:B, e.g. 0:6") from None
    return a, b


def add_parser(sub: Any) -> None:
    p = sub.add_parser("slice", help="write the stage GGUF for one layer window")
    p.add_argument("model", type=Path, metavar="MODEL.gguf")
    p.add_argument("--layers", required=True, metavar="A:B", help="layer window [A, B)")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="STAGE.gguf")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    a, b = parse_window(args.layers)
    check_window(describe(args.model), a, b)  # before hashing a possibly huge file
    res = slice_model(args.model, a, b, args.output, source_sha256=model_sha256(args.model, default_cache_dir()))
    share = res.stage_bytes / res.model_bytes
    print_window_result(
        args.json,
        res.path,
        (a, b),
        {"stage_bytes": res.stage_bytes, "model_bytes": res.model_bytes, "pad_layers": len(res.layout.pad_positions)},
        f"{res.stage_bytes:,} bytes of the model's {res.model_bytes:,} ({share:.1%})",
    )
    return 0
