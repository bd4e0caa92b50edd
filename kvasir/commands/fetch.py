"""``kvasir fetch-window SOURCE --layers A:B -o STAGE.gguf [--sha256 HASH]`` and ``kvasir serve-model FILE``.

fetch-window downloads only the header and the window's tensors with HTTP Range requests and writes the stage
file ``kvasir slice`` would (byte-identical); serve-model seeds a GGUF with Range support so any node can serve it.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

from kvasir.commands.common import print_window_result
from kvasir.commands.market import add_tls_arguments, parse_hostport, server_tls
from kvasir.commands.slice import parse_window
from kvasir.util.cli import run_trio, serve_announced


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fetch-window", help="download one layer window of a GGUF by HTTP Range requests")
    p.add_argument("source", metavar="SOURCE", help="URL of the whole GGUF (any HTTP server that honours Range)")
    p.add_argument("--layers", required=True, metavar="A:B", help="layer window [A, B)")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="STAGE.gguf")
    p.add_argument("--sha256", default=None, metavar="HASH", help="expected sha256 of the stage file")
    p.add_argument(
        "--model-sha256",
        default=None,
        metavar="HASH",
        help="the whole model's sha256, recorded in the stage (default: the source's ETag when it is a sha256)",
    )
    p.add_argument(
        "--ca", type=Path, default=None, metavar="PEM", help="CA certificates trusted besides the system's (https)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run_fetch)

    s = sub.add_parser("serve-model", help="serve a GGUF over HTTP with Range support (seed a model)")
    s.add_argument("file", type=Path, metavar="FILE")
    s.add_argument("--listen", default="127.0.0.1:8490", metavar="HOST:PORT", help="default %(default)s")
    add_tls_arguments(s, "serve https:// (needs --tls-key)")
    s.set_defaults(run=run_serve_model)


def run_fetch(args: argparse.Namespace) -> int:
    from kvasir.shard.fetch import fetch_window
    from kvasir.util.progress import byte_bar
    from kvasir.util.tls import client_context

    a, b = parse_window(args.layers)
    with byte_bar(f"layers {a}:{b}") as progress:  # on stderr, and only when it is a terminal
        res = run_trio(
            functools.partial(
                fetch_window,
                args.source,
                a,
                b,
                args.output,
                sha256=args.sha256,
                model_sha256=args.model_sha256,
                progress=progress,
                tls=client_context(args.ca),
            )
        )
    fields = {
        "bytes_fetched": res.bytes_fetched,
        "header_bytes": res.header_bytes,
        "window_bytes": res.window_bytes,
        "resumed_bytes": res.resumed_bytes,
        "stage_bytes": res.stage_bytes,
        "source_bytes": res.source_bytes,
        "sha256": res.sha256,
        "seconds": round(res.seconds, 3),
    }
    print_window_result(
        args.json,
        res.path,
        (a, b),
        fields,
        f"fetched {res.bytes_fetched:,} bytes of the source's {res.source_bytes:,}"
        f" (header {res.header_bytes:,} + window {res.window_bytes:,}), sha256 {res.sha256}",
    )
    return 0


def run_serve_model(args: argparse.Namespace) -> int:
    from kvasir.net.seed import serve_model
    from kvasir.shard.cache import default_cache_dir, model_sha256
    from kvasir.shard.gguf_file import describe

    host, port = parse_hostport(args.listen, "--listen")
    tls = server_tls(args)
    describe(args.file)  # refuse a file that is not a GGUF
    sha = model_sha256(args.file, default_cache_dir())
    scheme = "https" if tls is not None else "http"

    def announce(bound: int) -> None:
        print(f"kvasir serve-model: serving {scheme}://{host}:{bound}/{args.file.name} (sha256 {sha})", flush=True)

    run_trio(serve_announced, functools.partial(serve_model, args.file, sha, host, port, tls=tls), announce)
    return 0
