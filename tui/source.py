"""Where the TUI's messages come from: a node's control socket, or a recorded session replayed (tests, docs).

A source has three operations, each on its own connection so that none waits for another: ``watch`` (status
snapshots and events until the connection ends), ``generate`` (one prompt's stream) and ``cancel``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from kvasir.core.errors import KvasirError

#: Longest line accepted from the node (a status of a large ring is a few KiB).
MAX_LINE = 1 << 20

Message = dict[str, Any]


class SourceError(Exception):
    """The node answered with an error, or the connection could not be made or was lost."""


class Source(Protocol):
    @property
    def label(self) -> str: ...

    def watch(self, interval: float) -> AsyncIterator[Message]:
        """Messages of one ``watch`` connection; raises SourceError (or OSError) when it cannot connect or is lost."""
        ...

    def generate(self, request: Mapping[str, Any]) -> AsyncIterator[Message]:
        """One ``generate`` op's messages, ``accepted`` … ``end``; the connection closes when iteration stops."""
        ...

    async def cancel(self, request_id: int) -> None: ...


class SocketSource:
    """A node's control socket (JSON lines over a Unix socket).

    ``find`` (a bare ``kvasir tui``): how the socket was found; it is asked again before each ``watch`` connection,
    so the TUI follows a ring restarted with new ports, hence new socket names. It raises KvasirError when there is
    no node. Without it (``--socket``) the path stays. ``generate`` and ``cancel`` go to the node last watched.
    """

    def __init__(self, path: Path, *, find: Callable[[], Path] | None = None) -> None:
        self.path = path
        self.find = find

    @property
    def label(self) -> str:
        return str(self.path)

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        try:
            reader, writer = await asyncio.open_unix_connection(str(self.path), limit=MAX_LINE)
        except OSError as exc:
            raise SourceError(f"cannot reach {self.path}: {exc.strerror or exc}") from None
        try:
            yield reader, writer
        finally:
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await writer.wait_closed()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, obj: Mapping[str, Any]) -> None:
        writer.write(json.dumps(obj).encode() + b"\n")
        await writer.drain()

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> Message | None:
        try:
            line = await reader.readline()
        except (ValueError, asyncio.LimitOverrunError) as exc:
            raise SourceError(f"bad line from the node: {exc}") from None
        if not line:
            return None
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise SourceError(f"bad JSON from the node: {exc}") from None
        if not isinstance(obj, dict):
            raise SourceError("the node sent a line that is not a JSON object")
        return obj

    async def watch(self, interval: float) -> AsyncIterator[Message]:
        if self.find is not None:
            try:
                self.path = self.find()
            except KvasirError as exc:
                raise SourceError(str(exc)) from None
        async with self._connect() as (reader, writer):
            await self._send(writer, {"op": "watch", "interval": interval})
            while True:
                msg = await self._read(reader)
                if msg is None:
                    raise SourceError("the node closed the connection")
                yield msg

    async def generate(self, request: Mapping[str, Any]) -> AsyncIterator[Message]:
        async with self._connect() as (reader, writer):
            await self._send(writer, {"op": "generate", **request})
            while True:
                msg = await self._read(reader)
                if msg is None:
                    raise SourceError("the node closed the connection before the answer ended")
                yield msg
                if msg.get("type") in ("end", "error"):
                    return

    async def cancel(self, request_id: int) -> None:
        async with self._connect() as (reader, writer):
            await self._send(writer, {"op": "cancel", "request": request_id})
            msg = await self._read(reader)
            if msg is not None and msg.get("type") == "error":
                raise SourceError(str(msg.get("error")))


class ReplaySource:
    """A recorded session: ``{"stream": "watch"|"generate", "msg": {...}}`` lines, replayed in order.

    ``watch`` yields the recorded watch messages, then stays connected and quiet (with ``hang_up``: the connection
    ends there, as when the node goes away, and every later ``watch`` fails to connect); ``generate`` yields the
    recorded answer whatever the prompt. ``requests`` keeps what was asked, ``cancelled`` what was cancelled.
    """

    def __init__(self, records: Iterable[Mapping[str, Any]], label: str = "replay", *, hang_up: bool = False) -> None:
        self._label = label
        self.hang_up = hang_up
        self._watched = False
        self.watch_msgs: list[Message] = []
        self.generate_msgs: list[Message] = []
        for rec in records:
            target = self.generate_msgs if rec.get("stream") == "generate" else self.watch_msgs
            target.append(dict(rec["msg"]))
        self.requests: list[dict[str, Any]] = []
        self.cancelled: list[int] = []
        self.replayed = asyncio.Event()

    @classmethod
    def from_file(cls, path: Path, *, hang_up: bool = False) -> ReplaySource:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return cls(records, label=path.name, hang_up=hang_up)

    @property
    def label(self) -> str:
        return self._label

    async def watch(self, interval: float) -> AsyncIterator[Message]:
        if self.hang_up and self._watched:
            raise SourceError(f"cannot reach {self._label}: the recording has ended")
        self._watched = True
        for msg in self.watch_msgs:
            yield msg
        self.replayed.set()
        if self.hang_up:
            raise SourceError("the node closed the connection")
        await asyncio.Event().wait()  # stay connected

    async def generate(self, request: Mapping[str, Any]) -> AsyncIterator[Message]:
        self.requests.append(dict(request))
        for msg in self.generate_msgs:
            yield msg
            await asyncio.sleep(0)

    async def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)
