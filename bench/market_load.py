"""Market load benchmark: simulated enrolling nodes against a real ``kvasir market`` process on loopback.

Run: ``python bench/market_load.py`` (defaults: 1000 nodes, 250 one-layer windows, 60 s of load after a 20 s ramp;
about two minutes). Each node has its own Ed25519 key and signs its claims and renewals through the real client
(kvasir/market/agent/client.py); the market runs in its own process on its own SQLite file, so its CPU seconds and
peak RSS are its own. A baseline of a few nodes runs first on the same market, in the same run.

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

import trio

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)

from kvasir.core.identity import load_or_create_identity  # noqa: E402
from kvasir.testing.marketload import (  # noqa: E402
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
         "--identity", str(tmp / "operator.pem")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline()
    if "listening on " not in line:
        p.kill()
        raise SystemExit(f"the market did not start: {line!r}")
    return p, line.split("listening on ", 1)[1].split()[0]


def phase(url: str, model: str, cfg: LoadConfig, pid: int, db: Path) -> dict[str, Any]:
    cpu0, t0 = process_cpu_s(pid), time.monotonic()
    tally = trio.run(drive, url, model, cfg)
    wall = time.monotonic() - t0
    out = summary(tally)
    out["store_disagreements"] = len(store_disagreements(db, model, tally.grants, time.time()))
    out["market_cpu_s"] = process_cpu_s(pid) - cpu0
    out["wall_s"] = wall
    out["overlaps"] = [str(p) for p in double_holders(tally.grants)[:3]]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--windows", type=int, default=250)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load after the ramp")
    ap.add_argument("--ramp", type=float, default=20.0, help="nodes start spread over this many seconds")
    ap.add_argument("--lease", type=float, default=10.0)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--drop", type=float, default=0.02, help="chance a holder goes silent at a renewal")
    ap.add_argument("--connections", type=int, default=64, help="requests in flight at most")
    ap.add_argument("--baseline-nodes", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    load = LoadConfig(args.nodes, args.windows, args.duration, args.ramp, args.lease, args.poll, args.drop,
                      args.connections)  # fmt: skip
    base = LoadConfig(args.baseline_nodes, args.windows, 10.0, 1.0, args.lease, args.poll, args.drop, 8, seed=2)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        operator = load_or_create_identity(tmp / "operator.pem")
        market, url = start_market(tmp)
        try:
            model = trio.run(publish, url, operator, args.windows)
            rows = {"baseline": phase(url, model, base, market.pid, tmp / "m.sqlite")}
            time.sleep(args.lease * 1.5)  # the baseline's leases run out: the load starts on an empty map
            rows["load"] = phase(url, model, load, market.pid, tmp / "m.sqlite")
            peak = process_peak_rss(market.pid)
        finally:
            market.kill()
            market.wait()
    if args.json:
        print(json.dumps({"rows": rows, "market_peak_rss": peak, "config": vars(args)}, indent=1))
    else:
        print(f"market load: {args.windows} windows, lease {args.lease} s, poll {args.poll} s, drop {args.drop},"
              f" {args.connections} connections; market peak RSS {peak / 2**20:.1f} MiB")  # fmt: skip
        head = (f"{'run':9} {'nodes':>5} {'wall s':>6} {'claims':>7} {'won':>5} {'claim p50/p99 ms':>17}"
                f" {'renews':>6} {'renew p50/p99 ms':>17} {'polls':>6} {'poll p50/p99 ms':>16} {'mkt cpu s':>9}"
                f" {'errors':>6} {'overlaps':>8} {'store diff':>10}")  # fmt: skip
        print(head)
        for name, r in rows.items():
            n = args.nodes if name == "load" else args.baseline_nodes
            c, rn, p = r["claims"], r["renewals"], r["coverage_polls"]
            print(
                f"{name:9} {n:5d} {r['wall_s']:6.1f} {c['n']:7d} {c['won']:5d}"
                f" {c['p50_ms']:8.1f}/{c['p99_ms']:<8.1f} {rn['n']:6d} {rn['p50_ms']:8.1f}/{rn['p99_ms']:<8.1f}"
                f" {p['n']:6d} {p['p50_ms']:7.1f}/{p['p99_ms']:<8.1f} {r['market_cpu_s']:9.1f}"
                f" {r['errors']:6d} {r['double_holders']:8d} {r['store_disagreements']:10d}"
            )
        for name, r in rows.items():
            if r["first_errors"] or r["overlaps"]:
                print(f"{name}: {r['first_errors']} {r['overlaps']}")
    bad = any(r["errors"] or r["double_holders"] or r["store_disagreements"] for r in rows.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
