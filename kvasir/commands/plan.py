"""``kvasir plan``: split a model's layers over a fleet of devices and print the rank manifest."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvasir.core.errors import InputError
from kvasir.core.speculate import K_LIMIT
from kvasir.planner.devices import load_devices
from kvasir.planner.estimate import DEFAULT_N_CTX, RankManifest
from kvasir.planner.solve import OBJECTIVES, plan
from kvasir.planner.speculation import SpeculationEstimate, estimate_speculation

_GB = 1e9


def add_parser(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "plan",
        help="split a model's layers into windows over a set of devices",
        description="Split a model's layers into contiguous windows over a ring of devices, minimising the "
        "estimated decode time per token within each device's memory (docs/planner.md).",
    )
    parser.add_argument(
        "--model",
        required=True,
        metavar="MODEL",
        help="a GGUF file, a profile TOML, or a shipped profile name",
    )
    parser.add_argument("--devices", required=True, metavar="TOML", help="devices file ([[device]] tables)")
    parser.add_argument("--json", action="store_true", help="print the manifest as JSON")
    parser.add_argument(
        "--ctx",
        type=int,
        default=DEFAULT_N_CTX,
        metavar="N",
        help=f"context to budget KV for (default {DEFAULT_N_CTX})",
    )
    parser.add_argument("--seqs", type=int, default=1, metavar="N", help="sequences in flight (default 1)")
    parser.add_argument("--order", metavar="A,B,...", help="fix the ring order: every device name, comma-separated")
    parser.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="latency",
        help="latency: least ms/token for one request (default); throughput: least busy bottleneck rank, what bounds "
        "tokens/s with many requests in flight",
    )
    parser.add_argument(
        "--accept",
        type=float,
        metavar="ALPHA",
        default=None,
        help="also estimate speculative decoding at this draft acceptance rate (0..1): tokens per ring trip and "
        "tokens/s by the latency law (docs/planner.md § Speculation)",
    )
    parser.add_argument(
        "--speculate",
        type=int,
        metavar="K",
        default=None,
        help=f"with --accept: drafts per trip (0..{K_LIMIT}; default: the K the estimate finds best)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvasir.profiles import resolve_model  # lazy: keeps `kvasir --help` free of gguf imports

    if args.ctx < 1 or args.seqs < 1:
        raise InputError("--ctx and --seqs must be >= 1")
    if args.accept is not None and not 0.0 <= args.accept <= 1.0:
        raise InputError(f"--accept must be in [0, 1], got {args.accept}")
    if args.speculate is not None and (args.accept is None or not 0 <= args.speculate <= K_LIMIT):
        raise InputError(f"--speculate K (0..{K_LIMIT}) goes with --accept ALPHA")
    profile = resolve_model(args.model)
    devices = load_devices(args.devices)
    order = [name.strip() for name in args.order.split(",")] if args.order else None
    manifest = plan(profile, devices, order=order, n_ctx=args.ctx, n_seq=args.seqs, objective=args.objective)
    spec = None
    if args.accept is not None:
        window_ms = [w.compute_ms for w in manifest.windows]
        spec = estimate_speculation(args.accept, window_ms, manifest.link_ms, args.speculate)
    if args.json:
        doc = manifest.to_json()
        if spec is not None:
            doc["speculation"] = spec.to_json()
        print(json.dumps(doc, indent=2, ensure_ascii=False))
    else:
        _print_table(manifest)
        if spec is not None:
            print(speculation_line(spec))
    return 0


def speculation_line(spec: SpeculationEstimate) -> str:
    return (
        f"with speculation at acceptance {spec.alpha:g}, K={spec.k}: {spec.g:.2f} tokens per ring trip, "
        f"est. {spec.tokens_per_s:.1f} tokens/s ({spec.tokens_per_s / spec.plain_tokens_per_s:.2f}x plain; "
        f"the law without verify rows: {spec.law_tokens_per_s:.1f})"
    )


def _print_table(manifest: RankManifest) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 120)  # a file or pipe: don't wrap the table at 80 columns
    title = f"{manifest.model} ({manifest.arch}, {manifest.n_layers} layers), KV for {manifest.n_ctx} tokens"
    table = Table(
        title=title,
        title_justify="left",
    )
    columns = (
        "rank",
        "device",
        "kind",
        "layers",
        "weights GB",
        "memory / budget GB",
        "compute ms",
        "link ms → next",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in {"device", "kind", "layers"} else "right", no_wrap=True)
    for w in manifest.windows:
        pad = f" +pad {','.join(map(str, w.padding))}" if w.padding else ""
        table.add_row(
            str(w.rank),
            w.device.name,
            w.device.kind,
            f"[{w.start}, {w.stop}){pad}",
            f"{w.weight_bytes / _GB:.2f}",
            f"{w.memory_bytes / _GB:.2f} / {w.device.memory_gb:g}",
            f"{w.compute_ms:.2f}",
            f"{w.hop_ms:.2f} → {w.next_device}",
        )
    console.print(table)
    console.print(
        f"est. decode: [bold]{manifest.est_tokens_per_s:.1f} tokens/s[/bold] "
        f"({manifest.ms_per_token:.2f} ms/token = {manifest.compute_ms:.2f} ms compute "
        f"+ {manifest.link_ms:.2f} ms hops); under load ≤ {manifest.est_loaded_tokens_per_s:.1f} tokens/s "
        f"(busiest rank or link {manifest.bottleneck_ms:.2f} ms/token)"
    )
    if manifest.unused:
        unused = Table(title="unused devices", title_justify="left")
        unused.add_column("device", no_wrap=True)
        unused.add_column("kind", no_wrap=True)
        unused.add_column("why")
        for u in manifest.unused:
            unused.add_row(u.device.name, u.device.kind, u.reason)
        console.print(unused)
