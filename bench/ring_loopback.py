"""The ring on loopback: N node processes vs the whole model in one process.

Prints (1) decode ms/token for the whole model and for rings of 2/3/4 processes on this machine, with the ratio;
(2) per-hop latency p50/p99 of a 4096-wide f32 boundary frame over a loopback TCP link, and bytes per token per hop;
(3) tokens/s with 1, 4 and 8 concurrent requests through a 4-process ring; (4) where a decode token's time goes in
the 4-process ring (each node's compute, worker-thread hand-off and link-send counters from its status); (5) the
4-process ring with its processes left to the scheduler against all pinned to one CPU (one request: each hop then
wakes a process on a CPU that is already running, not an idle one), in alternating rounds with the whole model.

    python3 bench/ring_loopback.py [--model PATH] [--tokens 32] [--repeats 3] [--threads N] [--placement-rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import trio
from rich.console import Console
from rich.table import Table

from kvasir.control.client import ControlClient
from kvasir.demo import demo_model_path
from kvasir.local.launcher import start_ring
from kvasir.ring.links import StreamLink
from kvasir.shard.cache import default_cache_dir, even_splits
from kvasir.shard.gguf_file import describe
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.wire import Boundary, SamplingParams

PROMPT = "Write a short story about a ring of devices that pass hidden states to each other:"


def whole_decode(model: Path, tokens: int, repeats: int, threads: int) -> list[float]:
    out = []
    with Stage.load(StageConfig(model, n_ctx=512, n_seq_max=1, n_threads=threads)) as stage:
        pipe = LocalPipeline([stage])
        prompt = stage.vocab.tokenize(PROMPT)
        for r in range(repeats + 1):
            res = pipe.generate(prompt, SamplingParams(temperature=0.0), tokens)
            if r:
                out.append(res.decode_ms_per_token)
    return out


def ring_decode(sock: Path, tokens: int, repeats: int) -> list[float]:
    out = []
    for r in range(repeats + 1):
        t_first = t_last = 0.0
        n = 0
        with ControlClient(sock, timeout=300) as c:
            for msg in c.generate(prompt=PROMPT, max_tokens=tokens, temperature=0.0):
                if msg["type"] == "token" and msg["token"] >= 0:
                    n += 1
                    t_last = time.perf_counter()
                    if n == 1:
                        t_first = t_last
        if r and n > 1:
            out.append((t_last - t_first) * 1e3 / (n - 1))
    return out


TIMERS = ("busy_s", "handoff_s", "send_s")


def timers(sockets: list[Path]) -> list[list[float]]:
    """Each node's cumulative compute, worker-thread hand-off and link-send seconds (its status)."""
    out = []
    for sock in sockets:
        with ControlClient(sock, timeout=60) as c:
            st = c.status()
        out.append([float(st[k]) for k in TIMERS])
    return out


def decode_breakdown(sockets: list[Path], tokens: int) -> tuple[float, list[list[float]]]:
    """One request's decode, from its first token to its last: ms per token of wall time, and per node ms per token
    of compute, hand-off and send (status deltas; the prompt's prefill happens before the first snapshot)."""
    n = 0
    t_first = t_last = 0.0
    before: list[list[float]] = []
    with ControlClient(sockets[0], timeout=300) as c:
        for msg in c.generate(prompt=PROMPT, max_tokens=tokens, temperature=0.0):
            if msg["type"] == "token" and msg["token"] >= 0:
                n += 1
                t_last = time.perf_counter()
                if n == 1:
                    before = timers(sockets)  # the ring keeps decoding meanwhile: its first steps are counted
                    t_first = time.perf_counter()
    after = timers(sockets)
    steps = n - 1
    per_node = [[(b - a) * 1e3 / steps for a, b in zip(x, y, strict=True)] for x, y in zip(before, after, strict=True)]
    return (t_last - t_first) * 1e3 / steps, per_node


async def hop_latency(n_embd: int, samples: int) -> tuple[list[float], int]:
    """One-way latency of a decode boundary frame over a loopback TCP link (same clock at both ends)."""
    lat: list[float] = []
    frame = Boundary.from_array(
        1, 100, np.random.default_rng(0).standard_normal((1, n_embd), dtype=np.float32), final=True, latest_token=5
    )
    size = len(frame.to_wire())
    async with trio.open_nursery() as nursery:
        got = trio.Event()
        box: dict[str, StreamLink] = {}

        async def handler(stream: trio.SocketStream) -> None:
            link = StreamLink(stream, "rx")
            box["rx"] = link
            got.set()
            await trio.sleep_forever()

        listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        tx = StreamLink(await trio.open_tcp_stream("127.0.0.1", port), "tx")
        await got.wait()
        rx = box["rx"]
        for i in range(samples + 100):
            t0 = time.perf_counter()
            await tx.send(frame)
            f = await rx.receive()
            assert isinstance(f, Boundary)
            f.to_array()
            if i >= 100:
                lat.append((time.perf_counter() - t0) * 1e6)
        await tx.aclose()
        nursery.cancel_scope.cancel()
    return lat, size


def concurrent_tps(sock: Path, n: int, tokens: int) -> float:
    done = []

    def one(i: int) -> None:
        with ControlClient(sock, timeout=300) as c:
            r = c.complete(prompt=f"{PROMPT} (variant {i})", max_tokens=tokens)
        done.append(len(r["tokens"]))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every thread of every process in ``pids`` onto ``cpus``."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(tid), cpus)


def placement(model: Path, n_layer: int, cache: Path, tokens: int, rounds: int) -> dict[str, list[float]]:
    """ms/token of the whole model and of a 4-process ring (1 thread each) unpinned and pinned to one CPU, one
    request at a time, in ``rounds`` alternating rounds."""
    out: dict[str, list[float]] = {"whole model, 1 process": [], "ring of 4, any CPU": [], "ring of 4, one CPU": []}
    every = set(range(os.cpu_count() or 1))
    ring = start_ring(model, even_splits(n_layer, 4), cache, threads=1, ctx=1024)
    try:
        ring.wait_ready()
        pids = [p.pid for p in ring.processes]
        for _ in range(rounds):
            out["whole model, 1 process"].append(statistics.median(whole_decode(model, tokens, 2, 1)))
            pin(pids, every)
            out["ring of 4, any CPU"].append(statistics.median(ring_decode(ring.sockets[0], tokens, 2)))
            pin(pids, {min(every)})
            out["ring of 4, one CPU"].append(statistics.median(ring_decode(ring.sockets[0], tokens, 2)))
    finally:
        ring.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--concurrency-threads",
        type=int,
        default=1,
        help="threads per process for the concurrency table (1: N co-located processes share the cores "
        "without oversubscription, so pipelining shows)",
    )
    ap.add_argument("--placement-rounds", type=int, default=3, help="rounds of the placement table (0: skip it)")
    args = ap.parse_args()
    cache = default_cache_dir()
    model = args.model or demo_model_path(cache)
    info = describe(model)
    console = Console(width=150)

    t = Table(
        title=f"{model.name}: decode, {args.threads} threads per process, {args.tokens} tokens, "
        f"{args.repeats} repeats (median, min–max)"
    )
    for col in ("config", "decode ms/token", "spread", "ratio"):
        t.add_column(col, justify="right")
    base = whole_decode(model, args.tokens, args.repeats, args.threads)
    mb = statistics.median(base)
    t.add_row("whole model, 1 process", f"{mb:.2f}", f"{min(base):.2f}–{max(base):.2f}", "1.000x")
    rings = {}
    for n in (2, 3, 4):
        ring = start_ring(model, even_splits(info.n_layer, n), cache, threads=args.threads, ctx=1024)
        try:
            ring.wait_ready()
            d = ring_decode(ring.sockets[0], args.tokens, args.repeats)
            md = statistics.median(d)
            t.add_row(f"ring of {n} processes", f"{md:.2f}", f"{min(d):.2f}–{max(d):.2f}", f"{md / mb:.3f}x")
            if n == 4:
                breakdown = decode_breakdown(ring.sockets, 4 * args.tokens)
        finally:
            ring.stop()
    ring = start_ring(model, even_splits(info.n_layer, 4), cache, threads=args.concurrency_threads, ctx=1024)
    try:
        ring.wait_ready()
        rings[4] = {c: concurrent_tps(ring.sockets[0], c, args.tokens) for c in (1, 4, 8)}
    finally:
        ring.stop()
    console.print(t)

    wall, per_node = breakdown
    b = Table(
        title=f"where a decode token's {wall:.2f} ms go in the ring of 4 ({4 * args.tokens} tokens, one request; "
        "each node's status counters)"
    )
    for col in ("node", "compute ms", "hand-off ms", "send ms"):
        b.add_column(col, justify="right")
    for rank, (busy, handoff, send) in enumerate(per_node):
        b.add_row(f"rank {rank}", f"{busy:.2f}", f"{handoff:.2f}", f"{send:.2f}")
    counted = sum(map(sum, per_node))
    b.caption = f"the rest, {wall - counted:.2f} ms per token, is between the nodes: wake-ups, frame handling"
    console.print(b)

    lat, size = trio.run(hop_latency, 4096, 2000)
    h = Table(title="one hop on loopback TCP: 4096-wide f32 decode boundary")
    for col in ("p50 µs", "p99 µs", "mean µs", "bytes per token per hop"):
        h.add_column(col, justify="right")
    q = np.percentile(lat, [50, 99])
    h.add_row(f"{q[0]:.1f}", f"{q[1]:.1f}", f"{statistics.mean(lat):.1f}", str(size))
    console.print(h)

    c = Table(
        title=f"4-process ring throughput ({args.concurrency_threads} thread(s) per process, {args.tokens} tokens "
        "per request)"
    )
    c.add_column("concurrent requests", justify="right")
    c.add_column("tokens/s", justify="right")
    c.add_column("vs 1", justify="right")
    for k, v in rings[4].items():
        c.add_row(str(k), f"{v:.1f}", f"{v / rings[4][1]:.2f}x")
    console.print(c)

    if args.placement_rounds > 0:
        placed = placement(model, info.n_layer, cache, args.tokens, args.placement_rounds)
        whole = placed["whole model, 1 process"]
        pt = Table(
            title=f"placement: one request, 1 thread per process, {args.placement_rounds} alternating rounds (median, "
            "min–max; ratio: median of each round's ratio to that round's whole model)"
        )
        for col in ("config", "decode ms/token", "spread", "ratio"):
            pt.add_column(col, justify="right")
        for name, vals in placed.items():
            ratio = statistics.median(v / w for v, w in zip(vals, whole, strict=True))
            pt.add_row(name, f"{statistics.median(vals):.2f}", f"{min(vals):.2f}–{max(vals):.2f}", f"{ratio:.3f}x")
        console.print(pt)


if __name__ == "__main__":
    main()
