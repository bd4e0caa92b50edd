"""``kvasir market``: run the self-enrollment market, publish a model on it, show its state.

* ``kvasir market --listen HOST:PORT --db market.sqlite [--operator-key KEY]`` serves the market
  (docs/protocol.md § Market API); only the operator (default: this machine's identity) may publish;
* ``kvasir market publish MODEL.gguf --url URL --source URL (--windows A:B,… [--weights …] | --devices FILE)``
  offers a model: its record (identity, sources, byte profile, stage hashes) and its rank manifest, both signed
  with this machine's identity (the operator's);
* ``kvasir market status [--url URL] [--json]`` prints coverage, demand and contributions;
* ``kvasir market fund --db market.sqlite --key KEY --credits N`` adds credits to a client's account (the
  operator: it writes the market's database); ``kvasir market authorize --market-key KEY --model SHA
  --max-tokens N --max-price CREDITS`` signs one paid request's authorisation with this machine's identity (the
  client's), for the API's ``X-Kvasir-Client-Auth`` header (docs/market.md § Credit).
"""

from __future__ import annotations

import argparse
import functools
import ssl
import sys
import time
import unicodedata
from pathlib import Path
from typing import Any

import trio
from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvasir.commands.common import print_json
from kvasir.commands.id import add_identity_argument, identity_from_args
from kvasir.util import addr

DEFAULT_LISTEN = "127.0.0.1:8480"
DEFAULT_URL = "http://127.0.0.1:8480"


def parse_hostport(text: str, flag: str) -> tuple[str, int]:
    """A ``--listen``-style flag: port 0 picks a free port."""
    return addr.parse_hostport(text, what=flag, allow_port_zero=True)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("market", help="run the self-enrollment market (or: market publish | status | fund | authorize)")
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT", help="default %(default)s")
    p.add_argument("--db", type=Path, default=Path("market.sqlite"), help="SQLite database (default %(default)s)")
    p.add_argument(
        "--operator-key",
        default=None,
        metavar="KEY",
        help="the key (ed25519:…) whose signature publishing needs (default: this machine's identity)",
    )
    p.add_argument(
        "--judge-stages",
        type=Path,
        default=None,
        metavar="DIR",
        help="stage files the market re-executes fraud proofs on (default: act only on the operator's proofs)",
    )
    p.add_argument(
        "--serve-deadline",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a claim has to serve and be vouched for by its neighbour before other claims may take it "
        "(0: off; default %(default)s)",
    )
    p.add_argument(
        "--work-bits",
        type=int,
        default=0,
        metavar="N",
        help="proof of work (bits) a new key must show before its first claim, 0-32 (0: none; default %(default)s)",
    )
    p.add_argument(
        "--no-claim-limits",
        action="store_true",
        help="no rate limits on claims and admissions per key and address (benchmarks of many nodes on one host)",
    )
    add_tls_arguments(p, "serve https:// (needs --tls-key)")
    add_identity_argument(p)
    p.set_defaults(run=run_serve)
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    st = actions.add_parser("status", help="print coverage, demand and contributions")
    st.add_argument("--url", default=DEFAULT_URL, help="market URL (default %(default)s)")
    add_ca_argument(st)
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
    add_ca_argument(pub)
    pub.add_argument(
        "--probes",
        action="store_true",
        help="run each window's probe and record its hash, so nodes of this machine's kernel class must reproduce it",
    )
    add_identity_argument(pub)
    pub.set_defaults(run=run_publish)
    fund = actions.add_parser("fund", help="add credits to a client's account (the operator, on the market's database)")
    fund.add_argument("--db", type=Path, default=Path("market.sqlite"), help="SQLite database (default %(default)s)")
    fund.add_argument("--key", required=True, metavar="KEY", help="the client's public key (ed25519:…)")
    fund.add_argument("--credits", required=True, metavar="N", help="credits to add (decimal, to 1e-6)")
    fund.set_defaults(run=run_fund)
    pay = actions.add_parser("authorize", help="sign a client authorisation for one paid request (prints it)")
    pay.add_argument("--market-key", required=True, metavar="KEY", help="the market's key (ed25519:…)")
    pay.add_argument("--model", required=True, metavar="SHA256", help="the model's sha256")
    pay.add_argument("--max-tokens", type=int, required=True, metavar="N", help="tokens it pays for at most")
    pay.add_argument("--max-price", required=True, metavar="CREDITS", help="credits per token at most")
    pay.add_argument("--ttl", type=float, default=600.0, metavar="S", help="valid for (default %(default)s s)")
    add_identity_argument(pay)
    pay.set_defaults(run=run_authorize)


def add_tls_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``--tls-cert``/``--tls-key``, as ``kvasir relay`` has them."""
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM", help=f"certificate chain; {what}")
    p.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="private key for --tls-cert")


def server_tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The server's TLS context from ``--tls-cert``/``--tls-key`` (None: plain HTTP)."""
    from kvasir.core.errors import InputError
    from kvasir.util.tls import server_context

    if (args.tls_cert is None) != (args.tls_key is None):
        raise InputError("--tls-cert and --tls-key go together")
    return None if args.tls_cert is None else server_context(args.tls_cert, args.tls_key)


def add_ca_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--market-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="CA certificates (PEM bundle) trusted besides the system's, for an https:// market",
    )


def run_serve(args: argparse.Namespace) -> int:
    from kvasir.core.errors import InputError
    from kvasir.core.identity import PublicKey
    from kvasir.market.server.clock import MarketClock, wall_clock_from_env
    from kvasir.market.server.gate import ClaimGate
    from kvasir.market.server.ratelimit import ClaimLimits
    from kvasir.market.server.service import serve_market
    from kvasir.market.server.standing import LeaseRules
    from kvasir.market.server.store import MarketStore
    from kvasir.market.work import MAX_WORK_BITS

    host, port = parse_hostport(args.listen, "--listen")
    if not 0 <= args.work_bits <= MAX_WORK_BITS:
        raise InputError(f"--work-bits must be 0..{MAX_WORK_BITS}, not {args.work_bits}")
    if not 0 <= args.serve_deadline <= 86_400:  # also refuses nan
        raise InputError(f"--serve-deadline must be 0..86400 seconds, not {args.serve_deadline}")
    tls = server_tls(args)
    scheme = "https" if tls is not None else "http"
    identity = identity_from_args(args)
    operator = PublicKey.from_text(args.operator_key) if args.operator_key else identity.public

    class Announce:
        def started(self, value: int | None = None) -> None:
            print(
                f"kvasir market: listening on {scheme}://{host}:{value} (db {args.db}), operator {operator.to_text()}"
                f" (fingerprint {operator.fingerprint})",
                flush=True,
            )

    judge = None
    if args.judge_stages is not None:
        from kvasir.market.server.fraud import StageJudge

        judge = StageJudge(args.judge_stages)
        print(f"kvasir market: judging fraud proofs on {len(judge.stages)} stage file(s)", flush=True)
    # Market time: the host's clock read at start, then monotonic (kvasir.market.server.clock); the wall clock
    # it starts from may be skewed by the KVASIR_MARKET_WALL_SKEW_FILE test hook.
    rules = LeaseRules(serve_deadline_s=args.serve_deadline)
    limits = ClaimLimits.off() if args.no_claim_limits else ClaimLimits()
    store = MarketStore(args.db, wall=wall_clock_from_env(), rules=rules)
    if isinstance(store.clock, MarketClock) and store.clock.behind_at_start > 1:
        print(
            f"kvasir market: this host's clock is {store.clock.behind_at_start:.0f} s behind the market's last time;"
            " market time carries on from there (it never runs backwards)",
            file=sys.stderr,
            flush=True,
        )
    serve = functools.partial(
        serve_market,
        args.db,
        host,
        port,
        store=store,
        identity=identity,
        operator=operator,
        tls=tls,
        judge=judge,
        gate=lambda market: ClaimGate(market.public.to_text(), args.work_bits, limits),
        task_status=Announce(),
    )
    try:
        trio.run(serve)
    finally:
        store.close()
    return 0


def run_publish(args: argparse.Namespace) -> int:
    from kvasir.market.agent.client import MarketClient
    from kvasir.market.agent.publish import manifest_record, model_record, parse_windows, planner_windows
    from kvasir.shard.cache import default_cache_dir

    if args.devices is not None:
        windows, origin = planner_windows(args.model, args.devices), "planner"
    else:
        windows, origin = parse_windows(args.windows, args.weights), "explicit"
    from kvasir.market.agent.publish import publish_signed
    from kvasir.util.tls import client_context

    identity = identity_from_args(args)
    record = model_record(args.model, windows, args.source, default_cache_dir(), args.name, probes=args.probes)
    record = record.signed(identity)

    async def publish() -> None:
        async with MarketClient(args.url, identity=identity, tls=client_context(args.market_ca)) as market:
            await publish_signed(market, identity, record, manifest_record(record, windows, origin))

    trio.run(publish)
    print(f"published {record.name} ({record.sha256[:12]}…): {len(windows)} windows ({origin}) on {args.url}")
    return 0


def micro_credits(text: str, flag: str) -> int:
    """``--credits``-style text as micro-credits, exactly; InputError for anything but a non-negative decimal."""
    from decimal import Decimal, InvalidOperation

    from kvasir.core.clientauth import MICRO
    from kvasir.core.errors import InputError

    try:
        value = Decimal(text) * MICRO
    except InvalidOperation:
        raise InputError(f"{flag} must be a decimal number, not {text[:40]!r}") from None
    if not value.is_finite() or value < 0 or value != value.to_integral_value() or value > 10**18:
        raise InputError(f"{flag} must be 0-10^12 credits in steps of 0.000001")
    return int(value)


def run_fund(args: argparse.Namespace) -> int:
    """Fund an account on the market's database directly (SQLite takes turns with a running market): only who can
    write the database (the operator) mints credit."""
    from kvasir.core.errors import InputError
    from kvasir.market.server.accounts import AccountBook
    from kvasir.market.server.sqlite import Database

    micro = micro_credits(args.credits, "--credits")
    if not args.db.is_file():
        raise InputError(f"{args.db}: no market database there")
    db = Database(args.db, resume=False)
    try:
        account = AccountBook(db).fund(args.key, micro)
    finally:
        db.close()
    print_json(account)
    return 0


def run_authorize(args: argparse.Namespace) -> int:
    from kvasir.core.clientauth import sign_auth
    from kvasir.core.identity import PublicKey

    token = sign_auth(
        identity_from_args(args),
        PublicKey.from_text(args.market_key),
        args.model,
        max_tokens=args.max_tokens,
        max_price=micro_credits(args.max_price, "--max-price"),
        not_after=int(time.time() + args.ttl),
    )
    print(token)
    return 0


def run_status(args: argparse.Namespace) -> int:
    from kvasir.market.agent.client import MarketClient
    from kvasir.util.tls import client_context

    async def fetch() -> dict[str, Any]:
        async with MarketClient(args.url, tls=client_context(args.market_ca)) as market:
            return await market.status()

    st = trio.run(fetch)
    if args.json:
        print_json(st)
        return 0
    try:
        print_status(st, Console())
    except (KeyError, TypeError, IndexError, AttributeError) as exc:  # a reply not shaped like a market's
        from kvasir.core.errors import InputError

        raise InputError(f"market {args.url}: malformed status reply ({type(exc).__name__})") from None
    return 0


def shown(value: object, limit: int = 120, style: str = "") -> Text:
    """A value from the network as plain text for the terminal (pure): never markup, emoji codes or control
    characters (escape sequences, carriage returns, bidi overrides are shown as ``\\x1b``, ``\\u202e``), and cut
    to ``limit`` characters."""
    text = str(value)
    out = "".join(
        ch if unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp") else ascii(ch)[1:-1]
        for ch in text[: limit + 1]
    )
    return Text(out[:limit] + ("…" if len(out) > limit else ""), style)


def _num(value: object, spec: str) -> Text:
    """A number formatted with ``spec``, or (a hostile market sent something else) the value shown safely."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Text(format(value, spec))
    return shown(value, 24)


def print_status(st: dict[str, Any], c: Console) -> None:
    """Print a market's status. Every string in it comes from the network (model names, node ids, endpoints are
    chosen by whoever publishes or claims), so each is shown as plain text: nothing in it can style, link, move
    the cursor or rewrite what the terminal shows."""
    now = st["coverage"]["now"]
    for m in st["coverage"]["models"]:
        state = Text("live", "green") if m["live"] else Text("not live", "yellow")
        covered = Text.assemble(_num(m["covered"], "d"), "/", _num(m["windows_total"], "d"))
        c.print(
            Text.assemble(
                shown(m["name"], style="bold"), " ", shown(str(m["model"])[:12]), "… — ", covered, " windows covered, ",
                state,
            )
        )  # fmt: skip
        t = Table("rank", "layers", "bytes", "reward", "holder", "state", "endpoint", "lease left")
        for w in m["windows"]:
            expires = w["lease_expires"]
            left = (
                _num(expires - now, ".0f") + " s"
                if isinstance(expires, int | float) and isinstance(now, int | float)
                else Text("-")
            )
            layers = w["layers"]
            state = shown(w["state"] or "-")
            if w.get("claimable") is True:  # overdue: no neighbour vouched in time (docs/market.md)
                state = Text.assemble(state, Text(" (claimable)", "yellow"))
            t.add_row(
                _num(w["rank"], "d"),
                Text.assemble(_num(layers[0], "d"), ":", _num(layers[1], "d")),
                _num(w["bytes"], ","),
                _num(w["reward"], ".3g"),
                shown(w["holder"]) if w["holder"] else Text("uncovered", "red"),
                state,
                shown(w["endpoint"] or "-"),
                left,
            )
        c.print(t)
    d = st["demand"]
    title = Text.assemble("demand (last ", _num(d["horizon_s"], ".0f"), " s)")
    t = Table("model", "requests", "tokens", "reward multiplier", title=title)
    for m in d["models"]:
        t.add_row(shown(m["name"]), _num(m["requests"], "d"), _num(m["tokens"], "d"), _num(m["multiplier"], ".3f"))
    c.print(t)
    t = Table("node", "tokens", "tokens × layers", "earned", "confirmed by", "last credit", title="contributions")
    for n in st["ledger"]["nodes"]:
        last = n["last"]
        ago = _num(time.time() - last, ".0f") + " s ago" if isinstance(last, int | float) and last else Text("-")
        witnesses = n.get("confirmed_by") or {}
        by = ", ".join(f"{k}: {v}" for k, v in witnesses.items()) if isinstance(witnesses, dict) else witnesses
        t.add_row(
            shown(n["node_id"]),
            _num(n["tokens"], "d"),
            _num(n["layer_tokens"], "d"),
            _num(n["earned"], ".3f"),
            shown(by or "-"),
            ago,
        )
    c.print(t)
