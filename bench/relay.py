"""Relay benchmark: prints a table of hop latency, throughput and relay memory.

Run: ``python bench/relay.py`` (about 20-40 s). The relay runs in its own process (``python -m kvasir.relay``) so its
RSS is its own; the clients run here, on loopback.
"""

from __future__ import annotations

import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import trio

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    # Run as a script, this file's folder comes first on sys.path and "relay" would import this file.
    sys.path[0] = str(REPO)

from kvasir.relay import Role, make_edge_token, open_relay_link  # noqa: E402

SECRET = os.urandom(32)
MESSAGE = os.urandom(16 * 1024)
ROUND_TRIPS = 500
BUSY_EDGES = 16
BUSY_SECONDS = 4.0
OPEN_EDGES = 64


def token(edge: str, role: Role) -> str:
    return make_edge_token(SECRET, edge, role, int(time.time()) + 3600)


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


async def relay_round_trips(url: str) -> list[float]:
    """Send 16 KiB up, echo it back down: each round trip is two relay hops."""
    samples: list[float] = []
    async with (
        open_relay_link(url, "lat", Role.UPSTREAM, token("lat", Role.UPSTREAM)) as up,
        open_relay_link(url, "lat", Role.DOWNSTREAM, token("lat", Role.DOWNSTREAM)) as down,
        trio.open_nursery() as nursery,
    ):

        async def echo() -> None:
            for _ in range(ROUND_TRIPS + 20):
                await down.send_message(await down.receive_message())

        nursery.start_soon(echo)
        for i in range(ROUND_TRIPS + 20):
            start = time.perf_counter()
            await up.send_message(MESSAGE)
            await up.receive_message()
            if i >= 20:  # warm-up
                samples.append(time.perf_counter() - start)
    return samples


async def direct_round_trips() -> list[float]:
    """The same exchange over one plain trio TCP stream on loopback."""
    samples: list[float] = []

    async def receive_exactly(stream: trio.abc.Stream, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = await stream.receive_some(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return bytes(buf)

    async def echo_handler(stream: trio.SocketStream) -> None:
        async with stream:
            for _ in range(ROUND_TRIPS + 20):
                await stream.send_all(await receive_exactly(stream, len(MESSAGE)))

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, echo_handler, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            for i in range(ROUND_TRIPS + 20):
                start = time.perf_counter()
                await stream.send_all(MESSAGE)
                await receive_exactly(stream, len(MESSAGE))
                if i >= 20:
                    samples.append(time.perf_counter() - start)
        nursery.cancel_scope.cancel()
    return samples


async def busy_edges(url: str) -> float:
    """Messages per second through the relay with BUSY_EDGES edges all sending 16 KiB messages upstream->down."""
    counts = [0] * BUSY_EDGES

    async def edge(i: int) -> None:
        name = f"busy{i}"
        async with (
            open_relay_link(url, name, Role.UPSTREAM, token(name, Role.UPSTREAM)) as up,
            open_relay_link(url, name, Role.DOWNSTREAM, token(name, Role.DOWNSTREAM)) as down,
            trio.open_nursery() as nursery,
        ):

            async def send() -> None:
                while True:
                    await up.send_message(MESSAGE)

            nursery.start_soon(send)
            await ready.wait()
            with trio.move_on_at(deadline[0]):
                while True:
                    await down.receive_message()
                    counts[i] += 1
            nursery.cancel_scope.cancel()

    ready = trio.Event()
    deadline = [0.0]
    async with trio.open_nursery() as nursery:
        for i in range(BUSY_EDGES):
            nursery.start_soon(edge, i)
        await trio.sleep(1.0)  # let every edge pair
        deadline[0] = trio.current_time() + BUSY_SECONDS
        ready.set()
    return sum(counts) / BUSY_SECONDS


async def open_paired_edges(url: str, pid: int) -> tuple[int, int]:
    """Relay RSS (KiB) before and with OPEN_EDGES paired, idle edges."""
    before = rss_kib(pid)
    measured = trio.Event()
    result = [0]

    async def edge(i: int, all_open: Callable[[], None]) -> None:
        name = f"open{i}"
        async with (
            open_relay_link(url, name, Role.UPSTREAM, token(name, Role.UPSTREAM)) as up,
            open_relay_link(url, name, Role.DOWNSTREAM, token(name, Role.DOWNSTREAM)) as down,
        ):
            await up.send_message(MESSAGE)
            await down.receive_message()
            all_open()
            await measured.wait()

    opened = [0]
    everyone = trio.Event()

    def one_open() -> None:
        opened[0] += 1
        if opened[0] == OPEN_EDGES:
            everyone.set()

    async with trio.open_nursery() as nursery:
        for i in range(OPEN_EDGES):
            nursery.start_soon(edge, i, one_open)
        await everyone.wait()
        await trio.sleep(0.5)
        result[0] = rss_kib(pid)
        measured.set()
    return before, result[0]


async def measure(url: str, pid: int) -> None:
    with trio.fail_after(90):
        base_rss, open_rss = await open_paired_edges(url, pid)
        direct = await direct_round_trips()
        relayed = await relay_round_trips(url)
        rate = await busy_edges(url)

    ms = 1000.0
    print(f"{'measure':<52} {'p50':>10} {'p99':>10}")
    print(f"{'16 KiB round trip, direct trio TCP (ms)':<52} {percentile(direct, 0.5) * ms:>10.3f}", end="")
    print(f" {percentile(direct, 0.99) * ms:>10.3f}")
    print(f"{'16 KiB round trip through relay, 2 hops (ms)':<52} {percentile(relayed, 0.5) * ms:>10.3f}", end="")
    print(f" {percentile(relayed, 0.99) * ms:>10.3f}")
    hop = [(r - d) / 2 for r, d in zip(sorted(relayed), sorted(direct), strict=True)]
    print(f"{'added latency per relay hop (ms)':<52} {percentile(hop, 0.5) * ms:>10.3f}", end="")
    print(f" {percentile(hop, 0.99) * ms:>10.3f}")
    print(f"{'mean relayed round trip (ms)':<52} {statistics.fmean(relayed) * ms:>10.3f}")
    print(f"{f'messages/s, {BUSY_EDGES} busy edges, 16 KiB each':<52} {rate:>10.0f}")
    print(f"{'  = MiB/s forwarded':<52} {rate * len(MESSAGE) / 2**20:>10.1f}")
    print(f"{'relay RSS idle (MiB)':<52} {base_rss / 1024:>10.1f}")
    print(f"{f'relay RSS with {OPEN_EDGES} paired edges (MiB)':<52} {open_rss / 1024:>10.1f}")
    print(f"{'  = KiB per paired edge':<52} {(open_rss - base_rss) / OPEN_EDGES:>10.1f}")


def main() -> None:
    # 128 bench connections come from one address, so the per-address cap is raised.
    secret_file = Path(tempfile.mkdtemp()) / "relay.secret"  # a file, never argv
    secret_file.write_text(SECRET.hex())
    argv = ["--listen", "127.0.0.1:0", "--secret-file", str(secret_file), "--max-conns-per-ip", "1000"]
    relay = subprocess.Popen(
        [sys.executable, "-m", "kvasir.relay", *argv],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert relay.stdout is not None
        line = relay.stdout.readline()  # "kvasir relay: listening on ws://127.0.0.1:PORT"
        trio.run(measure, line.rsplit(" ", 1)[1].strip(), relay.pid)
    finally:
        relay.terminate()
        relay.wait()


if __name__ == "__main__":
    main()
