"""``kvasir tui [--socket PATH]``: a terminal UI attached to a running node's control socket."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvasir.control.paths import find_socket
from kvasir.core.errors import InputError

if TYPE_CHECKING:
    from kvasir.tui.source import SocketSource


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tui", help="watch a running node (coverage, ring, links, tokens) and chat with the ring")
    p.add_argument("--socket", type=Path, default=None, help="control socket (default: the local node's)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between status snapshots (default 1)")
    p.add_argument("--light", action="store_true", help="start with the light theme")
    g = p.add_argument_group("chat sampling (also changeable in the TUI: F5)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send prompts as they are, without the chat template")
    p.set_defaults(run=run)


def socket_source(socket: Path | None) -> SocketSource:
    """``--socket PATH``: that path, always. None: the local node's socket (find_socket), found again at each
    reconnect, so the TUI follows a ``ring up`` restarted on new ports (new socket names)."""
    from kvasir.tui.source import SocketSource

    if socket is not None:
        return SocketSource(socket)
    return SocketSource(find_socket(), find=find_socket)


def run(args: argparse.Namespace) -> int:
    source = socket_source(args.socket)  # no node at all: a one-line error now, not a TUI that waits
    if args.max_tokens < 1:
        raise InputError("--max-tokens must be at least 1")
    if not 0.1 <= args.interval <= 10:
        raise InputError("--interval must be between 0.1 and 10 seconds")
    from kvasir.tui.app import KvasirTUI
    from kvasir.tui.screens import Sampling

    sampling = Sampling(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        chat=not args.raw,
    )
    KvasirTUI(source, sampling=sampling, interval=args.interval, dark=not args.light).run()
    return 0
