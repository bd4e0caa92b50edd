"""How one link of a node is opened: the predecessor's connection accepted, the successor dialed (TCP or a relay
edge), each through the protocol-v2 key-bound handshake of :mod:`kvasir.ring.secure` when the node has credentials.

Until its HELLO is read a peer can make the node read only a handshake-sized message (inside TLS too), and the node
caps connections not yet linked (handshake or HELLO in progress), in all and per address group, evicting the oldest
when full; the expected predecessor's address has slots of its own. A key is admitted as the holder of exactly one
window, and its HELLO must claim that window. :class:`~kvasir.ring.linkmgr.LinkManager` keeps the links this opens.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol, runtime_checkable

import attrs
import trio

from kvasir.core.errors import ProtocolError, RingError
from kvasir.core.identity import PublicKey
from kvasir.ring.edges import RelayChannel, RingEdges
from kvasir.ring.links import Link, MessageLink, StreamLink, handshake
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
from kvasir.util.addrgroup import network_group
from kvasir.wire import MIN_FRAME_LIMIT, Hello, Side

log = logging.getLogger("kvasir.node")

StreamHandler = Callable[[trio.abc.Stream, str], Awaitable[None]]

#: The whole v2 handshake (challenge, AUTH, TLS) must finish within this.
SECURE_HANDSHAKE_TIMEOUT = 10.0
#: From the CHALLENGE to the dialer's AUTH: one round trip and one signature (issue 24 N4: a slot is held no longer).
AUTH_TIMEOUT = 2.0
#: Connections not yet linked (handshake or HELLO in progress): in all, and from one address group (IPv4: one /24,
#: IPv6: one /64). When full the oldest is closed, not the newest (issue 24 N4).
MAX_PENDING_HANDSHAKES = 16
MAX_PENDING_PER_ADDRESS = 4
#: Largest frame a peer may send before its HELLO is read, v1 or inside v2's TLS (a HELLO is a few hundred bytes; the
#: header is checked first).
PREAUTH_FRAME_BYTES = MIN_FRAME_LIMIT


class SuccessorUnreachable(RingError):
    """The successor has no address yet or does not answer: the node keeps dialing (not a warning)."""


class SuccessorTaken(RingError):
    """The relay refused this node the upstream end of the edge to the successor's holder: another key holds it
    (another holder of this node's window is linked there), as a successor refuses a second predecessor over TCP."""


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


@attrs.frozen
class Admitted:
    """A predecessor's link after its HELLO: the link, the peer's key (v2) and its HELLO."""

    link: Link
    key: PublicKey | None
    hello: Hello


@runtime_checkable
class TicketWindows(Protocol):
    """A peer policy that admits a key as the holder of one window (a market ticket's)."""

    def ticket_window(self, key: PublicKey, ticket: bytes) -> tuple[int, int] | None: ...


@attrs.define(eq=False)
class _Pending:
    """One connection not yet linked; ``scope`` closes it when it is evicted."""

    group: str
    reserved: bool
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    key: PublicKey | None = None


def admission_problem(hello: Hello, window: tuple[int, int] | None) -> str | None:
    """Why ``hello`` is not the HELLO of the holder of ``window`` (the one its ticket names; None: admitted by a
    manifest key, whose rank the ring order already binds), or None."""
    if window is not None and (hello.window_start, hello.window_end) != window:
        return (
            f"HELLO claims window {hello.window_start}:{hello.window_end} (rank {hello.rank}), but the key's ticket is"
            f" for window {window[0]}:{window[1]}"
        )
    return None


def evictee(pending: list[_Pending], group: str, reserved: bool) -> _Pending | None:
    """Which connection not yet linked makes room for a new one from ``group``, oldest first; None if there is room.
    The expected predecessor's address (``reserved``) has its own slots, which strangers cannot fill."""
    pool = [p for p in pending if p.reserved == reserved]
    same = [p for p in pool if p.group == group]
    if len(same) >= MAX_PENDING_PER_ADDRESS:
        return same[0]
    if len(pool) >= (MAX_PENDING_PER_ADDRESS if reserved else MAX_PENDING_HANDSHAKES):
        return pool[0]
    return None


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
        self._pending: list[_Pending] = []  # connections not yet linked, oldest first

    def _expected_hosts(self) -> frozenset[str]:
        """The addresses the manifest (a market ring: the coverage map) gives the predecessor's window holders."""
        m = self._manifest()
        if m.size < 2:
            return frozenset()
        return frozenset(h.host for h in m.rank((self.rank - 1) % m.size).holders())

    async def accept(self, stream: trio.abc.Stream, peer: str, local: Hello) -> Admitted | None:
        """A predecessor's connection as a link, after the v2 handshake and the HELLOs; None when refused (evicted
        for a newer connection, the handshake failed, a HELLO that does not fit): the stream is then closed."""
        host = peer.rsplit(":", 1)[0].strip("[]")
        entry = _Pending(network_group(host), reserved=host in self._expected_hosts())
        old = evictee(self._pending, entry.group, entry.reserved)
        if old is not None:
            log.warning("rank %d: too many connections not yet linked; closing the oldest from its group", self.rank)
            old.scope.cancel()
            self._pending.remove(old)  # its own finally finds it gone
        self._pending.append(entry)
        try:
            with entry.scope:
                return await self._open_accepted(stream, peer, local, entry)
            log.warning("rank %d: closed a connection from %s that was not linked yet (evicted)", self.rank, peer)
            await trio.aclose_forcefully(stream)
            return None
        finally:
            if entry in self._pending:
                self._pending.remove(entry)

    async def _open_accepted(
        self, stream: trio.abc.Stream, peer: str, local: Hello, entry: _Pending
    ) -> Admitted | None:
        opened = await self._secure_accepted(stream, peer)
        if opened is None:
            return None
        link, key, window = opened
        if key is not None:
            # One connection per key between AUTH and HELLO: a newer one (the peer reconnecting) replaces it.
            for other in [p for p in self._pending if p.key == key]:
                log.warning(
                    "rank %d: key %s connected again before its HELLO; closing the older", self.rank, key.fingerprint
                )
                other.scope.cancel()
                self._pending.remove(other)
            entry.key = key
        try:
            remote = await self.greet(link, peer, local, window)
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        return None if remote is None else Admitted(link, key, remote)

    async def greet(self, link: Link, peer: str, local: Hello, window: tuple[int, int] | None) -> Hello | None:
        """The HELLOs of a predecessor's link; None (the link closed, the reason logged) if they do not fit, or the
        HELLO claims another window than the one its key was admitted for."""
        try:
            return await handshake(
                link, local, Side.PREDECESSOR, send_first=False, check=lambda hello: admission_problem(hello, window)
            )
        except (RingError, ProtocolError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.warning("rank %d refused a predecessor from %s: %s", self.rank, peer, exc)
        with trio.move_on_after(1):
            await link.aclose()
        return None

    def _predecessor_policy(self) -> tuple[KeyPolicy, PeerPolicy | None]:
        """The manifest's keys for the previous rank (its primary's and its standbys'), and (market rings) the
        market's: a valid ticket for exactly the previous rank's window."""
        m = self._manifest()
        market = self._peer_policy() if self._peer_policy is not None else None
        return KeyPolicy(m.ranks[(self.rank - 1) % m.size].keys()), market

    @staticmethod
    def _admitted_window(
        by_key: KeyPolicy, market: PeerPolicy | None, key: PublicKey, ticket: bytes
    ) -> tuple[int, int] | None:
        """The window a market ticket admitted ``key`` for, which its HELLO must claim; None for a manifest's key
        (the ring order binds its rank). LinkAuthError if neither names one (fail closed)."""
        if key in by_key.keys or not isinstance(market, TicketWindows):
            return None
        window = market.ticket_window(key, ticket)
        if window is None:
            raise LinkAuthError(f"key {key.fingerprint}'s ticket names no window it may hold here")
        return window

    async def _secure_accepted(
        self, stream: trio.abc.Stream, peer: str
    ) -> tuple[Link, PublicKey | None, tuple[int, int] | None] | None:
        """The predecessor's link (its HELLO still to read, with a HELLO-sized frame limit), after the v2 handshake
        when this node has credentials; None if it failed. With it the key and the window a ticket admitted it for."""
        if self.credentials is None:
            # v1: the HELLO is the first frame; until the handshake no frame may be larger than a HELLO.
            return StreamLink(stream, peer, max_frame_bytes=PREAUTH_FRAME_BYTES), None, None
        by_key, market = self._predecessor_policy()
        policy = by_key if market is None else AnyPolicy((by_key, market))
        try:
            with trio.fail_after(SECURE_HANDSHAKE_TIMEOUT):
                tls, key, ticket = await accept_secure(stream, self.credentials, policy, auth_timeout=AUTH_TIMEOUT)
                window = self._admitted_window(by_key, market, key, ticket)
        except (LinkAuthError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.warning("rank %d refused a predecessor from %s: %s", self.rank, peer, exc or "handshake timed out")
            await trio.aclose_forcefully(stream)
            return None
        link = StreamLink(tls, peer, max_frame_bytes=PREAUTH_FRAME_BYTES)  # issue 24 N10: no 64 MiB before HELLO
        link.stats.secure = True
        return link, key, window

    async def relay_link(
        self, channel: RelayChannel, edge: str, *, upstream: bool, target: RankEntry | None = None
    ) -> tuple[Link, PublicKey | None, tuple[int, int] | None]:
        """A link over a relay edge: plain messages (v1), or TLS end to end inside them (v2); with the peer's key and
        (downstream, a market ticket's) the window it was admitted for, which its HELLO must claim. Upstream, the
        peer is ``target``'s key (the holder of the successor's window this edge reaches; default its primary)."""
        peer = f"relay:{edge}"
        if self.credentials is None:
            return MessageLink(channel.send_message, channel.receive_message, channel.aclose, peer), None, None
        stream = MessageStream(
            channel.send_message, channel.receive_message, channel.aclose, closed_errors=(trio.EndOfChannel,)
        )
        with trio.fail_after(SECURE_HANDSHAKE_TIMEOUT):
            if upstream:
                expected = (target or self._manifest().successor(self.rank)).key
                if expected is None:
                    raise SuccessorUnreachable(f"waiting for rank {(self.rank + 1) % self._manifest().size}'s key")
                tls = await dial_secure(stream, self.credentials, expected, self._ticket())
                link = StreamLink(tls, peer, kind="relay")
                link.stats.secure = True
                return link, expected, None
            by_key, market = self._predecessor_policy()
            policy = by_key if market is None else AnyPolicy((by_key, market))
            tls, key, ticket = await accept_secure(stream, self.credentials, policy)
            window = self._admitted_window(by_key, market, key, ticket)
            link = StreamLink(tls, peer, kind="relay", max_frame_bytes=PREAUTH_FRAME_BYTES)
            link.stats.secure = True
            return link, key, window

    @asynccontextmanager
    async def open_successor(self, target: RankEntry, holder: int = 0) -> AsyncIterator[Link]:
        """Dial ``target``, holder ``holder`` of the successor's window (0 its primary, i + 1 its standby i)."""
        if self.edges.successor_relayed:
            edge = self.edges.edges_out[holder]
            async with self.edges.open_relay(edge, upstream=True) as channel:
                try:
                    link, _, _ = await self.relay_link(channel, edge, upstream=True, target=target)
                except Exception:
                    if channel.taken:
                        raise SuccessorTaken(f"relay edge {edge}: another holder of this window is linked") from None
                    raise
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
