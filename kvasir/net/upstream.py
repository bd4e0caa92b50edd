"""One HTTP/1.1 exchange with an upstream server, as a proxy needs it: send a request, read the answer's head, then
its body whole or its server-sent events one by one (``ring up``'s API front talks to the nodes' APIs this way).

A connection per request (``connection: close``): the upstreams are on loopback, so it is cheap, and an answer can
never be confused with the next one's.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import h11
import trio

from kvasir.net.http import RECEIVE_BYTES


class UpstreamLost(Exception):
    """The upstream closed or broke the connection before its answer was complete (or sent one too large)."""


@attrs.frozen
class UpstreamHead:
    """An answer's status and headers (names lower-cased)."""

    status: int
    headers: tuple[tuple[str, str], ...]

    @property
    def event_stream(self) -> bool:
        return dict(self.headers).get("content-type", "").startswith("text/event-stream")


class Upstream:
    """One request and its answer on ``stream``; every read beyond ``max_bytes`` of body is :class:`UpstreamLost`."""

    def __init__(self, stream: trio.abc.Stream, *, max_bytes: int) -> None:
        self.stream = stream
        self.max_bytes = max_bytes
        self._h11 = h11.Connection(h11.CLIENT)
        self._buffer = b""
        self._ended = False

    async def send_request(self, method: str, target: str, headers: Sequence[tuple[str, str]], body: bytes) -> None:
        hdrs = [*headers, ("content-length", str(len(body))), ("connection", "close")]
        data = self._h11.send(h11.Request(method=method, target=target, headers=hdrs)) or b""
        if body:
            data += self._h11.send(h11.Data(data=body)) or b""
        data += self._h11.send(h11.EndOfMessage()) or b""
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise UpstreamLost(str(exc)) from None

    async def head(self) -> UpstreamHead:
        event = await self._next_event()
        if not isinstance(event, h11.Response):
            raise UpstreamLost(f"expected an answer's head, got {type(event).__name__}")
        headers = tuple((k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in event.headers)
        return UpstreamHead(event.status_code, headers)

    async def body(self) -> bytes:
        """The whole body (after :meth:`head`)."""
        parts: list[bytes] = []
        size = 0
        while True:
            event = await self._next_event()
            if isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > self.max_bytes:
                    raise UpstreamLost("an answer larger than the proxy takes")
                parts.append(bytes(event.data))

    async def next_sse_event(self) -> bytes | None:
        """The next whole server-sent event, without its ``\\n\\n`` (a partial one is never returned); None at the
        answer's end."""
        while b"\n\n" not in self._buffer:
            if self._ended:
                if self._buffer.strip():
                    raise UpstreamLost("the stream ended inside an event")
                return None
            event = await self._next_event()
            if isinstance(event, h11.Data):
                self._buffer += bytes(event.data)
                if len(self._buffer) > self.max_bytes:
                    raise UpstreamLost("an event larger than the proxy takes")
            elif isinstance(event, h11.EndOfMessage):
                self._ended = True
        event, self._buffer = self._buffer.split(b"\n\n", 1)
        return event

    async def _next_event(self) -> object:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise UpstreamLost(f"malformed answer: {exc}") from None
            if event is h11.NEED_DATA:
                try:
                    data = await self.stream.receive_some(RECEIVE_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    raise UpstreamLost(str(exc)) from None
                self._h11.receive_data(bytes(data))
                continue
            if isinstance(event, h11.ConnectionClosed):
                raise UpstreamLost("connection closed")
            if isinstance(event, h11.InformationalResponse):
                continue
            return event
