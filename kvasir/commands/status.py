"""``kvasir status [--socket PATH] [--json]``: print a running node's view of the ring once."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvasir.commands.common import print_json
from kvasir.control.client import ControlClient
from kvasir.control.paths import find_socket
from kvasir.ring.status import NodeStatus, speculation_line, supervisor_lines


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="show a running node's ring status")
    p.add_argument("--socket", type=Path, default=None, help="control socket (default: the local node's)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path = args.socket or find_socket()
    with ControlClient(path, timeout=10) as client:
        st = client.status()
    if args.json:
        print_json(st)
        return 0
    NodeStatus.from_wire(st, where=f"the status from {path}")  # what follows reads a well-typed status
    c = Console()
    c.print(
        f"[bold]{escape(str(st['model']['name']))}[/] rank {st['rank']}/{st['ring_size']}"
        f" layers {st['window'][0]}:{st['window'][1]}"
        f" on {escape(str(st['backend']))} — {'[green]ready[/]' if st['ready'] else '[yellow]linking[/]'}"
    )
    t = Table("rank", "layers", "address")
    for r in st["ranks"]:
        mark = " ◀ this node" if r["rank"] == st["rank"] else ""
        t.add_row(str(r["rank"]), f"{r['layers'][0]}:{r['layers'][1]}", r["address"] + mark)
    c.print(t)
    lt = Table("link", "state", "frames out/in", "bytes out/in", "rtt ms")
    for name, link in st["links"].items():
        lt.add_row(
            name,
            link["state"],
            f"{link.get('frames_out', 0)}/{link.get('frames_in', 0)}",
            f"{link.get('bytes_out', 0)}/{link.get('bytes_in', 0)}",
            str(link.get("rtt_ms") or "-"),
        )
    c.print(lt)
    c.print(
        f"requests: {st['requests']}  contribution: {st['contribution']}  memory: {st['memory']}",
        markup=False,
        soft_wrap=True,
    )
    c.print(time_line(st), markup=False, soft_wrap=True)
    req = st.get("requests") or {}
    if req.get("verify_batches") or req.get("eager_steps"):
        c.print(f"speculation: {speculation_line(req)}", markup=False, soft_wrap=True)
    c.print(failover_line(st.get("failover") or {}), markup=False, soft_wrap=True)
    status = NodeStatus.from_wire(st)
    if status.supervisor is not None:  # under `kvasir ring up`: a window down, and when it is retried
        for line in supervisor_lines(status.supervisor):
            c.print(f"ring up: {line}", markup=False, soft_wrap=True)
    return 0


def time_line(st: dict[str, Any]) -> str:
    """Where this node's time went (docs/benchmarks.md § The ring on loopback): compute, the worker-thread hand-offs
    around it, link sends."""
    busy, handoff, send = (float(st.get(k) or 0.0) for k in ("busy_s", "handoff_s", "send_s"))
    return f"time: compute {busy:.2f} s, worker hand-off {handoff:.2f} s, link sends {send:.2f} s"


def failover_line(f: dict[str, Any]) -> str:
    """One line on what this node replayed into a successor that came back (docs/architecture.md § Failover)."""
    head = f"failover: {f.get('replays', 0)} replays, {f.get('requests', 0)} requests replayed"
    head += f", {f.get('duplicates', 0)} duplicate frames dropped, replay log {f.get('log_bytes', 0)} bytes"
    if f.get("last_window") is not None:
        a, b = f["last_window"]
        head += f"; last: layers {a}:{b} back after {f.get('last_stall_s')} s"
    return head
