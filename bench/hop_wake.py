"""What a frame costs the process that receives it: one-way latency of a decode boundary between two processes on
loopback TCP, by how the receiver waits for it and handles it, after an idle gap and back to back.

A ring node spends most of a token waiting for the ring to come round, so each frame it receives wakes an idle
process. This bench separates the layers of that wake-up, each in a receiver process of its own: a blocking
``recv``; ``epoll`` then ``recv``; a trio socket; kvasir's ``StreamLink`` (trio stream, frame reader, decoded
BOUNDARY, as a node receives it) without TLS, and over the v2 link's TLS 1.3 (as ring nodes link by default). The
sender (another process) stamps each frame with ``time.perf_counter()`` (CLOCK_MONOTONIC: one clock for every
process), waits for the receiver's one-byte acknowledgement, then sleeps ``gap`` before the next frame. Printed:
median and p90 of the one-way latency per receiver and gap, and each against the blocking ``recv`` at the same gap.

    python3 bench/hop_wake.py [--frames 400] [--gaps 0,0.005] [--n-embd 640]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable

import numpy as np
import trio
from rich.console import Console
from rich.table import Table

from kvasir.core.identity import Identity
from kvasir.ring.links import StreamLink
from kvasir.ring.secure import Credentials, KeyPolicy, accept_secure, dial_secure
from kvasir.wire import Boundary

STAMP = struct.Struct("<d")
RECEIVERS = ("blocking recv", "epoll + recv", "trio socket", "kvasir StreamLink", "kvasir StreamLink, TLS 1.3")
TLS = RECEIVERS[-1]


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("sender closed")
        buf += chunk
    return bytes(buf)


def _raw_receiver(sock: socket.socket, frames: int, size: int, use_epoll: bool) -> list[float]:
    ep = select.epoll() if use_epoll else None
    if ep is not None:
        ep.register(sock.fileno(), select.EPOLLIN)
    out = []
    for _ in range(frames):
        if ep is not None:
            ep.poll(86400)
        data = _recv_exact(sock, size)
        out.append(time.perf_counter() - STAMP.unpack_from(data)[0])
        sock.sendall(b"a")
    return out


def _trio_socket_receiver(sock: socket.socket, frames: int, size: int) -> list[float]:
    out: list[float] = []

    async def main() -> None:
        s = trio.socket.from_stdlib_socket(sock)
        for _ in range(frames):
            data = b""
            while len(data) < size:
                data += await s.recv(size - len(data))
            out.append(time.perf_counter() - STAMP.unpack_from(data)[0])
            await s.send(b"a")

    trio.run(main)
    return out


def _link_receiver(
    sock: socket.socket, frames: int, size: int, keys: tuple[Credentials, Credentials] | None
) -> list[float]:
    out: list[float] = []

    async def main() -> None:
        stream: trio.abc.Stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        if keys is not None:
            sender, me = keys
            stream, _, _ = await accept_secure(stream, me, KeyPolicy(frozenset({sender.identity.public})))
        link = StreamLink(stream, "sender")
        for _ in range(frames):
            frame = await link.receive()
            assert isinstance(frame, Boundary)
            hidden = frame.to_array()  # what a node hands its stage
            out.append(time.perf_counter() - STAMP.unpack_from(hidden.tobytes())[0])
            await stream.send_all(b"a")

    trio.run(main)
    return out


def _tls_sender(
    sock: socket.socket, keys: tuple[Credentials, Credentials], frames: int, gap: float, base: np.ndarray
) -> None:
    async def main() -> None:
        me, receiver = keys
        stream = await dial_secure(
            trio.SocketStream(trio.socket.from_stdlib_socket(sock)), me, receiver.identity.public
        )
        link = StreamLink(stream, "receiver")
        for i in range(frames):
            await trio.sleep(gap)
            await link.send(Boundary.from_array(1, 100 + i, _stamped(base), final=True, latest_token=5))
            await stream.receive_some(1)
        await link.aclose()

    trio.run(main)


def _plain_sender(sock: socket.socket, framed: bool, frames: int, gap: float, base: np.ndarray) -> None:
    """Blocking sends: a BOUNDARY frame's bytes when ``framed``, else the bare stamped row."""
    for i in range(frames):
        time.sleep(gap)
        hidden = _stamped(base)
        data = (
            Boundary.from_array(1, 100 + i, hidden, final=True, latest_token=5).to_wire()
            if framed
            else hidden.tobytes()
        )
        sock.sendall(data)
        _recv_exact(sock, 1)


def _stamped(base: np.ndarray) -> np.ndarray:
    hidden = base.copy()
    hidden.view(np.uint8)[0, : STAMP.size] = np.frombuffer(STAMP.pack(time.perf_counter()), np.uint8)
    return hidden


def measure(kind: str, frames: int, gap: float, n_embd: int) -> list[float]:
    """One receiver process of ``kind``; returns its one-way latencies in µs."""
    a, b = _tcp_pair()
    keys = (Credentials.of(Identity.generate()), Credentials.of(Identity.generate())) if kind == TLS else None
    r, w = os.pipe()
    base = np.random.default_rng(0).standard_normal((1, n_embd), dtype=np.float32)
    size = n_embd * 4
    pid = os.fork()
    if pid == 0:  # the receiver
        a.close()
        os.close(r)
        receivers: dict[str, Callable[[], list[float]]] = {
            "blocking recv": lambda: _raw_receiver(b, frames, size, False),
            "epoll + recv": lambda: _raw_receiver(b, frames, size, True),
            "trio socket": lambda: _trio_socket_receiver(b, frames, size),
            "kvasir StreamLink": lambda: _link_receiver(b, frames, size, None),
            TLS: lambda: _link_receiver(b, frames, size, keys),
        }
        lat = receivers[kind]()
        os.write(w, np.asarray(lat, np.float64).tobytes())
        os._exit(0)
    b.close()
    os.close(w)
    if keys is not None:
        _tls_sender(a, keys, frames, gap, base)
    else:
        _plain_sender(a, kind == "kvasir StreamLink", frames, gap, base)
    raw = b""
    while chunk := os.read(r, 1 << 20):
        raw += chunk
    os.close(r)
    os.waitpid(pid, 0)
    a.close()
    return [x * 1e6 for x in np.frombuffer(raw, np.float64)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=400)
    ap.add_argument("--gaps", default="0,0.005", help="seconds of idle before each frame, comma-separated")
    ap.add_argument("--n-embd", type=int, default=640, help="boundary width (Gemma 3 270M: 640)")
    args = ap.parse_args(argv)
    gaps = [float(g) for g in args.gaps.split(",")]
    warm = args.frames // 10
    table = Table(title=f"one-way latency of a {args.n_embd}-wide f32 boundary between two processes (µs)")
    for col in (
        "receiver",
        *(f"gap {g * 1e3:g} ms: p50 (p90)" for g in gaps),
        *(f"vs blocking, {g * 1e3:g} ms" for g in gaps),
    ):
        table.add_column(col, justify="left" if col == "receiver" else "right")
    p50: dict[tuple[str, float], float] = {}
    rows: dict[str, list[str]] = {k: [] for k in RECEIVERS}
    for gap in gaps:
        for kind in RECEIVERS:
            lat = sorted(measure(kind, args.frames, gap, args.n_embd)[warm:])
            p50[kind, gap] = statistics.median(lat)
            rows[kind].append(f"{p50[kind, gap]:.1f} ({lat[int(0.9 * len(lat))]:.1f})")
    for kind in RECEIVERS:
        ratios = [f"{p50[kind, g] / p50['blocking recv', g]:.2f}x" for g in gaps]
        table.add_row(kind, *rows[kind], *ratios)
    Console().print(table)
    print(f"python {sys.version.split()[0]}, trio {trio.__version__}, {os.cpu_count()} cpus")


if __name__ == "__main__":
    main()
