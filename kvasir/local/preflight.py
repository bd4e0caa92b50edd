"""What ``kvasir ring up`` checks before it cuts the model or starts a node: a taken port or a bad key file is one
line naming the address or the file, and nothing was started or written (rather than "rank 0 exited with code 2"
after the split, the cut and every node's start). The model itself is checked where it is first read (its header,
for the split)."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

from kvasir.api.server import ApiAccess
from kvasir.core.errors import InputError


def check_port_free(host: str, port: int, flag: str) -> None:
    """``host:port`` can be listened on now, as a node would (``flag`` names the option that chose it)."""
    if not 1 <= port <= 65535:
        raise InputError(f"{flag} {port}: not a port (1..65535)")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # As trio's listeners do: a port whose last connections linger in TIME_WAIT is free to them.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(1)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(f"{host}:{port} is already in use ({flag})") from None
            raise InputError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}") from None


def check_api_key_file(path: Path) -> None:
    """The API key file is there, not readable by others, and holds keys: what the node would refuse to start with."""
    ApiAccess.from_key_file(path)
