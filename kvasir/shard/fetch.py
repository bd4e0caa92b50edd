"""Download one window of a GGUF over HTTP Range requests and write the stage file ``kvasir slice`` would.

Only the header and the window's tensor bytes cross the network. They land at their original offsets in a sparse
temp file as large as the source; :func:`kvasir.shard.slice.slice_model` then cuts the stage from it exactly as
from the whole file, so the result is byte-identical. Fetched ranges are recorded beside the temp file, so an
interrupted download resumes where it stopped. The stage is verified against the expected sha256 before it is
renamed into place: a source that serves wrong bytes or lies about lengths leaves nothing half-written.

The header is read with no overshoot and within a cap: the one GGUF header cursor
(:class:`kvasir.shard.gguf_header.HeaderCursor`) says how many bytes it needs and a lower bound of where the header
ends, and each request asks for exactly up to that bound, so none reaches past the header's end and a header that
claims more than ``max_header_bytes`` fails before it is fetched.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from kvasir.core.errors import InputError, ModelFileError
from kvasir.shard.cache import file_sha256
from kvasir.shard.gguf_file import describe
from kvasir.shard.gguf_header import DEFAULT_LIMITS, PREAMBLE_BYTES, GGUFHeader, HeaderCursor, HeaderLimits
from kvasir.shard.gguf_io import GGUFFile
from kvasir.shard.slice import check_window, slice_model, window_ranges
from kvasir.util.files import atomic_output
from kvasir.util.tls import client_context, tls_failure

#: Largest piece of a range fetched in one request (also the resume granularity).
PIECE_BYTES = 16 << 20
#: Bytes buffered before one write to the temp file.
WRITE_BYTES = 4 << 20
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")

Progress = Callable[[int, int], None]


class SourceError(InputError):
    """The HTTP source cannot serve the window: no Range support, wrong lengths, wrong bytes, unreachable."""


# ---------------------------------------------------------------------------------------------- resume state


@attrs.define
class _Resume:
    """What is already in the temp file: written atomically after every piece."""

    path: Path
    source_bytes: int
    etag: str | None
    header_end: int | None = None
    done: list[tuple[int, int]] = attrs.field(factory=list)

    def save(self) -> None:
        data = {
            "source_bytes": self.source_bytes,
            "etag": self.etag,
            "header_end": self.header_end,
            "done": [list(r) for r in self.done],
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: Path, source_bytes: int, etag: str | None) -> _Resume | None:
        try:
            d = json.loads(path.read_text())
            state = cls(
                path, int(d["source_bytes"]), d["etag"], d["header_end"], [(int(a), int(n)) for a, n in d["done"]]
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return state if (state.source_bytes, state.etag) == (source_bytes, etag) else None

    def has(self, off: int, n: int) -> bool:
        return any(a <= off and off + n <= a + m for a, m in self.done)


# ---------------------------------------------------------------------------------------------- the fetch


@attrs.frozen
class FetchResult:
    path: Path
    start: int
    end: int
    #: Bytes received over the network in this run.
    bytes_fetched: int
    #: Header bytes (metadata and tensor infos) and window tensor bytes the stage needs from the source.
    header_bytes: int
    window_bytes: int
    #: Bytes already present from an interrupted earlier run.
    resumed_bytes: int
    stage_bytes: int
    sha256: str
    source_bytes: int
    seconds: float


class _Source:
    """One HTTP source read with Range requests; every reply is checked against what was asked."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client = client
        self.url = url
        self.size: int | None = None
        self.etag: str | None = None
        self.fetched = 0

    async def read_into(self, off: int, n: int, sink: Callable[[int, bytes], Awaitable[None]]) -> None:
        """Fetch [off, off+n) and hand it to ``sink(offset, data)`` in order."""
        headers = {"range": f"bytes={off}-{off + n - 1}", "accept-encoding": "identity"}
        try:
            async with self.client.stream("GET", self.url, headers=headers) as r:
                self._check_reply(r, off, n)
                got = 0
                async for chunk in r.aiter_raw():
                    if got + len(chunk) > n:
                        raise SourceError(f"{self.url}: sent more than the {n} bytes asked for (lies about lengths)")
                    await sink(off + got, chunk)
                    got += len(chunk)
                    self.fetched += len(chunk)
                if got != n:
                    raise SourceError(f"{self.url}: sent {got} of {n} bytes asked for")
        except httpx.HTTPError as exc:
            why = tls_failure(exc)
            if why is not None:
                raise SourceError(f"{self.url}: {why}") from None
            raise SourceError(f"{self.url}: {type(exc).__name__}: {exc}") from None

    def _check_reply(self, r: httpx.Response, off: int, n: int) -> None:
        if r.status_code == 200:
            raise SourceError(f"{self.url}: the server does not honour HTTP Range requests (200 to a Range request)")
        if r.status_code != 206:
            raise SourceError(f"{self.url}: HTTP {r.status_code} to a Range request")
        m = _CONTENT_RANGE.match(r.headers.get("content-range", ""))
        if m is None:
            raise SourceError(f"{self.url}: 206 without a valid Content-Range")
        a, b, total = int(m.group(1)), int(m.group(2)), m.group(3)
        if (a, b) != (off, off + n - 1):
            raise SourceError(f"{self.url}: asked for bytes {off}-{off + n - 1}, got {a}-{b} (lies about lengths)")
        if total != "*":
            if self.size is None:
                self.size = int(total)
            elif int(total) != self.size:
                raise SourceError(f"{self.url}: file size changed from {self.size} to {total} (lies about lengths)")
        length = r.headers.get("content-length")
        if length is not None and int(length) != n:
            raise SourceError(f"{self.url}: Content-Length {length} for {n} bytes asked for (lies about lengths)")
        etag = r.headers.get("etag")
        if self.etag is None:
            self.etag = etag
        elif etag is not None and etag != self.etag:
            raise SourceError(f"{self.url}: the file changed while downloading (ETag {self.etag} → {etag})")


def _sha_from_etag(etag: str | None) -> str | None:
    """A strong ETag that is a sha256 (``kvasir serve-model``, Hugging Face LFS files) names the model."""
    if etag is None:
        return None
    tag = etag.removeprefix("W/").strip('"').lower()
    return tag if re.fullmatch(r"[0-9a-f]{64}", tag) else None


def temp_paths(out: Path) -> tuple[Path, Path]:
    """The sparse source file and its resume record, beside ``out``."""
    return out.parent / f".{out.name}.source", out.parent / f".{out.name}.source.json"


async def refuse_unsafe_redirect(r: httpx.Response) -> None:
    """An httpx response hook: follow a redirect only to https on the same host (a source cannot send a node to
    probe other hosts or downgrade to plain http)."""
    if not r.is_redirect:
        return
    target = r.request.url.join(r.headers.get("location", ""))
    if target.scheme != "https" or target.host != r.request.url.host:
        raise SourceError(f"{r.request.url}: refused a redirect to {str(target)[:200]} (only https on the same host)")


async def fetch_window(
    url: str,
    start: int,
    end: int,
    out: Path,
    *,
    sha256: str | None = None,
    model_sha256: str | None = None,
    progress: Progress | None = None,
    client: httpx.AsyncClient | None = None,
    max_header_bytes: int = DEFAULT_LIMITS.max_header_bytes,
    file_bytes: int | None = None,
    tls: ssl.SSLContext | None = None,
) -> FetchResult:
    """Write the stage file of layers [start, end) of the GGUF at ``url`` to ``out``.

    ``sha256``: the stage file's expected hash (the market's window hash); a mismatch raises and writes nothing.
    ``model_sha256``: the whole model's identity, recorded in the stage like ``kvasir slice`` does (default: the
    source's ETag when it is a sha256). ``progress(done, total)`` is called as bytes arrive.
    ``max_header_bytes``: the most header bytes to fetch and buffer (the market's ``header_bytes`` for the model).
    ``file_bytes``: the model's size in the market's signed record; a source that says otherwise is refused before
    anything is allocated for it. ``tls``: how an https source is verified (default: the system's CAs).
    """
    began = time.monotonic()
    if not out.parent.is_dir():
        raise InputError(f"{out}: directory {out.parent} does not exist")
    own = client is None
    client = client or httpx.AsyncClient(
        timeout=httpx.Timeout(30.0),
        follow_redirects=True,
        event_hooks={"response": [refuse_unsafe_redirect]},
        verify=tls if tls is not None else client_context(),
    )
    try:
        return await _fetch(
            client, url, start, end, out, sha256, model_sha256, progress, max_header_bytes, file_bytes, began
        )
    finally:
        if own:
            await client.aclose()


async def _fetch(
    client: httpx.AsyncClient,
    url: str,
    start: int,
    end: int,
    out: Path,
    sha256: str | None,
    model_sha256: str | None,
    progress: Progress | None,
    max_header_bytes: int,
    file_bytes: int | None,
    began: float,
) -> FetchResult:
    src = _Source(client, url)
    sparse, record = temp_paths(out)
    buf = bytearray()

    async def append(_off: int, data: bytes) -> None:
        buf.extend(data)

    await src.read_into(0, PREAMBLE_BYTES, append)
    if src.size is None:
        raise SourceError(f"{url}: the server does not say the file's size (Content-Range */…)")
    size = src.size
    if file_bytes is not None and size != file_bytes:
        raise SourceError(f"{url}: the file has {size} bytes, the model's record says {file_bytes} (wrong file)")
    state = _Resume.load(record, size, src.etag) if sparse.exists() else None
    if state is None:
        state = _Resume(record, size, src.etag)
        with sparse.open("wb") as new:
            new.truncate(size)
    fh = await trio.to_thread.run_sync(lambda: sparse.open("r+b"))
    resumed = 0
    try:
        # The header: from the earlier run, or parsed from requests that never reach past its end.
        cursor = HeaderCursor(url, limits=HeaderLimits(max_header_bytes=max_header_bytes), file_size=size)
        if state.header_end is not None and state.header_end <= max_header_bytes and state.has(0, state.header_end):
            kept = await trio.to_thread.run_sync(os.pread, fh.fileno(), state.header_end, 0)
            step = cursor.feed(kept)
            if not isinstance(step, GGUFHeader) or step.header_end != state.header_end:
                raise ModelFileError(f"{sparse}: the header kept from an earlier run is incomplete")
            resumed += step.header_end
        else:
            step = cursor.feed(buf)
            await trio.to_thread.run_sync(os.pwrite, fh.fileno(), bytes(buf), 0)
            while not isinstance(step, GGUFHeader):
                at = cursor.buffered
                buf.clear()
                await src.read_into(at, step.header_ends_after - at, append)
                await trio.to_thread.run_sync(os.pwrite, fh.fileno(), bytes(buf), at)
                step = cursor.feed(buf)
            state.header_end = step.header_end
            state.done.append((0, step.header_end))
            await trio.to_thread.run_sync(state.save)
        header_end = step.header_end
        gg = GGUFFile.from_header(sparse, step, size)
        check_window(describe(sparse, gg), start, end)
        ranges = window_ranges(gg, start, end)
        window_bytes = sum(n for _, n in ranges)
        pieces = [(o, min(PIECE_BYTES, off + n - o)) for off, n in ranges for o in range(off, off + n, PIECE_BYTES)]
        total = header_end + window_bytes
        done = header_end + sum(n for o, n in pieces if state.has(o, n))
        resumed += done - header_end
        if progress:
            progress(done, total)
        for off, n in pieces:
            if state.has(off, n):
                continue
            await _fetch_piece(src, fh, off, n, progress, done, total)
            done += n
            state.done.append((off, n))
            await trio.to_thread.run_sync(state.save)
    except ModelFileError:
        _discard(sparse, record)  # a bad header stays bad: nothing to resume
        raise
    finally:
        await trio.to_thread.run_sync(fh.close)

    model_sha = model_sha256 or _sha_from_etag(src.etag)
    staged = out.parent / f".{out.name}.unverified"
    try:
        res = await trio.to_thread.run_sync(lambda: slice_model(sparse, start, end, staged, source_sha256=model_sha))
        digest = await trio.to_thread.run_sync(file_sha256, staged)
        if sha256 is not None and digest != sha256:
            _discard(sparse, record)
            raise SourceError(
                f"{url}: the window's stage file has sha256 {digest[:12]}…, expected {sha256[:12]}… (wrong bytes)"
            )
        with atomic_output(out) as tmp:
            os.replace(staged, tmp)
    finally:
        staged.unlink(missing_ok=True)
    _discard(sparse, record)
    return FetchResult(
        path=out,
        start=start,
        end=end,
        bytes_fetched=src.fetched,
        header_bytes=header_end,
        window_bytes=window_bytes,
        resumed_bytes=resumed,
        stage_bytes=res.stage_bytes,
        sha256=digest,
        source_bytes=size,
        seconds=time.monotonic() - began,
    )


async def _fetch_piece(
    src: _Source, fh: Any, off: int, n: int, progress: Progress | None, done: int, total: int
) -> None:
    """Fetch one piece into the temp file at its offset, writing in large blocks from a worker thread."""
    pending: list[bytes] = []
    state = {"at": off, "size": 0, "seen": 0}

    async def flush() -> None:
        if pending:
            data = b"".join(pending)
            pending.clear()
            await trio.to_thread.run_sync(os.pwrite, fh.fileno(), data, state["at"])
            state["at"] += len(data)
            state["size"] = 0

    async def sink(_off: int, data: bytes) -> None:
        pending.append(data)
        state["size"] += len(data)
        state["seen"] += len(data)
        if state["size"] >= WRITE_BYTES:
            await flush()
        if progress:
            progress(done + state["seen"], total)

    await src.read_into(off, n, sink)
    await flush()


def _discard(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def verify_stage(path: Path, sha256: str) -> bool:
    """Whether an existing stage file has the expected hash (a node reuses a stage it fetched before)."""
    return path.is_file() and file_sha256(path) == sha256
