"""``kvasir relay``: run the relay service."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from kvasir.core.errors import InputError
from kvasir.core.identity import PublicKey
from kvasir.relay.errors import RelayConfigError
from kvasir.util.addr import parse_hostport


def add_parser(subparsers: Any) -> None:
    """Register the ``relay`` subcommand on an ``argparse`` subparsers object."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "relay",
        help="run a relay that links ring neighbours which cannot accept connections",
        description="Pair the two ends of each ring edge over WebSocket and forward their messages.",
    )
    parser.add_argument("--listen", default="127.0.0.1:8443", metavar="HOST:PORT", help="default %(default)s")
    parser.add_argument("--tls-cert", metavar="PEM", help="certificate chain; serve wss:// (needs --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", help="private key for --tls-cert")
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long an end waits alone (%(default)s)",
    )
    parser.add_argument(
        "--trust-key",
        action="append",
        default=[],
        metavar="KEY",
        help="admit edges granted by this operator key (ed25519:...; v2 tokens); repeatable",
    )
    parser.add_argument(
        "--trusted-keys-file", metavar="PATH", help="operator keys to trust, one per line (# comments allowed)"
    )
    # Secrets never on a command line (/proc/*/cmdline is world-readable): the v1 secret comes from a file only.
    parser.add_argument("--secret-file", metavar="PATH", help="file holding a keyless (v1) ring's secret in hex")
    parser.add_argument("--max-message-bytes", type=int, default=None, metavar="N", help="largest message")
    parser.add_argument(
        "--max-conns-per-ip", type=int, default=32, metavar="N", help="per IPv4 /24 or IPv6 /64 (%(default)s)"
    )
    parser.add_argument("--max-connections", type=int, default=1024, metavar="N", help="all addresses (%(default)s)")
    parser.add_argument(
        "--market",
        nargs="?",
        const="127.0.0.1:8480",
        default=None,
        metavar="HOST:PORT",
        help="also run the self-enrollment market in this process (default address %(const)s; https with --tls-cert)",
    )
    parser.add_argument("--db", default="market.sqlite", metavar="PATH", help="the market's database (%(default)s)")
    parser.set_defaults(run=run)


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6addr]:PORT`` for IPv6) into host and port; port 0 picks a free one."""
    try:
        return parse_hostport(text, what=flag, allow_port_zero=True)
    except InputError as exc:
        raise RelayConfigError(str(exc)) from None


def _parse_secret(args: argparse.Namespace) -> bytes | None:
    if args.secret_file is None:
        return None
    try:
        text = Path(args.secret_file).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise RelayConfigError(f"cannot read --secret-file {args.secret_file}: {exc}") from exc
    try:
        return bytes.fromhex(text.strip())
    except ValueError:
        raise RelayConfigError("--secret-file must hold hexadecimal") from None


def _parse_trusted_keys(args: argparse.Namespace) -> frozenset[PublicKey]:
    texts = [(f"--trust-key {k[:20]}", k) for k in args.trust_key]
    if args.trusted_keys_file is not None:
        try:
            lines = Path(args.trusted_keys_file).read_text(encoding="ascii").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise RelayConfigError(f"cannot read --trusted-keys-file {args.trusted_keys_file}: {exc}") from exc
        for n, line in enumerate(lines, 1):
            text = line.partition("#")[0].strip()
            if text:
                texts.append((f"{args.trusted_keys_file}:{n}", text))
    keys = set()
    for where, text in texts:
        try:
            keys.add(PublicKey.from_text(text.strip()))
        except InputError as exc:
            raise RelayConfigError(f"{where}: {exc}") from None
    return frozenset(keys)


def build_config(args: argparse.Namespace) -> Any:
    """The :class:`~kvasir.relay.server.RelayConfig` the parsed arguments describe."""
    from kvasir.relay.server import DEFAULT_MAX_MESSAGE_BYTES, RelayConfig

    host, port = parse_listen(args.listen)
    max_message = DEFAULT_MAX_MESSAGE_BYTES if args.max_message_bytes is None else args.max_message_bytes
    secret, trusted = _parse_secret(args), _parse_trusted_keys(args)
    if getattr(args, "market", None) is not None:
        from kvasir.market.server.service import machine_identity

        # The market beside this relay signs its rings' relay edge grants with this machine's key: trust it.
        trusted |= {machine_identity().public}
    if secret is None and not trusted:
        raise RelayConfigError("name the operator keys to trust (--trust-key, --trusted-keys-file) or --secret-file")
    return RelayConfig(
        secret=secret,
        trusted_keys=trusted,
        host=host,
        port=port,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        wait_timeout=args.wait_timeout,
        max_message_bytes=max_message,
        max_conns_per_ip=args.max_conns_per_ip,
        max_connections=args.max_connections,
    )


def run(args: argparse.Namespace) -> int:
    import trio

    from kvasir.relay.server import serve_relay

    config = build_config(args)
    scheme = "wss" if config.tls_cert else "ws"

    host = f"[{config.host}]" if ":" in config.host else config.host

    class Announce:
        # A task_status rather than a nursery around serve_relay, so a startup error is raised bare and the
        # CLI prints it as one line instead of an exception group.
        def started(self, value: int | None = None) -> None:
            print(f"kvasir relay: listening on {scheme}://{host}:{value}", flush=True)

    if args.market is None:
        trio.run(functools.partial(serve_relay, config, task_status=Announce()))
        return 0
    from kvasir.market.server.service import machine_identity, serve_market

    mhost, mport = parse_listen(args.market, "--market")

    market_identity = machine_identity()  # the key build_config made this relay trust
    # One host, one certificate: with --tls-cert the market beside the relay serves https as the relay serves wss.
    tls = None
    if config.tls_cert:
        from kvasir.util.tls import server_context

        tls = server_context(config.tls_cert, config.tls_key or "")
    mscheme = "https" if tls is not None else "http"

    async def relay_and_market() -> None:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(
                functools.partial(serve_market, Path(args.db), mhost, mport, identity=market_identity, tls=tls)
            )
            print(f"kvasir relay: market on {mscheme}://{mhost}:{bound} (db {args.db})", flush=True)
            relay_port = await nursery.start(functools.partial(serve_relay, config))
            Announce().started(relay_port)

    try:
        trio.run(relay_and_market)
    except BaseExceptionGroup as group:  # one failing service: report it bare (one line, exit 2)
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], Exception):
            raise group.exceptions[0] from None
        raise
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: kvasir relay ... (or python -m kvasir.relay ...)")
