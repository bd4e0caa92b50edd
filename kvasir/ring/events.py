"""A broadcast of node events (tokens passing, request lifecycle) to observers such as the TUI.

Observers never slow the node: each gets a bounded channel, and an event that does not fit is dropped for that
observer (counted, so it can show that it missed some). Events are plain JSON-able dicts.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

Event = dict[str, Any]


class EventHub:
    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._subscribers: list[trio.MemorySendChannel[Event]] = []
        self.dropped = 0

    def publish(self, event: Event) -> None:
        for ch in list(self._subscribers):
            try:
                ch.send_nowait(event)
            except trio.WouldBlock:
                self.dropped += 1
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self._subscribers.remove(ch)

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[trio.MemoryReceiveChannel[Event]]:
        send, receive = trio.open_memory_channel[Event](self._capacity if self._capacity else math.inf)
        self._subscribers.append(send)
        try:
            async with receive:
                yield receive
        finally:
            if send in self._subscribers:
                self._subscribers.remove(send)
            send.close()
