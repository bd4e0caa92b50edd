"""Market load benchmark: simulated enrolling nodes against a real ``kvasir market`` process on loopback.

Run: ``python bench/market_load.py`` (defaults: 1000 nodes on 10 models of 8 one-layer windows, 60 s of load after
a 40 s ramp; about two and a half minutes). Each node has its own Ed25519 key and signs its claims and renewals
through the real client (kvasir/market/agent/client.py); the market runs in its own process on its own SQLite file,
so its CPU seconds and peak RSS are its own. A baseline of a few nodes runs first on the same market, in the same run.

The run fails (exit 1) if two leases on one window ever overlapped, if the market's database disagrees with what
the nodes were told, or if any request went unanswered.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs
import trio

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)

from kvasir.core.identity import load_or_create_identity  # noqa: E402
from tests.harness.marketload import (  # noqa: E402
    LoadConfig,
    double_holders,
    drive,
    process_cpu_s,
    process_peak_rss,
    publish,
    store_disagreements,
    summary,
)


def start_market(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    p = subprocess.Popen(
        [sys.executable, "-m", "kvasir", "market", "--listen", "127.0.0.1:0", "--db", str(tmp / "m.sqlite"),
         "--identity", str(tmp / "operator.pem"), "--create-identity", "--no-claim-limits"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline()
    if "listening on " not in line:
        p.kill()
        raise SystemExit(f"the market did not start: {line!r}")
    return p, line.split("listening on ", 1)[1].split()[0]


def phase(url: str, cfg: LoadConfig, pid: int, db: Path) -> dict[str, Any]:
    cpu0, t0 = process_cpu_s(pid), time.monotonic()
    tally = trio.run(drive, url, cfg)
    wall = time.monotonic() - t0
    out = summary(tally)
    out["store_disagreements"] = len(store_disagreements(db, tally.grants, time.time()))
    out["market_cpu_s"] = process_cpu_s(pid) - cpu0
    out["requests"] = len(tally.claim_s) + len(tally.renew_s) + len(tally.poll_s) + len(tally.map_s)
    out["wall_s"] = wall
    out["overlaps"] = [str(p) for p in double_holders(tally.grants)[:3]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--models", type=int, default=10)
    ap.add_argument("--windows", type=int, default=8, help="windows per model")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load after the ramp")
    ap.add_argument("--ramp", type=float, default=40.0, help="nodes start spread over this many seconds")
    ap.add_argument("--lease", type=float, default=30.0)
    ap.add_argument("--poll", type=float, default=5.0, help="a holder's poll of its model's map (s)")
    ap.add_argument("--spare-poll", type=float, default=60.0, help="a spare's poll of the whole map (s)")
    ap.add_argument("--drop", type=float, default=0.05, help="chance a holder goes silent at a renewal")
    ap.add_argument("--connections", type=int, default=24, help="requests in flight at most")
    ap.add_argument("--baseline-nodes", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load = LoadConfig(args.nodes, args.models, args.windows, args.duration, args.ramp, args.lease, args.poll,
                      args.spare_poll, args.drop, args.connections)  # fmt: skip
    # The baseline: a few nodes on the same market, short leases so the map is empty again soon after.
    base = attrs.evolve(load, nodes=args.baseline_nodes, duration_s=10.0, ramp_s=1.0, connections=8, seed=2,
                        lease_s=min(args.lease, 5.0), poll_s=1.0, spare_poll_s=1.0)  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        operator = load_or_create_identity(tmp / "operator.pem")
        market, url = start_market(tmp)
        try:
            trio.run(publish, url, operator, args.windows, args.models)
            rows = {"baseline": phase(url, base, market.pid, tmp / "m.sqlite")}
            time.sleep(base.lease_s + 1)  # the baseline's leases run out: the load starts on an empty map
            rows["load"] = phase(url, load, market.pid, tmp / "m.sqlite")
            peak = process_peak_rss(market.pid)
        finally:
            market.kill()
            market.wait()
    if args.json:
        print(json.dumps({"rows": rows, "market_peak_rss": peak, "config": vars(args)}, indent=1))
    else:
        print(f"market load: {args.models} models x {args.windows} windows, lease {args.lease} s, holder poll"
              f" {args.poll} s, spare poll {args.spare_poll} s, drop {args.drop}, {args.connections} connections;"
              f" market peak RSS {peak / 2**20:.1f} MiB")  # fmt: skip
        print("latencies in ms, p50/p99 (n)")
        print(f"{'run':9} {'nodes':>5} {'wall s':>6} {'claims (won)':>13} {'claim':>22} {'renewal':>22}"
              f" {'holder poll':>22} {'spare poll (map)':>22} {'slot wait':>22} {'lost':>4} {'drops':>5} {'req/s':>6}"
              f" {'mkt cpu s':>9} {'ms/req':>6} {'errors':>6}"
              f" {'overlaps':>8} {'store diff':>10}")  # fmt: skip

        def lat(x: dict[str, Any]) -> str:
            return f"{x['p50_ms']:.1f}/{x['p99_ms']:.1f} ({x['n']})"

        for name, r in rows.items():
            n = args.nodes if name == "load" else args.baseline_nodes
            c = r["claims"]
            print(
                f"{name:9} {n:5d} {r['wall_s']:6.1f} {c['n']:7d} ({c['won']:4d}) {lat(c):>22} {lat(r['renewals']):>22}"
                f" {lat(r['holder_polls']):>22} {lat(r['spare_polls']):>22} {lat(r['slot_wait']):>22}"
                f" {r['renewals']['lost']:4d} {r['drops']:5d} {r['requests'] / r['wall_s']:6.1f}"
                f" {r['market_cpu_s']:9.1f}"
                f" {1000 * r['market_cpu_s'] / max(1, r['requests']):6.2f} {r['errors']:6d} {r['double_holders']:8d}"
                f" {r['store_disagreements']:10d}"
            )
        for name, r in rows.items():
            if r["first_errors"] or r["overlaps"]:
                print(f"{name}: {r['first_errors']} {r['overlaps']}")
    bad = any(r["errors"] or r["double_holders"] or r["store_disagreements"] for r in rows.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
