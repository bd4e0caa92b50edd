"""``kvasir serve-model``: serve one GGUF over HTTP with Range support, so any node can seed a model.

Runs on the shared HTTP plumbing (kvasir.net.http). GET and HEAD on ``/`` or ``/<file name>``; a single
``Range: bytes=a-b`` (or ``a-``, ``-n``) gets 206 with ``Content-Range``; an unsatisfiable one 416; anything else
the whole file. The strong ETag is the file's sha256 (the model's identity). The file is streamed in blocks from
a trio file object, never read whole.
"""

from __future__ import annotations

import re
import ssl
from pathlib import Path

import h11
import trio

from kvasir.core.errors import ModelFileError
from kvasir.net.http import ApiLimits, HttpConnection, HttpError, HttpRequest, serve_http

BLOCK_BYTES = 256 * 1024
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
SEED_LIMITS = ApiLimits(max_body_bytes=0, send_timeout=120.0)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """``(offset, length)`` of a single byte range (pure); None for the whole file; HttpError 416 if unsatisfiable."""
    if header is None:
        return None
    m = _RANGE.match(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None  # multiple or malformed ranges: RFC 9110 lets a server ignore Range
    first, last = m.group(1), m.group(2)
    if not first:
        n = min(int(last), size)
        if n == 0:
            raise _unsatisfiable(size)
        return size - n, n
    a = int(first)
    b = min(int(last), size - 1) if last else size - 1
    if a >= size or b < a:
        raise _unsatisfiable(size)
    return a, b - a + 1


def _unsatisfiable(size: int) -> HttpError:
    return HttpError(416, "range_not_satisfiable", "range not satisfiable", [("content-range", f"bytes */{size}")])


class ModelSeeder:
    def __init__(self, path: Path, sha256: str) -> None:
        if not path.is_file():
            raise ModelFileError(f"{path}: no such file")
        self.path = path
        self.sha256 = sha256
        self.size = path.stat().st_size

    async def handle(self, http: HttpConnection, request: HttpRequest) -> None:
        if request.path not in ("/", f"/{self.path.name}"):
            raise HttpError(404, "not_found", f"this seeder serves /{self.path.name}")
        if request.method not in ("GET", "HEAD"):
            raise HttpError(405, "method_not_allowed", f"{request.method} {request.path}", [("allow", "GET, HEAD")])
        headers = dict(request.headers)
        rng = parse_range(headers.get("range"), self.size)
        off, n = rng if rng is not None else (0, self.size)
        hdrs = [
            ("content-type", "application/octet-stream"),
            ("content-length", str(n)),
            ("accept-ranges", "bytes"),
            ("etag", f'"{self.sha256}"'),
            ("server", "kvasir"),
        ]
        if rng is not None:
            hdrs.append(("content-range", f"bytes {off}-{off + n - 1}/{self.size}"))
        await http.send(h11.Response(status_code=206 if rng is not None else 200, headers=hdrs))
        if request.method == "GET":
            async with await trio.open_file(self.path, "rb") as fh:
                await fh.seek(off)
                left = n
                while left:
                    block = await fh.read(min(BLOCK_BYTES, left))
                    if not block:
                        raise ModelFileError(f"{self.path}: file shrank while serving")
                    await http.send(h11.Data(data=block))
                    left -= len(block)
        await http.send(h11.EndOfMessage())


async def serve_model(
    path: Path,
    sha256: str,
    host: str,
    port: int,
    *,
    tls: ssl.SSLContext | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``path`` on ``host:port`` (0: any free port) until cancelled; ``started(bound_port)``. ``tls``: HTTPS."""
    seeder = ModelSeeder(path, sha256)
    await serve_http(
        seeder.handle, host, port, limits=SEED_LIMITS, name="model seeder", tls=tls, task_status=task_status
    )
