"""A node's events, typed, and the two ways they leave the node.

- :class:`EventHub` broadcasts every event to observers such as the TUI (the control socket's ``watch``). It is
  lossy on purpose: observers never slow the node, so each gets a bounded channel and an event that does not fit is
  dropped for that observer (counted). Nothing that counts may read it.
- :class:`EndListeners` calls every listener with every :class:`RequestEnded`, synchronously, as the request
  ends: lossless. Accounting subscribes here (the node's signed receipts, the market agent's demand reports and
  witness receipts, which are what the market credits).

Events are frozen attrs records on the project's converter (:mod:`kvasir.core.schema`). On the control socket each
is one JSON object tagged by ``type`` (and ``state`` for the request lifecycle): :func:`event_to_wire` writes it,
the converter reads it back (:func:`event_from_wire`) (docs/protocol.md § Control socket).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import trio

from kvasir.core.errors import InputError
from kvasir.core.schema import Json, converter, register_record, structure

log = logging.getLogger("kvasir.events")


@attrs.frozen
class TokenPassed:
    """A generated token passed this node (``index``: its place in the request's output)."""

    request: int
    index: int
    token: int
    text: str


@attrs.frozen
class RequestStarted:
    """A request took a sequence here; ``entry_rank`` is the node that streams its tokens to the client."""

    request: int
    prompt_tokens: int
    entry_rank: int


@attrs.frozen
class RequestEnded:
    """A request ended here after ``generated`` tokens passed this node. Defaults: fields an older node left out."""

    request: int
    reason: str
    generated: int = 0
    error: str | None = None
    entry_rank: int | None = None
    #: The client's signed authorisation from START (the lossless end listeners only: observers never see it).
    client_auth: str | None = None


@attrs.frozen
class FailedOver:
    """The successor link came back (a new or returning holder of ``window``) and this node replayed to it."""

    rank: int
    window: tuple[int, int]
    requests: int
    frames: int
    bytes: int
    stall_s: float | None


NodeEvent = TokenPassed | RequestStarted | RequestEnded | FailedOver

#: The tag each event carries on the wire, before its fields.
_TAGS: dict[type[Any], dict[str, str]] = {
    TokenPassed: {"type": "token"},
    RequestStarted: {"type": "request", "state": "start"},
    RequestEnded: {"type": "request", "state": "end"},
    FailedOver: {"type": "failover"},
}
_BY_TAG: dict[tuple[str, object], type[Any]] = {(tag["type"], tag.get("state")): cls for cls, tag in _TAGS.items()}


def _register(cls: type[Any], tag: dict[str, str]) -> None:
    register_record(cls, omit_if_none=("client_auth",) if cls is RequestEnded else ())
    fields = converter.get_unstructure_hook(cls)
    converter.register_unstructure_hook(cls, lambda event: {**tag, **fields(event)})


def _structure_event(data: object, _: type) -> NodeEvent:
    if not isinstance(data, Mapping):
        raise InputError("an event must be an object")
    kind, state = data.get("type"), data.get("state") if data.get("type") == "request" else None
    cls = _BY_TAG.get((kind, state)) if isinstance(kind, str) and isinstance(state, str | None) else None
    if cls is None:
        raise InputError(f"unknown event {kind!r}")
    event: NodeEvent = converter.structure(data, cls)
    return event


for _cls, _tag in _TAGS.items():
    _register(_cls, _tag)
converter.register_structure_hook_func(lambda t: t == NodeEvent, _structure_event)


def event_from_wire(data: object, *, where: str = "event") -> NodeEvent:
    """A control-socket event object read back; :class:`~kvasir.core.schema.SchemaError` if it is none."""
    event: NodeEvent = structure(data, NodeEvent, where=where)  # type: ignore[arg-type]  # a union, not a class
    return event


def event_to_wire(event: NodeEvent) -> Json:
    """``event`` as the control socket's JSON object (its tag first)."""
    wire: Json = converter.unstructure(event)
    return wire


class EventHub:
    """The lossy broadcast to observers (UI only)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._capacity = capacity
        self._subscribers: list[trio.MemorySendChannel[NodeEvent]] = []
        self.dropped = 0

    def publish(self, event: NodeEvent) -> None:
        for ch in list(self._subscribers):
            try:
                ch.send_nowait(event)
            except trio.WouldBlock:
                self.dropped += 1
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self._subscribers.remove(ch)

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[trio.MemoryReceiveChannel[NodeEvent]]:
        send, receive = trio.open_memory_channel[NodeEvent](self._capacity if self._capacity else math.inf)
        self._subscribers.append(send)
        try:
            async with receive:
                yield receive
        finally:
            if send in self._subscribers:
                self._subscribers.remove(send)
            send.close()


EndListener = Callable[[RequestEnded], None]


class EndListeners:
    """Lossless request ends: each listener is called with every :class:`RequestEnded`, in the order added, on the
    node's event loop as the request ends. A listener must be quick and must not block (it runs inside the node's
    bookkeeping); one that raises is logged and the others still run."""

    def __init__(self) -> None:
        self._listeners: list[EndListener] = []

    def add(self, listener: EndListener) -> None:
        self._listeners.append(listener)

    def remove(self, listener: EndListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    @contextmanager
    def listening(self, listener: EndListener) -> Iterator[None]:
        """``listener`` hears every request that ends inside the block."""
        self.add(listener)
        try:
            yield
        finally:
            self.remove(listener)

    def emit(self, ended: RequestEnded) -> None:
        for listener in list(self._listeners):
            try:
                listener(ended)
            except Exception:  # a bookkeeping bug must not stop the node answering (or skip other listeners)
                log.exception("a request-end listener failed on request %x", ended.request)

    def __len__(self) -> int:
        return len(self._listeners)
