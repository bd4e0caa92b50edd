"""Ring links: a message-oriented connection to one neighbour, over TCP or a relay bridge.

A link carries whole wire frames. Over TCP they are length-prefixed on the byte stream (``FrameReader``); over a
relay each frame is one WebSocket message. Both count frames and bytes each way and measure the hop's round trip
with KEEPALIVE echoes, which the TUI and ``kvasir status`` show.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import attrs
import trio

from kvasir.core.errors import ProtocolError, RingError
from kvasir.wire import (
    MAX_FRAME_BYTES,
    Error,
    ErrorCode,
    Frame,
    FrameReader,
    Hello,
    Side,
    decode_frame,
    neighbour_problem,
)

HANDSHAKE_TIMEOUT = 10.0


@attrs.define
class LinkStats:
    """Counters for one link; read by the control socket, written only by the link's owner."""

    kind: str = "direct"
    peer: str = ""
    frames_out: int = 0
    bytes_out: int = 0
    frames_in: int = 0
    bytes_in: int = 0
    #: Last measured round-trip of a KEEPALIVE echo, seconds (None until measured).
    rtt: float | None = None
    connected_at: float = attrs.field(factory=time.monotonic)
    #: Authenticated by key and encrypted (protocol v2).
    secure: bool = False


class Link(Protocol):
    stats: LinkStats

    async def send(self, frame: Frame) -> None: ...

    async def receive(self) -> Frame:
        """The next frame; raises ``trio.EndOfChannel`` when the peer closed, ProtocolError on bad data."""
        ...

    async def aclose(self) -> None: ...


class StreamLink:
    """A link over a byte stream (TCP): frames back to back, one sender at a time."""

    def __init__(
        self, stream: trio.abc.Stream, peer: str, max_frame_bytes: int = MAX_FRAME_BYTES, *, kind: str = "direct"
    ) -> None:
        self._stream = stream
        self._reader = FrameReader(stream, max_frame_bytes=max_frame_bytes)
        self._send_lock = trio.Lock()
        self.stats = LinkStats(kind=kind, peer=peer)

    @property
    def max_frame_bytes(self) -> int:
        return self._reader.max_frame_bytes

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        self._reader.max_frame_bytes = value

    async def send(self, frame: Frame) -> None:
        data = frame.to_wire()
        async with self._send_lock:
            await self._stream.send_all(data)
        self.stats.frames_out += 1
        self.stats.bytes_out += len(data)

    async def receive(self) -> Frame:
        frame = await self._reader.receive()
        self.stats.frames_in += 1
        self.stats.bytes_in = self._reader.bytes_received
        return frame

    async def aclose(self) -> None:
        await self._stream.aclose()


class MessageLink:
    """A link over a message transport (a relay's WebSocket): one frame per message."""

    def __init__(
        self,
        send_message: Callable[[bytes], Awaitable[None]],
        receive_message: Callable[[], Awaitable[bytes]],
        close: Callable[[], Awaitable[None]],
        peer: str,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ) -> None:
        self._send_message = send_message
        self._receive_message = receive_message
        self._close = close
        self._max = max_frame_bytes
        self._send_lock = trio.Lock()
        self.stats = LinkStats(kind="relay", peer=peer)

    async def send(self, frame: Frame) -> None:
        data = frame.to_wire()
        async with self._send_lock:
            await self._send_message(data)
        self.stats.frames_out += 1
        self.stats.bytes_out += len(data)

    async def receive(self) -> Frame:
        data = await self._receive_message()
        frame = decode_frame(data, max_frame_bytes=self._max)
        self.stats.frames_in += 1
        self.stats.bytes_in += len(data)
        return frame

    async def aclose(self) -> None:
        await self._close()


async def handshake(
    link: Link, local: Hello, side: Side, *, send_first: bool, check: Callable[[Hello], str | None] | None = None
) -> Hello:
    """Exchange HELLOs; refuse (ERROR frame, then RingError) a neighbour that cannot join this node, or whose HELLO
    ``check`` finds a problem with (the acceptor says nothing of itself to such a peer)."""
    with trio.fail_after(HANDSHAKE_TIMEOUT):
        if send_first:
            await link.send(local)
        try:
            remote = await link.receive()
        except trio.EndOfChannel:
            raise RingError(f"{side.value} closed the link during the handshake") from None
        except ProtocolError as exc:  # not a frame, a bad version, too large: say why before closing
            await _refuse(link, ErrorCode.PROTOCOL, str(exc), local.rank)
            raise
        if isinstance(remote, Error):
            raise RingError(f"{side.value} refused this node: {remote.message}")
        if not isinstance(remote, Hello):
            reason = f"expected HELLO from the {side.value}, got {type(remote).__name__}"
            await _refuse(link, ErrorCode.PROTOCOL, reason, local.rank)
            raise ProtocolError(reason)
        problem = neighbour_problem(local, remote, side)
        if problem is None and check is not None:
            refused = check(remote)
            problem = None if refused is None else (ErrorCode.WINDOW_MISMATCH, refused)
        if problem is not None:
            code, reason = problem
            await _refuse(link, code, reason, local.rank)
            raise RingError(reason)
        if not send_first:
            await link.send(local)
    return remote


async def _refuse(link: Link, code: ErrorCode, reason: str, rank: int) -> None:
    """Best effort: the peer may be gone or not read at all."""
    with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, RingError):
        await link.send(Error.truncating(code, reason, rank))


def link_error(reason: str, rank: int) -> Error:
    return Error.truncating(ErrorCode.PROTOCOL, reason, rank)
