"""Kvasir's h11 server (kvasir.net.http) against hypercorn's trio worker with Starlette, on loopback.

Each server runs in its own process with the same four routes: ``/json`` (a small JSON reply), ``/sse`` (events
with the server's monotonic clock in them, 2 ms apart, like tokens), ``/big`` (64 MiB streamed) and ``/upload``
(reads the body). The client measures keep-alive requests/s for small JSON over a few connections, SSE delivery
latency (server write to client read), and checks two limits the market and the API rely on:

- per-write send timeout: a client that requests ``/big`` and stops reading is dropped after ``send_timeout`` (1 s);
- pre-read body limit: a ``Content-Length`` over the limit is refused (413) before any of the body is sent.

Hypercorn and Starlette are not Kvasir dependencies: ``pip install hypercorn starlette`` to measure them; without
them the bench measures the h11 server alone and says so.

    python3 bench/http_server.py [--seconds 2] [--connections 8] [--events 200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import h11
import trio

BIG_BYTES = 64 * 1024 * 1024
BLOCK = 64 * 1024
SEND_TIMEOUT = 1.0
MAX_BODY = 1024 * 1024
SSE_GAP = 0.002


# ---------------------------------------------------------------------------------------------------- servers


async def serve_h11(port: int) -> None:
    from kvasir.net.http import ApiLimits, HttpConnection, HttpError, HttpRequest, serve_http

    async def handle(http: HttpConnection, request: HttpRequest) -> None:
        if request.path == "/json":
            await http.send_json(200, {"object": "list", "data": [{"id": "model", "object": "model"}]})
        elif request.path == "/sse":
            await http.start_sse()
            for i in range(int(request.target.partition("n=")[2] or 10)):
                await http.send_sse({"i": i, "t": time.monotonic_ns()})
                await trio.sleep(SSE_GAP)
            await http.send_sse("[DONE]")
            await http.end_message()
        elif request.path == "/big":
            await http.send(h11.Response(status_code=200, headers=[("content-length", str(BIG_BYTES))]))
            block = b"x" * BLOCK
            for _ in range(BIG_BYTES // BLOCK):
                await http.send(h11.Data(data=block))
            await http.send(h11.EndOfMessage())
        elif request.path == "/upload":
            await http.send_json(200, {"bytes": len(request.body)})
        else:
            raise HttpError(404, "not_found", request.path)

    limits = ApiLimits(send_timeout=SEND_TIMEOUT, max_body_bytes=MAX_BODY)
    await serve_http(handle, "127.0.0.1", port, limits=limits)


async def serve_hypercorn(port: int) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    async def small(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "model", "object": "model"}]})

    async def sse(request: Request) -> Response:
        n = int(request.query_params.get("n", "10"))

        async def gen() -> AsyncIterator[bytes]:
            for i in range(n):
                yield f"data: {json.dumps({'i': i, 't': time.monotonic_ns()})}\n\n".encode()
                await trio.sleep(SSE_GAP)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def big(request: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            block = b"x" * BLOCK
            for _ in range(BIG_BYTES // BLOCK):
                yield block

        return StreamingResponse(gen(), headers={"content-length": str(BIG_BYTES)})

    async def upload(request: Request) -> Response:
        return JSONResponse({"bytes": len(await request.body())})

    app = Starlette(
        routes=[
            Route("/json", small),
            Route("/sse", sse),
            Route("/big", big),
            Route("/upload", upload, methods=["POST"]),
        ]
    )
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    await serve(app, config)  # type: ignore[arg-type, unused-ignore]  # typed only when hypercorn is installed


def hypercorn_missing() -> str | None:
    try:
        import hypercorn.trio  # noqa: F401
        import starlette  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (pip install hypercorn starlette)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------------- client


class Conn:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, port: int, rcvbuf: int | None = None) -> Conn:
        sock = trio.socket.socket()
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        await sock.connect(("127.0.0.1", port))
        return cls(trio.SocketStream(sock))

    async def send_request(self, method: str, target: str, headers: list[tuple[str, str]] | None = None) -> None:
        hdrs = [("host", "bench"), *(headers or [])]
        data = self.h11.send(h11.Request(method=method, target=target, headers=hdrs))
        assert data is not None
        await self.stream.send_all(data)
        if method == "GET":
            end = self.h11.send(h11.EndOfMessage())
            assert end is not None
            await self.stream.send_all(end)

    async def next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(await self.stream.receive_some(BLOCK))
                continue
            return event

    async def get(self, target: str) -> int:
        await self.send_request("GET", target)
        status = 0
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.EndOfMessage):
                self.h11.start_next_cycle()
                return status


async def requests_per_second(port: int, seconds: float, connections: int) -> float:
    done = 0

    async def worker() -> None:
        nonlocal done
        conn = await Conn.open(port)
        async with conn.stream:
            with trio.move_on_after(seconds):
                while True:
                    assert await conn.get("/json") == 200
                    done += 1

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for _ in range(connections):
            nursery.start_soon(worker)
    return done / (trio.current_time() - start)


async def sse_latency_ms(port: int, events: int) -> list[float]:
    """Per event: client read time minus the server's write time (both CLOCK_MONOTONIC on one host)."""
    conn = await Conn.open(port)
    lat: list[float] = []
    async with conn.stream:
        await conn.send_request("GET", f"/sse?n={events}")
        buf = b""
        while True:
            event = await conn.next_event()
            if isinstance(event, h11.Data):
                now = time.monotonic_ns()
                buf += bytes(event.data)
                while b"\n\n" in buf:
                    line, buf = buf.split(b"\n\n", 1)
                    payload = line.removeprefix(b"data: ")
                    if payload != b"[DONE]":
                        lat.append((now - json.loads(payload)["t"]) / 1e6)
            elif isinstance(event, h11.EndOfMessage):
                return lat


async def send_timeout_kept(port: int) -> bool:
    """Request 64 MiB, read nothing for 3 × send_timeout, then read: a server that dropped us sent less."""
    conn = await Conn.open(port, rcvbuf=64 * 1024)
    got = 0
    async with conn.stream:
        await conn.send_request("GET", "/big")
        await trio.sleep(3 * SEND_TIMEOUT)
        with trio.move_on_after(30):
            try:
                while data := await conn.stream.receive_some(BLOCK * 4):
                    got += len(data)
            except trio.BrokenResourceError:
                pass
    return got < BIG_BYTES


async def body_limit_kept(port: int) -> bool:
    """Announce a 10 MiB body and send none of it: a 413 within 2 s means the limit is checked before reading."""
    conn = await Conn.open(port)
    async with conn.stream:
        await conn.send_request("POST", "/upload", [("content-length", str(10 * MAX_BODY))])
        with trio.move_on_after(2):
            event = await conn.next_event()
            return isinstance(event, h11.Response) and event.status_code == 413
    return False


# ---------------------------------------------------------------------------------------------------- driver


@attrs.frozen
class Result:
    rps: float
    sse_p50: float
    sse_p99: float
    send_timeout: bool
    body_limit: bool


def start_server(kind: str, port: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), *sys.path])}
    return subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)], env=env)


async def wait_listening(port: int) -> None:
    with trio.fail_after(20):
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.05)
                continue
            await stream.aclose()
            return


async def measure(kind: str, args: argparse.Namespace) -> Result:
    port = free_port()
    proc = start_server(kind, port)
    try:
        await wait_listening(port)
        await requests_per_second(port, 0.3, args.connections)  # warm up
        rps = await requests_per_second(port, args.seconds, args.connections)
        lat = sorted(await sse_latency_ms(port, args.events))
        return Result(
            rps=rps,
            sse_p50=statistics.median(lat),
            sse_p99=lat[min(len(lat) - 1, int(len(lat) * 0.99))],
            send_timeout=await send_timeout_kept(port),
            body_limit=await body_limit_kept(port),
        )
    finally:
        proc.terminate()
        proc.wait()


def table(results: dict[str, Result]) -> str:
    base = results["h11 (kvasir.net.http)"]
    rows = [("server", "JSON req/s", "ratio", "SSE p50 ms", "SSE p99 ms", "send timeout", "body limit pre-read")]
    for name, r in results.items():
        rows.append(
            (
                name,
                f"{r.rps:.0f}",
                f"{r.rps / base.rps:.2f}",
                f"{r.sse_p50:.2f}",
                f"{r.sse_p99:.2f}",
                "kept" if r.send_timeout else "lost",
                "kept" if r.body_limit else "lost",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> None:
    results = {"h11 (kvasir.net.http)": await measure("h11", args)}
    missing = hypercorn_missing()
    if missing is None:
        results["hypercorn trio + Starlette"] = await measure("hypercorn", args)
    print(table(results))
    gap = SSE_GAP * 1e3
    print(f"{args.connections} connections × {args.seconds:.1f} s; {args.events} SSE events {gap:.0f} ms apart")
    if missing is not None:
        print(f"hypercorn + Starlette skipped: {missing}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--connections", type=int, default=8)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--serve", choices=("h11", "hypercorn"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        server = serve_h11 if args.serve == "h11" else serve_hypercorn
        with contextlib.suppress(KeyboardInterrupt):
            trio.run(server, args.port)
        return
    trio.run(run, args)


if __name__ == "__main__":
    main()
