"""A byte stream over a message transport, so one TLS session can run end to end inside relay messages.

The relay forwards whole WebSocket messages; TLS wants a byte stream. Each ``send_all`` becomes one or more
messages (at most ``max_message_bytes`` each) and ``receive_some`` hands out the bytes of received messages in
order. The relay then sees only message sizes and timing, never a frame or a token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from kvasir.core.errors import RingError


class MessageStream(trio.abc.Stream):
    """``trio.abc.Stream`` over ``send_message`` / ``receive_message`` callables (one sender, one receiver)."""

    def __init__(
        self,
        send_message: Callable[[bytes], Awaitable[None]],
        receive_message: Callable[[], Awaitable[bytes]],
        close: Callable[[], Awaitable[None]],
        *,
        max_message_bytes: int = 1 << 20,
        closed_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._send_message = send_message
        self._receive_message = receive_message
        self._close = close
        self._max = max_message_bytes
        self._closed_errors = closed_errors  # the transport's "peer closed" exceptions: end of stream for us
        self._pending = memoryview(b"")
        self._eof = False
        self._send_guard = trio.Lock()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(bytes(data))
        async with self._send_guard:
            try:
                for start in range(0, len(view), self._max):
                    await self._send_message(bytes(view[start : start + self._max]))
            except self._closed_errors as exc:
                raise trio.BrokenResourceError("the relay link closed") from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._pending:
            if self._eof:
                return b""
            try:
                message = await self._receive_message()
            except self._closed_errors:
                self._eof = True
                return b""
            if not isinstance(message, bytes):
                raise RingError("a relay message that is not binary")
            self._pending = memoryview(message)
        n = len(self._pending) if max_bytes is None else min(max_bytes, len(self._pending))
        out, self._pending = bytes(self._pending[:n]), self._pending[n:]
        return out

    async def aclose(self) -> None:
        await self._close()
