"""Cost of link encryption: hop latency and throughput of real ring frames, plain TCP against the v2 TLS link.

Run: ``python bench/link_crypto.py`` (about 10-20 s). Both ends run in this process on loopback TCP; each
measurement alternates plain and TLS rounds so machine load hits both alike. Printed: p50/p90 of one hop's
one-way time (half an echo round trip of a decode-step BOUNDARY, Gemma 3 270M's width) and throughput of
64-token prefill chunks, with the TLS/plain ratio and the spread over rounds.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import trio

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)

from kvasir.core.identity import Identity  # noqa: E402
from kvasir.ring.links import StreamLink  # noqa: E402
from kvasir.ring.secure import Credentials, KeyPolicy, accept_secure, dial_secure  # noqa: E402
from kvasir.wire import Boundary, BoundaryDType  # noqa: E402

N_EMBD = 640  # Gemma 3 270M
ECHOES = 400
CHUNKS = 60
ROUNDS = 5


def boundary(n_tokens: int) -> Boundary:
    payload = np.random.default_rng(0).standard_normal(n_tokens * N_EMBD, dtype=np.float32).tobytes()
    return Boundary(1, 0, n_tokens, N_EMBD, BoundaryDType.F32, payload)


@asynccontextmanager
async def link_pair(secure: bool) -> AsyncIterator[tuple[StreamLink, StreamLink]]:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    a, b = Credentials.of(Identity.generate()), Credentials.of(Identity.generate())
    pair: dict[str, StreamLink] = {}

    async def accept() -> None:
        stream: trio.abc.Stream = await listeners[0].accept()
        if secure:
            stream, _, _ = await accept_secure(stream, b, KeyPolicy(frozenset({a.identity.public})))
        pair["acceptor"] = StreamLink(stream, "acceptor")

    async def dial() -> None:
        stream: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", port)
        if secure:
            stream = await dial_secure(stream, a, b.identity.public)
        pair["dialer"] = StreamLink(stream, "dialer")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        nursery.start_soon(dial)
    try:
        yield pair["dialer"], pair["acceptor"]
    finally:
        for link in pair.values():
            await link.aclose()
        await listeners[0].aclose()


async def hop_times(secure: bool) -> list[float]:
    frame = boundary(1)
    out: list[float] = []
    async with link_pair(secure) as (dialer, acceptor), trio.open_nursery() as nursery:

        async def echo() -> None:
            for _ in range(ECHOES):
                await acceptor.send(await acceptor.receive())

        nursery.start_soon(echo)
        for _ in range(ECHOES):
            start = time.perf_counter()
            await dialer.send(frame)
            await dialer.receive()
            out.append((time.perf_counter() - start) / 2)
    return out


async def throughput(secure: bool) -> float:
    frame = boundary(64)
    async with link_pair(secure) as (dialer, acceptor), trio.open_nursery() as nursery:

        async def drain() -> None:
            for _ in range(CHUNKS):
                await acceptor.receive()

        start = time.perf_counter()
        nursery.start_soon(drain)
        for _ in range(CHUNKS):
            await dialer.send(frame)
    return CHUNKS * len(frame.to_wire()) / (time.perf_counter() - start)


def pct(samples: list[float], q: float) -> float:
    return sorted(samples)[min(len(samples) - 1, int(q * len(samples)))]


async def main() -> None:
    p50: dict[bool, list[float]] = {False: [], True: []}
    p90: dict[bool, list[float]] = {False: [], True: []}
    rate: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(ROUNDS):
        for secure in (False, True):
            times = await hop_times(secure)
            p50[secure].append(pct(times, 0.5))
            p90[secure].append(pct(times, 0.9))
            rate[secure].append(await throughput(secure))
    med: Callable[[list[float]], float] = statistics.median
    print(f"link encryption cost, {ROUNDS} alternating rounds, loopback TCP, n_embd {N_EMBD}")
    print(f"{'measure':<34}{'plain':>12}{'TLS 1.3':>12}{'TLS - plain':>14}{'ratio':>8}")
    for name, data, scale, unit in (
        ("hop one-way p50", p50, 1e6, "us"),
        ("hop one-way p90", p90, 1e6, "us"),
        ("prefill chunks (64 tok) MB/s", rate, 1e-6, "MB/s"),
    ):
        plain, tls = med(data[False]) * scale, med(data[True]) * scale
        print(
            f"{name:<34}{plain:>10.1f}{unit[:2]:>2}{tls:>10.1f}{unit[:2]:>2}{tls - plain:>12.1f}{unit[:2]:>2}"
            f"{tls / plain:>8.3f}"
        )
    for secure in (False, True):
        label = "TLS" if secure else "plain"
        spread = [f"{x * 1e6:.0f}" for x in p50[secure]]
        print(
            f"  {label:<6} p50 per round (us): {' '.join(spread)};"
            f" MB/s per round: {' '.join(f'{x / 1e6:.0f}' for x in rate[secure])}"
        )


if __name__ == "__main__":
    trio.run(main)
