"""Test helpers shared by the link tests: a recording stream and a wait on node state."""

from __future__ import annotations

from collections.abc import Callable

import trio


class Tap(trio.abc.Stream):
    """Wraps a stream and appends every byte sent through it to ``sent``: what an on-path observer captures."""

    def __init__(self, inner: trio.abc.Stream, sent: bytearray | None = None) -> None:
        self.inner = inner
        self.sent = bytearray() if sent is None else sent

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.sent += data
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def wait_for(cond: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Wait on node state (trio clock: instant under MockClock) instead of sleeping a guessed time."""
    with trio.move_on_after(limit):
        while not cond():  # noqa: ASYNC110 (node state has no event to wait on)
            await trio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")
