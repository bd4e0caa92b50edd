"""A ring link through the relay: what a node passes to :class:`kvasir.ring.node.NodeConfig` as ``relay_connect``.

The ring layer does not import the relay (it sits below it); a node's owner hands it this function instead.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from relay.client import RelayLink, open_relay_link
from relay.errors import RelayLinkClosed
from relay.token import Role, make_edge_token

#: Lifetime of the edge tokens a node signs for itself.
TOKEN_LIFETIME_S = 24 * 3600


class EdgeChannel:
    """A relay edge as the ring sees it (kvasir.ring.edges.RelayChannel): relay closes become trio's errors."""

    def __init__(self, link: RelayLink) -> None:
        self._link = link

    async def send_message(self, message: bytes) -> None:
        try:
            await self._link.send_message(message)
        except RelayLinkClosed as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def receive_message(self) -> bytes:
        try:
            return await self._link.receive_message()
        except RelayLinkClosed as exc:
            raise trio.EndOfChannel(str(exc)) from exc

    async def aclose(self) -> None:
        await self._link.aclose()


@asynccontextmanager
async def connect_ring_edge(url: str, secret: bytes, edge_id: str, *, upstream: bool) -> AsyncIterator[EdgeChannel]:
    """Join ``edge_id`` of the relay at ``url`` as its upstream (boundary-sending) or downstream end."""
    role = Role.UPSTREAM if upstream else Role.DOWNSTREAM
    token = make_edge_token(secret, edge_id, role, int(time.time()) + TOKEN_LIFETIME_S)
    ctx = ssl.create_default_context() if url.startswith("wss://") else None
    async with open_relay_link(url, edge_id, role, token, ssl_context=ctx) as rl:  # RelayConnectError: a RingError
        yield EdgeChannel(rl)
