"""Where control sockets live: a 0700 runtime directory (kvasir.util.dirs), one 0600 socket per node."""

from __future__ import annotations

from pathlib import Path

from kvasir.core.errors import InputError
from kvasir.util.dirs import runtime_dir


def node_socket_path(rank: int, port: int) -> Path:
    return runtime_dir() / f"rank{rank}-{port}.sock"


def find_socket() -> Path:
    """The default node to attach to: the lowest-rank socket in the runtime directory."""
    socks = sorted(runtime_dir().glob("rank*.sock"), key=lambda p: (len(p.name), p.name))
    if not socks:
        raise InputError(f"no running node found in {runtime_dir()} (start one with `kvasir ring up` or pass --socket)")
    return socks[0]
