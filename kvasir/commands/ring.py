"""``kvasir ring up [MODEL.gguf] [--stages N | --splits ...] [--prompt TEXT ...]``: a whole ring on this machine."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from kvasir.commands.common import add_model_arg, add_text_args, model_windows, print_json, sampling_from_args
from kvasir.control.client import ControlClient
from kvasir.errors import InputError, RingError
from kvasir.ring.launcher import start_ring
from kvasir.shard.cache import default_cache_dir, even_splits


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ring", help="run a ring of node processes on this machine")
    ring_sub = p.add_subparsers(dest="ring_command", required=True, metavar="ACTION")
    up = ring_sub.add_parser("up", help="start N nodes, wait for the ring, answer a prompt or keep serving")
    add_model_arg(up, optional=True)
    g = up.add_mutually_exclusive_group()
    g.add_argument("--stages", type=int, default=3, help="number of nodes (even split; default 3)")
    g.add_argument("--splits", help="layer cuts, e.g. 0,6,12,18")
    add_text_args(
        up,
        prompt_required=False,
        prompt_help="answer this prompt, print the result and stop the ring",
        json_help="print one JSON object (like `kvasir generate --json`)",
    )
    up.add_argument("--api-port", type=int, default=None, help="serve the OpenAI-compatible API on rank 0")
    up.add_argument("--relay", action="store_true", help="start a local relay and send every link through it")
    up.add_argument("--seqs", type=int, default=8, help="concurrent requests per node")
    up.set_defaults(run=run_up)


def run_up(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    model, windows = model_windows(args, lambda n_main: even_splits(n_main, args.stages))
    if len(windows) < 2:
        raise InputError("a ring needs at least 2 stages (for one stage use `kvasir generate`)")
    threads = args.threads or max(1, os.cpu_count() or 1)
    ring = start_ring(
        model, windows, default_cache_dir(), api_port=args.api_port, threads=threads, ctx=args.ctx, seqs=args.seqs
    )
    try:
        ring.wait_ready()
        if args.prompt is None:
            return _serve_forever(ring, args)
        with ControlClient(ring.sockets[0], timeout=600) as client:
            tokens: list[int] = []
            text = ""
            t0 = time.perf_counter()
            t_first = t_last = t0
            end: dict[str, Any] = {}
            for msg in client.generate(
                prompt=args.prompt,
                chat=args.chat,
                max_tokens=args.max_tokens,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                min_p=params.min_p,
                repeat_penalty=params.repeat_penalty,
                seed=params.seed,
                stop=args.stop,
            ):
                if msg["type"] == "token":
                    if msg["token"] >= 0:
                        tokens.append(msg["token"])
                        t_last = time.perf_counter()
                        if len(tokens) == 1:
                            t_first = t_last
                    text += msg["text"]
                    if not args.json:
                        sys.stdout.write(msg["text"])
                        sys.stdout.flush()
                elif msg["type"] == "end":
                    end = msg
        if end.get("reason") == "error":
            raise RingError(f"request failed: {end.get('error')}")
        steps = max(len(tokens) - 1, 0)
        result = {
            "tokens": tokens,
            "text": end.get("text", text),
            "prompt_tokens": end.get("prompt_tokens"),
            "stop_reason": end.get("reason"),
            "prefill_ms": round((t_first - t0) * 1e3, 3),
            "decode_ms_per_token": round((t_last - t_first) * 1e3 / steps, 3) if steps else 0.0,
            "stages": len(windows),
        }
        if args.json:
            print_json(result)
        else:
            sys.stdout.write("\n")
            print(
                f"[{len(tokens)} tokens through {len(windows)} nodes, decode {result['decode_ms_per_token']} ms/token]",
                file=sys.stderr,
            )
        return 0
    finally:
        ring.stop()


def _serve_forever(ring: Any, args: argparse.Namespace) -> int:
    print(f"ring up: {len(ring.processes)} nodes, manifest {ring.run_dir / 'ring.toml'}")
    for k, sock in enumerate(ring.sockets):
        w = ring.manifest.ranks[k]
        print(f"  rank {k}: layers {w.start}:{w.end} at {w.address}, control {sock}")
    if ring.relay_url:
        print(f"  relay: {ring.relay_url} (every link goes through it)")
    if args.api_port is not None:
        print(f"OpenAI API: http://127.0.0.1:{args.api_port}/v1")
    print(f"watch it:   kvasir tui --socket {ring.sockets[0]}")
    print("Ctrl-C stops the ring.")
    try:
        while all(p.poll() is None for p in ring.processes):
            time.sleep(0.5)
        print("a node exited; stopping the ring", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
