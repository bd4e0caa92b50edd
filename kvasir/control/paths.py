"""Where control sockets live: a 0700 runtime directory, one 0600 socket per node."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvasir.errors import InputError


def runtime_dir() -> Path:
    """``$XDG_RUNTIME_DIR/kvasir`` or ``/tmp/kvasir-$UID``, created 0700 and checked to be ours."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    d = Path(base) / "kvasir" if base else Path(f"/tmp/kvasir-{os.getuid()}")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise InputError(f"{d}: runtime directory must be owned by you with mode 0700")
    return d


def node_socket_path(rank: int, port: int) -> Path:
    return runtime_dir() / f"rank{rank}-{port}.sock"


def find_socket() -> Path:
    """The default node to attach to: the lowest-rank socket in the runtime directory."""
    socks = sorted(runtime_dir().glob("rank*.sock"), key=lambda p: (len(p.name), p.name))
    if not socks:
        raise InputError(f"no running node found in {runtime_dir()} (start one with `kvasir ring up` or pass --socket)")
    return socks[0]
