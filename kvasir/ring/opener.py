"""How one link of a node is opened: the predecessor's connection accepted, the successor dialed (TCP or a relay
edge), each through the protocol-v2 key-bound handshake of :mod:`kvasir.ring.secure` when the node has credentials.

Before authentication a peer can make the node read only a handshake-sized message, and the node caps handshakes in
progress, in all and per address. :class:`~kvasir.ring.linkmgr.LinkManager` keeps the links this opens.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import trio

from kvasir.core.errors import RingError
from kvasir.core.identity import PublicKey
from kvasir.ring.edges import RelayChannel, RingEdges
from kvasir.ring.links import Link, MessageLink, StreamLink
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.msgstream import MessageStream
from kvasir.ring.secure import (
    AnyPolicy,
    Credentials,
    KeyPolicy,
    LinkAuthError,
    PeerPolicy,
    accept_secure,
    dial_secure,
)
from kvasir.util.addrgroup import address_group
from kvasir.wire import MIN_FRAME_LIMIT

log = logging.getLogger("kvasir.node")

StreamHandler = Callable[[trio.abc.Stream, str], Awaitable[None]]

#: The whole v2 handshake (challenge, AUTH, TLS) must finish within this.
SECURE_HANDSHAKE_TIMEOUT = 10.0
#: Handshakes in progress (not yet authenticated): in all, and from one address (IPv6: one /64).
MAX_PENDING_HANDSHAKES = 16
MAX_PENDING_PER_ADDRESS = 4
#: Largest frame an unauthenticated v1 peer may send (a HELLO is a few hundred bytes; the header is checked first).
PREAUTH_FRAME_BYTES = MIN_FRAME_LIMIT


class SuccessorUnreachable(RingError):
    """The successor has no address yet or does not answer: the node keeps dialing (not a warning)."""


class Transport(Protocol):
    """How direct links are made; TCP in a real ring, memory streams in fast tests (kvasir.testing.fakestage)."""

    async def listen(
        self, host: str, port: int, handler: StreamHandler, *, task_status: trio.TaskStatus[int] = ...
    ) -> None:
        """Accept connections on ``host:port`` and run ``handler(stream, peer)`` for each; ``started(port)``."""
        ...

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        """A stream to ``host:port``; OSError when nobody answers."""
        ...


#: TCP keepalive: first probe after this many idle seconds, then every interval, dead after count probes.
TCP_KEEPIDLE_S, TCP_KEEPINTVL_S, TCP_KEEPCNT = 10, 5, 3


def set_tcp_keepalive(stream: trio.SocketStream) -> None:
    with contextlib.suppress(OSError):  # a peer that already reset the connection: its first read says so
        stream.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (
            ("TCP_KEEPIDLE", TCP_KEEPIDLE_S),
            ("TCP_KEEPINTVL", TCP_KEEPINTVL_S),
            ("TCP_KEEPCNT", TCP_KEEPCNT),
        ):
            opt = getattr(socket, name, None)  # Linux and Android have all three; macOS lacks TCP_KEEPIDLE
            if opt is not None:
                stream.setsockopt(socket.IPPROTO_TCP, opt, value)


def _peer_name(stream: trio.SocketStream) -> str:
    try:
        return "{}:{}".format(*stream.socket.getpeername()[:2])
    except OSError:
        return "?"


class TcpTransport:
    async def listen(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async def accepted(stream: trio.SocketStream) -> None:
            set_tcp_keepalive(stream)
            await handler(stream, _peer_name(stream))

        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:  # name the address: "Address already in use" alone does not say which
            taken = exc.errno == errno.EADDRINUSE
            message = f"{host}:{port} is already in use" if taken else f"cannot listen on {host}:{port}: {exc.strerror}"
            raise OSError(exc.errno, message) from exc
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, accepted, listeners)
            task_status.started(listeners[0].socket.getsockname()[1])

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        stream = await trio.open_tcp_stream(host, port)
        set_tcp_keepalive(stream)
        return stream


class LinkOpener:
    """Opens the links of the node of rank ``rank``: :meth:`accept` (a predecessor's connection), :meth:`relay_link`
    (a relay edge, either end) and :meth:`open_successor` (the dial)."""

    def __init__(
        self,
        *,
        rank: int,
        edges: RingEdges,
        manifest: Callable[[], Manifest],
        transport: Transport | None = None,
        credentials: Credentials | None = None,
        peer_policy: Callable[[], PeerPolicy | None] | None = None,
        ticket: Callable[[], bytes] | None = None,
    ) -> None:
        self.rank = rank
        self.edges = edges
        self._manifest = manifest
        self.transport: Transport = transport or TcpTransport()
        #: This node's key and certificate: set, every link runs protocol v2 (authenticated, encrypted).
        self.credentials = credentials
        self._peer_policy = peer_policy
        self._ticket = ticket or (lambda: b"")
        self._pending: dict[str, int] = {}  # unauthenticated handshakes per address group

    async def accept(self, stream: trio.abc.Stream, peer: str) -> tuple[Link, PublicKey | None] | None:
        """A predecessor's connection as a link (and its key, v2); None when refused (too many handshakes in
        progress, or the handshake failed): the stream is then closed."""
        group = address_group(peer.rsplit(":", 1)[0].strip("[]"))
        if (
            sum(self._pending.values()) >= MAX_PENDING_HANDSHAKES
            or self._pending.get(group, 0) >= MAX_PENDING_PER_ADDRESS
        ):
            log.warning("rank %d: too many handshakes in progress; closing a connection from %s", self.rank, peer)
            await trio.aclose_forcefully(stream)
            return None
        self._pending[group] = self._pending.get(group, 0) + 1
        try:
            return await self._secure_accepted(stream, peer)
        finally:
            self._pending[group] -= 1
            if not self._pending[group]:
                del self._pending[group]

    def _predecessor_policy(self) -> PeerPolicy:
        """The manifest's keys for the previous rank (its primary's and its standbys'), or (market rings) a valid
        ticket for a neighbour window."""
        m = self._manifest()
        by_key = KeyPolicy(m.ranks[(self.rank - 1) % m.size].keys())
        market = self._peer_policy() if self._peer_policy is not None else None
        return by_key if market is None else AnyPolicy((by_key, market))

    async def _secure_accepted(self, stream: trio.abc.Stream, peer: str) -> tuple[Link, PublicKey | None] | None:
        """The predecessor's link, after the v2 handshake when this node has credentials; None if it failed."""
        if self.credentials is None:
            # v1: the HELLO is the first frame; until the handshake no frame may be larger than a HELLO.
            return StreamLink(stream, peer, max_frame_bytes=PREAUTH_FRAME_BYTES), None
        try:
            with trio.fail_after(SECURE_HANDSHAKE_TIMEOUT):
                tls, key, _ = await accept_secure(stream, self.credentials, self._predecessor_policy())
        except (LinkAuthError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.warning("rank %d refused a predecessor from %s: %s", self.rank, peer, exc or "handshake timed out")
            await trio.aclose_forcefully(stream)
            return None
        link = StreamLink(tls, peer)
        link.stats.secure = True
        return link, key

    async def relay_link(self, channel: RelayChannel, edge: str, *, upstream: bool) -> tuple[Link, PublicKey | None]:
        """A link over a relay edge: plain messages (v1), or TLS end to end inside them (v2)."""
        peer = f"relay:{edge}"
        if self.credentials is None:
            return MessageLink(channel.send_message, channel.receive_message, channel.aclose, peer), None
        stream = MessageStream(
            channel.send_message, channel.receive_message, channel.aclose, closed_errors=(trio.EndOfChannel,)
        )
        with trio.fail_after(SECURE_HANDSHAKE_TIMEOUT):
            if upstream:
                expected = self._manifest().successor(self.rank).key
                if expected is None:
                    raise SuccessorUnreachable(f"waiting for rank {(self.rank + 1) % self._manifest().size}'s key")
                tls = await dial_secure(stream, self.credentials, expected, self._ticket())
                link = StreamLink(tls, peer, kind="relay")
                link.stats.secure = True
                return link, expected
            tls, key, _ = await accept_secure(stream, self.credentials, self._predecessor_policy())
            link = StreamLink(tls, peer, kind="relay")
            link.stats.secure = True
            return link, key

    @asynccontextmanager
    async def open_successor(self, target: RankEntry) -> AsyncIterator[Link]:
        if self.edges.successor_relayed:
            async with self.edges.open_relay(self.edges.edge_out, upstream=True) as channel:
                link, _ = await self.relay_link(channel, self.edges.edge_out, upstream=True)
                yield link
            return
        if target.port == 0:
            raise SuccessorUnreachable(f"waiting for rank {target.rank} (no address yet)")
        try:
            stream = await self.transport.connect(target.host, target.port)
        except OSError as exc:
            raise SuccessorUnreachable(
                f"waiting for rank {target.rank} at {target.address} ({exc.strerror or exc})"
            ) from None
        if self.credentials is not None:
            if target.key is None:  # a market ring whose map does not show the holder's key yet
                await trio.aclose_forcefully(stream)
                raise SuccessorUnreachable(f"waiting for rank {target.rank}'s key")
            try:
                with trio.fail_after(SECURE_HANDSHAKE_TIMEOUT):
                    stream = await dial_secure(stream, self.credentials, target.key, self._ticket())
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
        link = StreamLink(stream, target.address)
        link.stats.secure = self.credentials is not None
        try:
            yield link
        finally:
            await link.aclose()
