"""``kvasir market``: run the self-enrollment market, publish a model on it, show its state.

* ``kvasir market --listen HOST:PORT --db market.sqlite [--operator-key KEY]`` serves the market
  (docs/protocol.md § Market API); only the operator (default: this machine's identity) may publish;
* ``kvasir market publish MODEL.gguf --url URL --source URL (--windows A:B,… [--weights …] | --devices FILE)``
  offers a model: its record (identity, sources, byte profile, stage hashes) and its rank manifest, both signed
  with this machine's identity (the operator's);
* ``kvasir market status [--url URL] [--json]`` prints coverage, demand and contributions.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvasir.commands.common import print_json
from kvasir.commands.id import add_identity_argument, default_identity_path
from kvasir.util import addr

DEFAULT_LISTEN = "127.0.0.1:8480"
DEFAULT_URL = "http://127.0.0.1:8480"


def parse_hostport(text: str, flag: str) -> tuple[str, int]:
    """A ``--listen``-style flag: port 0 picks a free port."""
    return addr.parse_hostport(text, what=flag, allow_port_zero=True)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("market", help="run the self-enrollment market (or: market publish | market status)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT", help="default %(default)s")
    p.add_argument("--db", type=Path, default=Path("market.sqlite"), help="SQLite database (default %(default)s)")
    p.add_argument(
        "--operator-key",
        default=None,
        metavar="KEY",
        help="the key (ed25519:…) whose signature publishing needs (default: this machine's identity)",
    )
    add_identity_argument(p)
    p.set_defaults(run=run_serve)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    st = actions.add_parser("status", help="print coverage, demand and contributions")
    st.add_argument("--url", default=DEFAULT_URL, help="market URL (default %(default)s)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(run=run_status)
    pub = actions.add_parser("publish", help="offer a model: its record and rank manifest")
    pub.add_argument("model", type=Path, metavar="MODEL.gguf")
    pub.add_argument("--url", default=DEFAULT_URL, help="market URL (default %(default)s)")
    pub.add_argument("--source", action="append", required=True, help="URL serving the GGUF with Range (repeatable)")
    pub.add_argument("--name", default=None)
    how = pub.add_mutually_exclusive_group(required=True)
    how.add_argument("--windows", metavar="A:B,B:C,…", help="explicit windows")
    how.add_argument("--devices", type=Path, metavar="devices.toml", help="windows from the planner for this fleet")
    pub.add_argument("--weights", default=None, metavar="W,W,…", help="reward weights of --windows (default 1 each)")
    pub.add_argument(
        "--probes",
        action="store_true",
        help="run each window's probe and record its hash, so nodes of this machine's kernel class must reproduce it",
    )
    add_identity_argument(pub)
    pub.set_defaults(run=run_publish)


def run_serve(args: argparse.Namespace) -> int:
    from kvasir.core.identity import PublicKey, load_or_create_identity
    from kvasir.market.server.service import serve_market

    host, port = parse_hostport(args.listen, "--listen")
    identity = load_or_create_identity(args.identity or default_identity_path())
    operator = PublicKey.from_text(args.operator_key) if args.operator_key else identity.public

    class Announce:
        def started(self, value: int | None = None) -> None:
            print(
                f"kvasir market: listening on http://{host}:{value} (db {args.db}), operator {operator.to_text()}"
                f" (fingerprint {operator.fingerprint})",
                flush=True,
            )

    serve = functools.partial(
        serve_market, args.db, host, port, identity=identity, operator=operator, task_status=Announce()
    )
    trio.run(serve)
    return 0


def run_publish(args: argparse.Namespace) -> int:
    from kvasir.market.agent.client import MarketClient
    from kvasir.market.agent.publish import manifest_record, model_record, parse_windows, planner_windows
    from kvasir.shard.cache import default_cache_dir

    if args.devices is not None:
        windows, origin = planner_windows(args.model, args.devices), "planner"
    else:
        windows, origin = parse_windows(args.windows, args.weights), "explicit"
    from kvasir.core.identity import load_or_create_identity
    from kvasir.market.agent.publish import publish_signed

    identity = load_or_create_identity(args.identity or default_identity_path())
    record = model_record(args.model, windows, args.source, default_cache_dir(), args.name, probes=args.probes)
    record = record.signed(identity)

    async def publish() -> None:
        async with MarketClient(args.url, identity=identity) as market:
            await publish_signed(market, identity, record, manifest_record(record, windows, origin))

    trio.run(publish)
    print(f"published {record.name} ({record.sha256[:12]}…): {len(windows)} windows ({origin}) on {args.url}")
    return 0


def run_status(args: argparse.Namespace) -> int:
    from kvasir.market.agent.client import MarketClient

    async def fetch() -> dict[str, Any]:
        async with MarketClient(args.url) as market:
            return await market.status()

    st = trio.run(fetch)
    if args.json:
        print_json(st)
        return 0
    print_status(st, Console())
    return 0


def print_status(st: dict[str, Any], c: Console) -> None:
    now = st["coverage"]["now"]
    for m in st["coverage"]["models"]:
        state = "[green]live[/]" if m["live"] else "[yellow]not live[/]"
        c.print(
            f"[bold]{escape(str(m['name']))}[/] {escape(str(m['model'])[:12])}… — {m['covered']}/{m['windows_total']}"
            f" windows covered, {state}"
        )
        t = Table("rank", "layers", "bytes", "reward", "holder", "state", "endpoint", "lease left")
        for w in m["windows"]:
            left = f"{w['lease_expires'] - now:.0f} s" if w["lease_expires"] else "-"
            t.add_row(
                str(w["rank"]),
                f"{w['layers'][0]}:{w['layers'][1]}",
                f"{w['bytes']:,}",
                f"{w['reward']:.3g}",
                escape(str(w["holder"])) if w["holder"] else "[red]uncovered[/]",
                escape(str(w["state"] or "-")),
                escape(str(w["endpoint"] or "-")),
                left,
            )
        c.print(t)
    d = st["demand"]
    t = Table("model", "requests", "tokens", "reward multiplier", title=f"demand (last {d['horizon_s']:.0f} s)")
    for m in d["models"]:
        t.add_row(escape(str(m["name"])), str(m["requests"]), str(m["tokens"]), f"{m['multiplier']:.3f}")
    c.print(t)
    t = Table("node", "tokens", "tokens × layers", "earned", "last credit", title="contributions")
    for n in st["ledger"]["nodes"]:
        ago = f"{time.time() - n['last']:.0f} s ago" if n["last"] else "-"
        t.add_row(escape(str(n["node_id"])), str(n["tokens"]), str(n["layer_tokens"]), f"{n['earned']:.3f}", ago)
    c.print(t)
