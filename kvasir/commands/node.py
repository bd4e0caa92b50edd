"""``kvasir node --manifest ring.toml --rank K [--model MODEL.gguf | --stage STAGE.gguf]``: run one ring node."""

from __future__ import annotations

import argparse
import functools
import logging
import signal
from pathlib import Path
from typing import Any

import trio

from kvasir.control.paths import node_socket_path
from kvasir.control.server import serve_control
from kvasir.errors import InputError
from kvasir.ring.manifest import Manifest, load_manifest
from kvasir.ring.node import Node, NodeConfig
from kvasir.shard.cache import default_cache_dir, stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.wire import BoundaryDType

log = logging.getLogger("kvasir.node")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("node", help="run one ring node (its stage, both links, control socket, optional API)")
    p.add_argument("--manifest", required=True, type=Path, help="rank manifest (TOML)")
    p.add_argument("--rank", required=True, type=int)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="whole GGUF to cut this rank's window from")
    src.add_argument("--stage", type=Path, help="this rank's stage GGUF")
    p.add_argument("--api-port", type=int, default=None, help="serve the OpenAI-compatible API on this port")
    p.add_argument("--api-host", default="127.0.0.1", help="API bind address (default loopback)")
    p.add_argument("--control", type=Path, default=None, help="control socket path (default: runtime dir)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ctx", type=int, default=2048, help="context length per request")
    p.add_argument("--seqs", type=int, default=8, help="requests in flight at once")
    p.add_argument("--gpu-layers", type=int, default=0)
    p.add_argument("--prefill-chunk", type=int, default=64)
    p.add_argument(
        "--relay",
        default=None,
        metavar="URL",
        help="send both links through this relay (ws://host:port or wss://host:port)",
    )
    p.add_argument(
        "--boundary-dtype",
        choices=["f32", "f16", "bf16"],
        default="f32",
        help="encoding of the boundaries this node sends (f32 is bit-exact; default)",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(run=run)


def stage_path_for(manifest: Manifest, rank: int, model: Path | None, stage: Path | None, manifest_dir: Path) -> Path:
    if stage is not None:
        return stage
    entry = manifest.rank(rank)
    if entry.stage:
        p = Path(entry.stage)
        return p if p.is_absolute() else manifest_dir / p
    if model is None:
        raise InputError("pass --model or --stage (or give the rank a stage in the manifest)")
    return stage_files(model, [(entry.start, entry.end)], default_cache_dir())[0]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s",
    )
    manifest = load_manifest(args.manifest)
    manifest.rank(args.rank)
    path = stage_path_for(manifest, args.rank, args.model, args.stage, args.manifest.parent)
    config = StageConfig(
        path, n_ctx=args.ctx, n_seq_max=args.seqs, n_threads=args.threads, n_gpu_layers=args.gpu_layers
    )
    trio.run(functools.partial(serve_node, manifest, args.rank, config, args))
    return 0


async def serve_node(manifest: Manifest, rank: int, config: StageConfig, args: argparse.Namespace) -> None:
    stage = await trio.to_thread.run_sync(Stage.load, config)
    try:
        await trio.to_thread.run_sync(lambda: stage.vocab)  # load the tokenizer before serving
        node_config = NodeConfig(
            manifest,
            rank,
            prefill_chunk=args.prefill_chunk,
            relay=args.relay,
            boundary_dtype=BoundaryDType[args.boundary_dtype.upper()],
        )
        node = Node(node_config, stage)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(node.serve)
                control = args.control or node_socket_path(rank, manifest.rank(rank).port)
                await nursery.start(serve_control, node, control)
                if args.api_port is not None:
                    from kvasir.api import serve_api

                    await nursery.start(serve_api, node, args.api_host, args.api_port)
                log.warning(
                    "rank %d ready to link: layers %d:%d on %s, control %s",
                    rank,
                    stage.info.start,
                    stage.info.end,
                    stage.info.backend,
                    control,
                )
                async for signum in signals:
                    log.warning("rank %d: %s, shutting down", rank, signal.Signals(signum).name)
                    await node.shutdown()
                    nursery.cancel_scope.cancel()
                    break
    finally:
        stage.close()
