"""Market ring under attack: honest nodes enroll through a real market while attackers work, and every honest answer
is checked against the whole model's.

A real ``kvasir market`` process (its own SQLite file) on loopback publishes a model (SmolLM2-135M by default) as
four windows. Three honest ``kvasir node --market`` processes and a fourth member, ``tests/harness/evil_start.py``
(the real node, dormant until its phase), enroll, fetch their windows from a seeder and form a ring with recording
and pinned market key. The fourth member can hold only window 1 (its memory budget), so it sits between the entry
(window 0, where the honest client asks) and the last rank. The fault-free answers come from the whole model in one
llama.cpp context in this process (greedy and seeded jobs, alternately).

Phases, each with ``--requests`` honest requests (tests/harness/marketattack.py has the attackers):

- ``squat`` (N6): squatters claim every window first and announce a dead endpoint; the honest nodes start and have
  ``--squat-wait`` seconds to get a ring (requests are sent only once they have one); then the squatters stop;
- ``baseline``: no attacker;
- ``sybil`` (N7): two free keys mint credit on a model nobody serves, and inflate its demand;
- ``start`` (N8): the fourth member rewrites every START it forwards;
- ``slots`` (N4): silent connections hold the pending-handshake slots of the last rank's port, and its predecessor
  link is cut (``ss -K``);
- ``after``: no attacker again (the machine's load may have moved since the baseline).

Printed: per phase the honest requests served / identical / different / failed and latency p50/p95 (served
requests), and each attacker's attempt, achievement and verdict. Exit 1 if any honest answer differs from the
fault-free one (``--strict``: or failed).

    python bench/market_attack.py [--requests 8] [--max-tokens 16] [--attackers squat,sybil,start,slots]
        [--squat-wait 90] [--model PATH --windows A:B,... --weights W,...] [--json] [--save FILE]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import httpx
import trio

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)

from kvasir.core.identity import load_or_create_identity  # noqa: E402
from kvasir.demo import chat_model_path  # noqa: E402
from tests.harness.marketattack import (  # noqa: E402
    Answer,
    Attacker,
    Job,
    SlotHolders,
    Squatters,
    StartRewriter,
    SybilPair,
    ask,
    check_row,
    jobs,
    phase_row,
    publish_sybil_model,
)
from tests.marketutil import Proc, procs  # noqa: E402

ATTACKERS = ("squat", "sybil", "start", "slots")
#: SmolLM2-135M (30 layers): window 1 is the smallest, so only the fourth member's budget fits it; its weight is the
#: lowest, so honest nodes take it last.
WINDOWS = "0:9,9:14,14:22,22:30"
WEIGHTS = "1,0.01,1,1"
HONEST = ("h0", "h1", "h2")
EVIL = "evil"


def references(model: Path, todo: Sequence[Job], max_tokens: int) -> list[list[int]]:
    """The fault-free tokens of each job: the whole model in one llama.cpp context."""
    from kvasir.stage.engine import Stage, StageConfig
    from kvasir.stage.pipeline import LocalPipeline

    out: dict[Job, list[int]] = {}
    with Stage.load(StageConfig(model, n_ctx=512, n_seq_max=1, n_threads=1)) as stage:
        pipe = LocalPipeline([stage])
        for job in todo:
            if job not in out:
                out[job] = pipe.generate(stage.vocab.tokenize(job.prompt), job.sampling(), max_tokens).tokens
    return [out[j] for j in todo]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _coverage(url: str, model: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/coverage", params={"model": model}, timeout=10)
    r.raise_for_status()
    found: dict[str, Any] = r.json()["models"][0]
    return found


class EvilProc(Proc):
    """A node started from tests/harness/evil_start.py instead of ``-m kvasir`` (same collection of its lines)."""

    def __init__(self, flag: Path, *args: str) -> None:
        import os
        import threading

        self.args = args
        env = dict(os.environ, KV_EVIL_START_FLAG=str(flag))
        script = REPO / "tests" / "harness" / "evil_start.py"
        self.p = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [
            threading.Thread(target=self._read, args=(stream, sink), daemon=True)
            for stream, sink in ((self.p.stdout, self.out), (self.p.stderr, self.err))
        ]
        for t in self.readers:
            t.start()


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path, ps: list[Proc]) -> None:
        self.args, self.tmp, self.ps = args, tmp, ps
        self.jobs = jobs(args.requests)
        self.want: list[list[int]] = []
        self.nodes: dict[str, Proc] = {}
        self.status: dict[str, dict[str, Any]] = {}
        self.flag = tmp / "evil.flag"
        self.rows: list[dict[str, Any]] = []
        self.url = self.key = self.model = ""

    # -------------------------------------------------------------------------------------------- set-up

    def start_market(self) -> None:
        a, tmp = self.args, self.tmp
        operator = load_or_create_identity(tmp / "operator.pem")
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(tmp / "market.sqlite"),
                      "--identity", str(tmp / "operator.pem"))  # fmt: skip
        self.ps.append(market)
        self.url = market.wait_line(r"listening on (http://\S+)").group(1)
        self.key = market.wait_line(r"operator (ed25519:\S+)").group(1)
        seeder = Proc("serve-model", str(a.model), "--listen", "127.0.0.1:0")
        self.ps.append(seeder)
        source = seeder.wait_line(r"serving (http://\S+)").group(1)
        pub = Proc("market", "publish", str(a.model), "--url", self.url, "--source", source, "--windows", a.windows,
                   "--weights", a.weights, "--identity", str(tmp / "operator.pem"))  # fmt: skip
        if pub.wait(300) != 0:
            raise SystemExit(f"publish failed: {pub.err[-5:]}")
        cov = httpx.get(f"{self.url}/v1/coverage", timeout=10).json()["models"]
        self.model = cov[0]["windows"][0]["model"]
        self.sizes = [int(w["bytes"]) for w in cov[0]["windows"]]
        if len(self.sizes) != 4 or min(self.sizes) != self.sizes[1] or self.sizes.count(self.sizes[1]) != 1:
            raise SystemExit(f"--windows must give four windows, window 1 strictly the smallest: {self.sizes}")
        self.sybil_model = trio.run(publish_sybil_model, self.url, operator)

    def start_nodes(self) -> None:
        tmp = self.tmp
        for k, name in enumerate((*HONEST, EVIL)):
            budget = str(self.sizes[1]) if name == EVIL else "4GB"
            args = ("node", "--market", self.url, "--market-key", self.key, "--memory-budget", budget,
                    "--lease", "3", "--poll", "0.5", "--seed", str(k), "--threads", "1", "--ctx", "256",
                    "--seqs", "2", "--control", str(tmp / f"{name}.sock"), "--stage-dir", str(tmp / f"stages-{name}"),
                    "--record", str(tmp / f"record-{name}"))  # fmt: skip
            p = EvilProc(self.flag, *args) if name == EVIL else Proc(*args)
            self.nodes[name] = p
            self.ps.append(p)

    def ring_live(self, squatters: Collection[str]) -> bool:
        try:
            m = _coverage(self.url, self.model)
        except (httpx.HTTPError, KeyError, IndexError):
            return False
        return bool(m["live"]) and not any(w["holder"] in squatters for w in m["windows"])

    def wait_ring(self, limit: float, squatters: Collection[str] = ()) -> float | None:
        """Seconds until the honest ring is live on the market and answers (None: not within ``limit``)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit:
            if self.ring_live(squatters):
                break
            time.sleep(0.5)
        else:
            return None
        for name, p in self.nodes.items():
            if name not in self.status:
                m = p.wait_line(r"^kvasir node: enrolled (.*)$", timeout=max(5.0, limit - (time.monotonic() - t0)))
                self.status[name] = json.loads(m.group(1))
        while time.monotonic() - t0 < limit + 60:  # a first answer (links up, stages warm); not counted
            if ask(self.entry, self.jobs[0], 2, [], "warm-up", 0, 30).outcome != "failed":
                return time.monotonic() - t0
            time.sleep(0.5)
        return None

    def by_window(self, rank: int) -> str:
        (name,) = [n for n, s in self.status.items() if s["window"][0] == self.window_starts[rank]]
        return name

    @property
    def window_starts(self) -> list[int]:
        return [int(w.split(":")[0]) for w in self.args.windows.split(",")]

    @property
    def entry(self) -> Path:
        return self.tmp / f"{self.by_window(0)}.sock"

    # -------------------------------------------------------------------------------------------- phases

    def honest(self, phase: str) -> list[Answer]:
        a = self.args
        return [
            ask(self.entry, job, a.max_tokens, want, phase, i, a.timeout)
            for i, (job, want) in enumerate(zip(self.jobs, self.want, strict=True))
        ]

    def add(self, phase: str, answers: list[Answer], attack: dict[str, Any] | None) -> dict[str, Any]:
        row = phase_row(phase, answers, attack)
        self.rows.append(row)
        print(f"  {phase}: {row['identical']} identical, {row['different']} different, {row['failed']} failed",
              file=sys.stderr, flush=True)  # fmt: skip
        return row

    def run(self) -> None:
        a = self.args
        print(f"references: {len(self.jobs)} jobs x {a.max_tokens} tokens", file=sys.stderr, flush=True)
        self.want = references(a.model, self.jobs, a.max_tokens)
        self.start_market()
        if "squat" in a.attackers:
            self.squat_phase()
        else:
            self.start_nodes()
            if self.wait_ring(a.ring_wait) is None:
                raise SystemExit("the honest ring did not form")
        print(f"ring: { {n: s['window'] for n, s in self.status.items()} }", file=sys.stderr, flush=True)
        self.add("baseline", self.honest("baseline"), None)
        for name in ATTACKERS[1:]:
            if name in a.attackers:
                self.attack_phase(name)
        self.add("after", self.honest("after"), None)  # no attacker again: the load may have moved meanwhile

    def squat_phase(self) -> None:
        a = self.args
        squat = Squatters(self.url, self.model, 4, f"127.0.0.1:{_free_port()}")
        squat.start()
        self.start_nodes()
        formed = self.wait_ring(a.squat_wait, squat.node_ids)
        if formed is not None:
            answers = self.honest("squat")
        else:
            answers = [Answer("squat", i, "failed", 0.0, f"no honest ring within {a.squat_wait:.0f} s")
                       for i in range(len(self.jobs))]  # fmt: skip
        report = squat.stop()
        report["ring_formed_s"] = formed
        report["ring_after_release_s"] = None
        report["achieved"] += "; honest ring " + (
            f"formed after {formed:.0f} s" if formed is not None else f"not formed in {a.squat_wait:.0f} s"
        )
        report["succeeded"] = formed is None
        self.add("squat", answers, report)
        if formed is None:
            after = self.wait_ring(a.ring_wait)
            if after is None:
                raise SystemExit("the honest ring did not form after the squatters stopped")
            report["ring_after_release_s"] = after
            report["achieved"] += f" (formed {after:.0f} s after they released)"

    def attacker(self, name: str) -> Attacker:
        if name == "sybil":
            return SybilPair(self.url, self.sybil_model)
        if name == "start":
            return StartRewriter(self.flag)
        last = _coverage(self.url, self.model)["windows"][-1]
        port = int(str(last["endpoint"]).rsplit(":", 1)[1])
        return SlotHolders(port, self.tmp / f"{self.by_window(3)}.sock")

    def attack_phase(self, name: str) -> None:
        attacker = self.attacker(name)
        attacker.start()
        answers = self.honest(name)
        report = attacker.stop()
        row = self.add(name, answers, report)
        if name == "start":
            report["achieved"] = f"{row['different']} altered answers served, {row['failed']} requests failed"
            report["succeeded"] = row["different"] > 0
        if name == "slots":
            report["succeeded"] = bool(report["succeeded"]) or row["failed"] > 0

    def ledger(self) -> dict[str, Any]:
        try:
            return dict(httpx.get(f"{self.url}/v1/ledger", timeout=10).json())
        except (httpx.HTTPError, ValueError):
            return {}


def _s(x: float | None) -> str:
    return f"{'-':>6}" if x is None else f"{x:6.2f}"


def print_table(rows: Sequence[dict[str, Any]], honest_earned: float | None) -> None:
    print("honest requests per phase (latency of served requests, s)")
    head = f"{'phase':9} {'requests':>8} {'served':>6} {'identical':>9} {'different':>9} {'failed':>6}"
    print(f"{head} {'p50 s':>6} {'p95 s':>6}  attack")
    for r in rows:
        verdict = "-" if r["attack"] is None else ("SUCCEEDED" if r["attack"]["succeeded"] else "refused")
        print(f"{r['phase']:9} {r['requests']:8d} {r['served']:6d} {r['identical']:9d} {r['different']:9d}"
              f" {r['failed']:6d} {_s(r['p50_s'])} {_s(r['p95_s'])}  {verdict}")  # fmt: skip
    for r in rows:
        if r["attack"] is not None:
            t = r["attack"]
            print(f"{r['phase']}: attempted: {t['attempted']}\n{'':{len(r['phase'])}}  achieved: {t['achieved']}")
            if t.get("errors"):
                print(f"{'':{len(r['phase'])}}  attacker errors: {t['errors']}")
        if r["details"]:
            print(f"{r['phase']}: honest details: {r['details']}")
    if honest_earned is not None:
        print(f"honest nodes' credit at the end: {honest_earned:.3g}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--windows", default=WINDOWS, help="four windows; window 1 strictly the smallest")
    ap.add_argument("--weights", default=WEIGHTS, help="reward weights of the windows")
    ap.add_argument("--requests", type=int, default=8, help="honest requests per phase")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--attackers", default=",".join(ATTACKERS), help=f"comma-separated, of {','.join(ATTACKERS)}")
    ap.add_argument("--squat-wait", type=float, default=90.0, help="seconds the honest nodes get against squatters")
    ap.add_argument("--ring-wait", type=float, default=180.0, help="seconds for the ring to form without attackers")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds one honest request may take")
    ap.add_argument("--strict", action="store_true", help="exit 1 on a failed honest request too")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    ap.add_argument("--save", type=Path, default=None, help="write the rows as JSON here too")
    args = ap.parse_args(argv)
    args.model = args.model or chat_model_path()
    chosen = [x for x in args.attackers.split(",") if x]
    if unknown := set(chosen) - set(ATTACKERS):
        ap.error(f"unknown attackers: {sorted(unknown)}")
    args.attackers = chosen
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d, procs() as ps:
        bench = Bench(args, Path(d), ps)
        bench.run()
        ledger = bench.ledger()
        ids = {s["node_id"] for s in bench.status.values()}
        earned = sum(float(n.get("earned", 0.0)) for n in ledger.get("nodes", []) if n.get("node_id") in ids)
        rows = bench.rows
    for r in rows:
        if wrong := check_row(r):
            raise SystemExit(f"malformed row {r['phase']}: {wrong}")
    out = {"rows": rows, "honest_earned": earned, "wall_s": time.monotonic() - t0,
           "config": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    if args.save is not None:
        args.save.write_text(json.dumps(out, indent=1, default=str))
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print_table(rows, earned)
        print(f"wall {out['wall_s']:.0f} s")
    bad = any(r["different"] for r in rows) or (args.strict and any(r["failed"] for r in rows))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
