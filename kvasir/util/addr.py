"""The one ``HOST:PORT`` parser: CLI flags, manifests, market endpoints and the relay all split addresses here.

IPv6 hosts go in brackets (``[::1]:7100``); an unbracketed host with a colon is refused rather than guessed at.
Port 0 ("any free port") is only valid where a socket is about to listen, so callers opt in with
``allow_port_zero``.
"""

from __future__ import annotations

from kvasir.core.errors import InputError

MAX_PORT = 65535


def parse_hostport(text: object, *, what: str = "address", allow_port_zero: bool = False) -> tuple[str, int]:
    """``(host, port)`` from ``HOST:PORT`` or ``[V6]:PORT``; the host comes back without brackets.

    Raises :class:`InputError` whose message starts with ``what`` (a flag or a field path).
    """
    if not isinstance(text, str):
        raise InputError(f"{what} must be HOST:PORT, got {text!r}")
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or not rest.startswith(":"):
            raise InputError(f"{what} must be HOST:PORT or [IPV6]:PORT, got {text!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise InputError(f"{what} must be HOST:PORT, got {text!r}")
        if ":" in host:
            raise InputError(f"{what}: an IPv6 host goes in brackets, [{host}]:{port_text}")
    if not host or any(c.isspace() for c in host):
        raise InputError(f"{what} must be HOST:PORT, got {text!r}")
    # isdigit() alone would pass "²"; ASCII digits only, and no sign or spaces that int() accepts.
    if not (port_text.isascii() and port_text.isdigit()):
        raise InputError(f"{what}: bad port in {text!r}")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port <= MAX_PORT:
        raise InputError(f"{what}: port {port} out of range [{low}, {MAX_PORT}]")
    return host, port


def format_hostport(host: str, port: int) -> str:
    """The inverse of :func:`parse_hostport`: brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
