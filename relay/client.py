"""The node side of a relayed ring link: one Kvasir wire frame per binary WebSocket message.

The relay says nothing when the other end joins; messages sent before then wait in the relay (one at a
time, then TCP backpressure) and are delivered once the edge pairs. A node that needs to know its peer is
there uses its own hello frame. If no peer comes within the relay's wait timeout the link closes with
code 4007.
"""

from __future__ import annotations

import ssl
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
import trio_websocket
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection

from kvasir.relay.errors import RelayConfigError, RelayConnectError, RelayLinkClosed
from kvasir.relay.server import DEFAULT_MAX_MESSAGE_BYTES, EDGE_PATH_PREFIX
from kvasir.relay.token import Role, is_valid_edge_id

__all__ = ["RelayLink", "edge_url", "open_relay_link"]


def edge_url(relay_url: str, edge_id: str, token: str | None = None) -> str:
    """The WebSocket URL for ``edge_id`` under ``relay_url`` (``ws://host:port`` or ``wss://...``)."""
    parts = urllib.parse.urlsplit(relay_url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise RelayConfigError(f"relay URL must be ws://HOST[:PORT] or wss://HOST[:PORT], got {relay_url!r}")
    if parts.query or parts.fragment:
        raise RelayConfigError(f"relay URL must not have a query or fragment: {relay_url!r}")
    if not is_valid_edge_id(edge_id):
        raise RelayConfigError(f"invalid edge id {edge_id!r}")
    path = parts.path.rstrip("/") + EDGE_PATH_PREFIX + edge_id
    # v1 tokens travel in the query; v2 tokens in the Authorization header (kept out of URLs and logs).
    query = "" if token is None else urllib.parse.urlencode({"token": token})
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, query, ""))


class RelayLink:
    """A message-oriented link to the other end of an edge, through the relay."""

    def __init__(self, conn: WebSocketConnection) -> None:
        self._conn = conn

    async def send_message(self, message: bytes) -> None:
        """Send one message; waits while the relay or the other end is not keeping up."""
        try:
            await self._conn.send_message(bytes(message))
        except ConnectionClosed as exc:
            raise _closed(exc) from None

    async def receive_message(self) -> bytes:
        """The next message from the other end; :class:`RelayLinkClosed` once the link is closed."""
        try:
            message = await self._conn.get_message()
        except ConnectionClosed as exc:
            raise _closed(exc) from None
        if isinstance(message, str):  # the relay forwards binary messages only, so this is a broken relay
            await self._conn.aclose(1003, "binary messages only")
            raise RelayLinkClosed(1003, "text message from relay")
        return message

    @property
    def close_code(self) -> int | None:
        """The WebSocket close code once the link is closed, else None."""
        reason = self._conn.closed
        return None if reason is None else reason.code

    async def aclose(self) -> None:
        """Close the link normally; the other end then sees close code 4008."""
        await self._conn.aclose()


async def _close_leaked_streams(exc: BaseException) -> None:
    """Close the socket trio-websocket 0.12 leaves open when the server refuses the upgrade (an HTTP status).

    The refusal is raised inside the connection's reader task, whose frames still hold the connection; without
    this, every refused redial would leak a socket until garbage collection.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        err = pending.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        pending += [err.__cause__, err.__context__, *getattr(err, "exceptions", ())]
        tb = err.__traceback__
        while tb is not None:
            candidate = tb.tb_frame.f_locals.get("self")
            if isinstance(candidate, WebSocketConnection):
                await trio.aclose_forcefully(candidate._stream)
            tb = tb.tb_next


def _closed(exc: ConnectionClosed) -> RelayLinkClosed:
    reason = exc.reason
    return RelayLinkClosed(reason.code if reason else None, reason.reason if reason else None)


@asynccontextmanager
async def open_relay_link(
    url: str,
    edge_id: str,
    role: Role,
    token: str,
    *,
    bearer: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    connect_timeout: float = 30.0,
    disconnect_timeout: float = 10.0,
) -> AsyncIterator[RelayLink]:
    """Join ``edge_id`` as ``role`` through the relay at ``url`` (``ws://`` or ``wss://``).

    ``bearer``: send ``token`` (a v2 token) in the Authorization header, where the relay checks it before it
    accepts the WebSocket; otherwise it is a v1 token in the URL query. ``ssl_context`` is for ``wss://`` only
    (default: the system's trust store). Raises :class:`RelayConnectError` if the relay cannot be reached or
    refuses the handshake (a v2 token is refused there, with an HTTP status); rejections after the handshake
    (v1 token, role taken, ...) arrive as :class:`RelayLinkClosed` with the close code.
    """
    target = edge_url(url, edge_id, None if bearer else token)
    if ssl_context is not None and not target.startswith("wss:"):
        raise RelayConfigError("an SSL context needs a wss:// relay URL")
    conn: WebSocketConnection | None = None
    try:
        async with trio_websocket.open_websocket_url(
            target,
            ssl_context,
            message_queue_size=0,  # deliver on demand: a slow node pushes back on the relay, not into memory
            max_message_size=max_message_bytes,
            receive_buffer_size=64 * 1024,
            connect_timeout=connect_timeout,
            disconnect_timeout=disconnect_timeout,
            extra_headers=[(b"Authorization", b"Bearer " + token.encode("ascii"))] if bearer else None,
        ) as conn:
            link = RelayLink(conn)
            await link.send_message(bytes([Role(role)]))
            yield link
    except HandshakeError as exc:
        await _close_leaked_streams(exc)
        raise RelayConnectError(f"cannot open relay link to {url}: {exc!r}") from exc
    finally:
        # trio-websocket 0.12's aclose() returns early when the relay closed first and leaves the socket open
        # (a ResourceWarning later), so the socket is closed here; closing twice is harmless.
        if conn is not None:
            await trio.aclose_forcefully(conn._stream)
