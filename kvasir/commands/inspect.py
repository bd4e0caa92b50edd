"""``kvasir inspect MODEL.gguf [--json]``: what a GGUF holds and whether its windows are supported."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvasir.commands.common import print_json
from kvasir.shard.gguf_file import ModelInfo, describe


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="describe a GGUF model or stage file")
    p.add_argument("model", type=Path, metavar="MODEL.gguf")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def _mtp_row(info: ModelInfo) -> str:
    """Whether the file carries multi-token-prediction (nextn) blocks, the last window's drafter (docs/mtp.md)."""
    if not info.nextn_layers:
        return "none"
    where = "" if info.stage_window is None else " (this last window carries them)"
    return f"{info.nextn_layers}{where}"


def run(args: argparse.Namespace) -> int:
    info = describe(args.model)
    if args.json:
        print_json(info.to_json())
        return 0
    t = Table(title=str(args.model), show_header=False)
    t.add_row("architecture", info.arch)
    t.add_row("layers", str(info.n_main) + (f" (+{info.nextn_layers} MTP)" if info.nextn_layers else ""))
    t.add_row("MTP layers", _mtp_row(info))
    t.add_row("hidden size", str(info.n_embd))
    t.add_row("vocabulary", str(info.n_vocab))
    per = info.layer_bytes
    t.add_row("bytes per layer", f"{_size(min(per))} … {_size(max(per))} (total {_size(sum(per))})")
    t.add_row("bytes outside layers", _size(info.outside_bytes))
    t.add_row("file", _size(info.file_bytes))
    t.add_row("windows supported", "yes" if info.supported else "no")
    if info.stage_window:
        t.add_row("stage window", f"{info.stage_window[0]}:{info.stage_window[1]} of {info.source_layers}")
    Console().print(t)
    return 0
