"""The relay service: pairs the two ends of a ring edge and forwards WebSocket messages between them.

Ownership: :meth:`Relay.serve` owns the listeners and (through :func:`trio.serve_listeners`) one task per
TCP connection. That task owns its connection's WebSocket reader, its inbound pump (which forwards what this
end sends to the other end) and its keepalive. The two connection tasks of an edge meet only through the
:class:`_Edge` record; whichever event ends the edge first decides both close codes, and each task then closes
its own connection. Nothing is spawned outside these nurseries.

Backpressure: the WebSocket layer queues no messages (queue size 0) and a pump awaits the send to the other
end before it receives the next message, so an edge holds at most one message per direction in the relay,
plus the one being reassembled by the reader; a slow reader stalls its sender through TCP flow control.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import ssl
import time
import urllib.parse
from collections.abc import Callable, Mapping

import attrs
import trio
import trio_websocket
from trio_websocket import ConnectionClosed, WebSocketConnection

from kvasir.core.identity import PublicKey
from kvasir.core.validators import positive
from kvasir.relay.codes import CloseCode
from kvasir.relay.conns import Conn, ConnTable
from kvasir.relay.errors import EdgeTokenError, EdgeTokenExpired, RelayConfigError
from kvasir.relay.grant import check_token
from kvasir.relay.spent import SpentTokens
from kvasir.relay.token import MIN_SECRET_BYTES, Role, is_valid_edge_id, verify_edge_token
from kvasir.util.addrgroup import network_group

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "EDGE_PATH_PREFIX",
    "Relay",
    "RelayConfig",
    "RelayStatistics",
    "serve_relay",
]

logger = logging.getLogger(__name__)

EDGE_PATH_PREFIX = "/v1/edge/"
# The largest boundary frame Kvasir sends is 64 MiB of activations; 64 KiB on top leaves room for its header.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024 + 64 * 1024


def _config_error(field: str, reason: str) -> RelayConfigError:
    return RelayConfigError(f"{field} {reason}")


_positive = positive(error=_config_error)


def _port(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not 0 <= value <= 65535:
        raise RelayConfigError(f"port must be 0-65535, got {value}")


@attrs.frozen
class RelayConfig:
    """Everything the relay needs; times in seconds, sizes in bytes."""

    #: v1 tokens: the ring secret that keys HMAC edge tokens (deprecated: every node of the ring holds it).
    secret: bytes | None = attrs.field(default=None, repr=False)
    #: v2 tokens: operator keys whose edge grants this relay honours (docs/protocol.md § Relay admission).
    trusted_keys: frozenset[PublicKey] = frozenset()
    host: str = "127.0.0.1"
    port: int = attrs.field(default=8443, validator=_port)
    tls_cert: str | None = None
    tls_key: str | None = None
    wait_timeout: float = attrs.field(default=60.0, validator=_positive)  # an end waiting alone for its peer
    # TCP accept to the WebSocket request: short, since until its token is checked a connection is a stranger's (N5)
    handshake_timeout: float = attrs.field(default=3.0, validator=_positive)
    preamble_timeout: float = attrs.field(default=10.0, validator=_positive)  # WebSocket open to role byte
    close_timeout: float = attrs.field(default=5.0, validator=_positive)  # closing handshake, then hard close
    keepalive_interval: float = attrs.field(default=15.0, validator=_positive)
    keepalive_timeout: float = attrs.field(default=45.0, validator=_positive)  # silence while we wait to read
    max_message_bytes: int = attrs.field(default=DEFAULT_MAX_MESSAGE_BYTES, validator=_positive)
    # Connection caps (relay/conns.py): per address group (an IPv4 /24 or an IPv6 /64), and all groups together;
    # a full cap evicts the oldest connection whose token is not checked yet, and a refused one is never counted.
    max_conns_per_ip: int = attrs.field(default=32, validator=_positive)
    max_connections: int = attrs.field(default=1024, validator=_positive)
    receive_buffer_bytes: int = attrs.field(default=64 * 1024, validator=_positive)
    clock: Callable[[], float] = time.time  # Unix time for token expiry; a parameter so tests can move it

    def __attrs_post_init__(self) -> None:
        if self.secret is None and not self.trusted_keys:
            raise RelayConfigError("the relay needs operator keys to trust (or a v1 ring secret)")
        if self.secret is not None and len(self.secret) < MIN_SECRET_BYTES:
            raise RelayConfigError(f"ring secret must be at least {MIN_SECRET_BYTES} bytes")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise RelayConfigError("--tls-cert and --tls-key go together")


@attrs.frozen
class RelayStatistics:
    """A snapshot of the relay's counters."""

    connections: int  # open TCP connections, including ones still in handshake
    open_edges: int  # edges with at least one end joined
    paired_edges: int  # edges with both ends joined
    messages_forwarded: int
    bytes_forwarded: int
    rejections: int  # connections the relay closed before they joined an edge
    rejections_by_code: Mapping[int, int] = attrs.field(eq=False)
    wait_timeouts: int  # ends that waited alone until wait_timeout
    keepalive_timeouts: int
    #: Connections not yet admitted that were closed to make room for newer ones (N5).
    evictions: int = 0


@attrs.frozen
class _Close:
    code: int
    reason: str


class _WatchedStream(trio.abc.Stream):
    """Remembers since when the WebSocket reader has been waiting for bytes from the peer.

    Keepalive judges silence only while the reader is actually waiting: when it is stalled by our own
    backpressure the peer is not at fault, and a long message arriving slowly still counts as life.
    """

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self._waiting_since: float | None = None
        self.ended = trio.Event()  # end of stream or a broken one: no WebSocket request can come any more

    def silent_for(self) -> float:
        return 0.0 if self._waiting_since is None else trio.current_time() - self._waiting_since

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        self._waiting_since = trio.current_time()
        try:
            data = await self.inner.receive_some(max_bytes)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.ended.set()
            raise
        finally:
            self._waiting_since = None
        if not data:
            self.ended.set()
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


@attrs.frozen
class _Admission:
    """A v2 token's verdict, reached at the HTTP upgrade: who may join which edge in which role."""

    edge_key: str  # the registry key: issuer, ring and edge id, so two rings (or operators) never share an edge
    role: Role
    holder: PublicKey | None  # None: a v1 token, which names no key
    expires_at: int = 0  # the v2 token's: a same-key connection replaces a live one only with a later one


@attrs.define(eq=False)
class _Member:
    role: Role
    conn: WebSocketConnection
    stream: _WatchedStream
    holder: PublicKey | None = None  # the key a v2 token proved; a live slot yields only to the same key
    expires_at: int = 0  # ... presenting a token that expires later than this one's
    # True while a pump is writing a message to this connection; if the edge ends then, the frame is cut short
    # and the only honest close is a hard one.
    mid_send: bool = False


@attrs.define(eq=False)
class _Edge:
    edge_id: str
    registry: dict[str, _Edge]
    members: dict[Role, _Member] = attrs.field(factory=dict)
    paired: trio.Event = attrs.field(factory=trio.Event)
    ended: trio.Event = attrs.field(factory=trio.Event)
    closes: dict[Role, _Close | None] = attrs.field(factory=dict)

    def other(self, me: _Member) -> _Member:
        return self.members[Role.DOWNSTREAM if me.role is Role.UPSTREAM else Role.UPSTREAM]

    def end(self, culprit: _Member, close: _Close | None) -> None:
        """End the edge because of ``culprit``; ``close`` is its close code, None if it is already closed."""
        if self.ended.is_set():
            return
        for role in self.members:
            self.closes[role] = close if role is culprit.role else _Close(CloseCode.PEER_CLOSED, "the other end left")
        if self.registry.get(self.edge_id) is self:
            del self.registry[self.edge_id]  # a new pair may now form under the same id
        self.ended.set()


class Relay:
    """One relay service; :meth:`serve` runs it, :meth:`statistics` reads its counters at any time."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self._edges: dict[str, _Edge] = {}
        self._spent = SpentTokens()
        self._conns = ConnTable(config.max_conns_per_ip, config.max_connections)
        self._messages = 0
        self._bytes = 0
        self._rejections: collections.Counter[int] = collections.Counter()
        self._wait_timeouts = 0
        self._keepalive_timeouts = 0

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            connections=len(self._conns),
            open_edges=len(self._edges),
            paired_edges=sum(1 for edge in self._edges.values() if edge.paired.is_set()),
            messages_forwarded=self._messages,
            bytes_forwarded=self._bytes,
            rejections=sum(self._rejections.values()),
            rejections_by_code=dict(self._rejections),
            wait_timeouts=self._wait_timeouts,
            keepalive_timeouts=self._keepalive_timeouts,
            evictions=self._conns.evictions,
        )

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and relay until cancelled; reports the bound port through ``task_status``."""
        listeners = await self._open_listeners()
        port = _listener_port(listeners[0])
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle_stream, listeners)
            logger.info("relay listening on %s port %d", self.config.host, port)
            task_status.started(port)

    async def _open_listeners(self) -> list[trio.SocketListener] | list[trio.SSLListener[trio.SocketStream]]:
        config = self.config
        try:
            if config.tls_cert is None or config.tls_key is None:
                return await trio.open_tcp_listeners(config.port, host=config.host)
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(config.tls_cert, config.tls_key)
            return await trio.open_ssl_over_tcp_listeners(config.port, context, host=config.host, https_compatible=True)
        except (OSError, ssl.SSLError) as exc:
            raise RelayConfigError(f"cannot listen on {config.host}:{config.port}: {exc}") from exc

    async def _handle_stream(self, stream: trio.abc.Stream) -> None:
        ip = network_group(_peer_ip(stream))
        entry = self._conns.admit(ip)  # may evict the oldest connection not yet admitted (N5)
        if entry is None:  # every connection in the way holds a checked token: refused now, and never counted
            self._reject(CloseCode.TOO_MANY_CONNECTIONS, "too many connections")
            await _refuse(stream)
            return
        watched = _WatchedStream(stream)
        try:
            with entry.scope:  # cancelled when a newer connection evicts this one before its token is checked
                async with trio.open_nursery() as nursery:
                    await self._handle_connection(nursery, watched, entry)
                    nursery.cancel_scope.cancel()  # stops the WebSocket reader
        except Exception:
            # One connection's failure (a bug, or a protocol corner of the WebSocket layer) must not stop the
            # relay for every other edge, so it ends here, logged.
            logger.exception("relay connection from %s failed", ip)
        finally:
            await trio.aclose_forcefully(watched)
            self._conns.release(entry)

    async def _handle_connection(self, nursery: trio.Nursery, stream: _WatchedStream, entry: Conn) -> None:
        config = self.config
        request: trio_websocket.WebSocketRequest | None = None

        async def handshake(cancel_scope: trio.CancelScope) -> None:
            nonlocal request
            request = await trio_websocket.wrap_server_stream(
                nursery,
                stream,
                message_queue_size=0,  # hand over one message at a time: backpressure, not buffering
                max_message_size=config.max_message_bytes,
                receive_buffer_size=config.receive_buffer_bytes,
            )
            cancel_scope.cancel()

        # wrap_server_stream waits for a request even after the client hung up or failed TLS; stop then.
        with trio.move_on_after(config.handshake_timeout):
            async with trio.open_nursery() as waiting:
                waiting.start_soon(handshake, waiting.cancel_scope)
                await stream.ended.wait()
                waiting.cancel_scope.cancel()
        if request is None:
            return
        # Refused at the upgrade, before any WebSocket message can be sent to us: no valid token.
        admission = self._admit(request)
        if isinstance(admission, _Admission):
            entry.authenticated = True  # a checked token: never evicted for a newcomer
        else:
            with trio.move_on_after(config.close_timeout, shield=True), contextlib.suppress(ConnectionClosed):
                await request.reject(_HTTP_STATUS.get(CloseCode(admission.code), 403), body=admission.reason.encode())
            return
        try:
            conn = await request.accept()
        except ConnectionClosed:
            return
        member: _Member | None = None
        close: _Close | None = _Close(CloseCode.GOING_AWAY, "relay shutting down")
        try:
            close, member = await self._session(conn, stream, admission)
        finally:
            # Shielded so that a relay shutting down still says why; bounded so a dead peer cannot hold it.
            with trio.move_on_after(config.close_timeout, shield=True):
                if member is not None and member.mid_send:
                    await trio.aclose_forcefully(stream)
                elif close is not None:
                    await conn.aclose(close.code, close.reason)

    def _reject(self, code: CloseCode, reason: str) -> _Close:
        self._rejections[int(code)] += 1
        return _Close(code, reason)

    def _admit(self, request: trio_websocket.WebSocketRequest) -> _Admission | _Close:
        """Check the edge token at the upgrade, before any WebSocket message can be read: a v2 token
        (``Authorization: Bearer v2.…``), or a v1 token in the URL query when this relay has a ring secret."""
        url = urllib.parse.urlsplit(request.path)
        edge_id = url.path.removeprefix(EDGE_PATH_PREFIX)
        if not url.path.startswith(EDGE_PATH_PREFIX) or not is_valid_edge_id(edge_id):
            return self._reject(CloseCode.BAD_PATH, "path must be /v1/edge/{edge_id}")
        bearer = [v for k, v in request.headers if k.lower() == b"authorization"]
        if not bearer:
            if self.config.secret is None:
                return self._reject(CloseCode.NO_TOKEN, "missing Authorization: Bearer edge token")
            return self._admit_v1(self.config.secret, url.query, edge_id)
        if len(bearer) > 1 or not bearer[0].startswith(b"Bearer "):
            return self._reject(CloseCode.BAD_TOKEN, "one Authorization: Bearer header")
        token = bearer[0][len(b"Bearer ") :].decode("latin-1")
        now = int(self.config.clock())
        try:
            # The token names its role in its grant; the preamble byte must then agree.
            checked = check_token(token, self.config.trusted_keys, edge_id, None, now)
        except EdgeTokenExpired:
            return self._reject(CloseCode.TOKEN_EXPIRED, "edge token expired")
        except EdgeTokenError:
            return self._reject(CloseCode.BAD_TOKEN, "edge token not valid for this edge")
        spent = self._spent.spend(checked.token_id, checked.expires_at, now)
        if spent is None:
            return self._reject(CloseCode.TOO_MANY_CONNECTIONS, "too many tokens in flight; retry later")
        if not spent:  # a replay (N13): the holder makes a new token at every connect
            return self._reject(CloseCode.TOKEN_REUSED, "edge token already used")
        grant = checked.grant
        # Keyed by issuer too (N14): an operator's grant never reaches an edge of another operator's ring.
        edge_key = f"{grant.issuer.to_text()}/{grant.ring}/{edge_id}"
        return _Admission(edge_key, grant.role, grant.holder, checked.expires_at)

    def _admit_v1(self, secret: bytes, query: str, edge_id: str) -> _Admission | _Close:
        """A v1 token is bound to one role: find which, so the preamble byte can only confirm it."""
        tokens = urllib.parse.parse_qs(query, keep_blank_values=True).get("token", [])
        if not tokens:
            return self._reject(CloseCode.NO_TOKEN, "missing token query parameter")
        if len(tokens) > 1:
            return self._reject(CloseCode.BAD_TOKEN, "more than one token")
        expired = False
        for role in Role:
            try:
                verify_edge_token(secret, tokens[0], edge_id, role, int(self.config.clock()))
            except EdgeTokenExpired:
                expired = True
                continue
            except EdgeTokenError:
                continue
            return _Admission(edge_id, role, None)
        if expired:
            return self._reject(CloseCode.TOKEN_EXPIRED, "edge token expired")
        return self._reject(CloseCode.BAD_TOKEN, "edge token not valid for this edge")

    async def _session(
        self, conn: WebSocketConnection, stream: _WatchedStream, admission: _Admission
    ) -> tuple[_Close | None, _Member | None]:
        """Serve one connection its token admitted: read its role byte, join its edge; return how to close it."""
        config = self.config
        preamble: bytes | str | None = None
        with trio.move_on_after(config.preamble_timeout):
            try:
                preamble = await conn.get_message()
            except ConnectionClosed:
                return None, None
        if preamble is None:
            return self._reject(CloseCode.PREAMBLE_TIMEOUT, "no role byte in time"), None
        if not isinstance(preamble, bytes) or len(preamble) != 1:
            return self._reject(CloseCode.BAD_PREAMBLE, "preamble must be one binary byte"), None
        if preamble[0] not in (Role.UPSTREAM, Role.DOWNSTREAM):
            return self._reject(CloseCode.BAD_ROLE, f"unknown role byte 0x{preamble[0]:02x}"), None
        role = Role(preamble[0])
        if role is not admission.role:
            return self._reject(CloseCode.BAD_ROLE, "role byte differs from the token's role"), None
        edge_key = admission.edge_key

        edge = self._edges.get(edge_key)
        holder = admission.holder
        if edge is not None and role in edge.members:
            live = edge.members[role]
            if holder is None or live.holder != holder:
                return self._reject(CloseCode.ROLE_TAKEN, f"{role.name.lower()} end already joined"), None
            if admission.expires_at <= live.expires_at:  # not newer than the live one's: a replay, never the node
                return self._reject(CloseCode.ROLE_TAKEN, f"{role.name.lower()} end held under a later token"), None
            # The same key again with a later token: its old connection is stale (half-open, or the node restarted).
            # The new one wins; the edge re-forms and the other end redials.
            edge.end(edge.members[role], _Close(CloseCode.ROLE_TAKEN, "replaced by a newer connection of this key"))
            edge = None
        if edge is None:
            edge = self._edges[edge_key] = _Edge(edge_key, self._edges)
        me = _Member(role, conn, stream, holder, admission.expires_at)
        edge.members[role] = me
        if len(edge.members) == 2:
            edge.paired.set()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, edge, me)
                nursery.start_soon(self._keepalive, edge, me)
                with trio.move_on_after(config.wait_timeout):
                    await _first_of(edge.paired, edge.ended)  # ended: e.g. replaced by a newer connection
                # Checked, not inferred from the timeout: the peer may have arrived just as it fired.
                if not edge.paired.is_set() and not edge.ended.is_set():
                    self._wait_timeouts += 1
                    edge.end(me, _Close(CloseCode.WAIT_TIMEOUT, "no peer joined in time"))
                await edge.ended.wait()
                nursery.cancel_scope.cancel()
        finally:
            edge.end(me, _Close(CloseCode.GOING_AWAY, "relay shutting down"))  # no-op unless cancelled
        return edge.closes[role], me

    async def _pump(self, edge: _Edge, me: _Member) -> None:
        """Forward what ``me`` sends to the other end, one message at a time."""
        while True:
            try:
                message = await me.conn.get_message()
            except ConnectionClosed:
                edge.end(me, None)
                return
            if isinstance(message, str):
                edge.end(me, _Close(CloseCode.UNSUPPORTED_DATA, "binary messages only"))
                return
            await edge.paired.wait()  # a message sent before pairing waits here, holding back the next
            peer = edge.other(me)
            peer.mid_send = True
            try:
                await peer.conn.send_message(message)
            except ConnectionClosed:
                edge.end(peer, None)
                return
            peer.mid_send = False
            self._messages += 1
            self._bytes += len(message)

    async def _keepalive(self, edge: _Edge, me: _Member) -> None:
        interval = self.config.keepalive_interval
        while True:
            with trio.move_on_after(interval):
                try:
                    await me.conn.ping()
                except ConnectionClosed:
                    return  # the pump sees the close too and ends the edge
                await trio.sleep_forever()  # keep the period even when the pong comes at once
            if me.stream.silent_for() > self.config.keepalive_timeout:
                self._keepalive_timeouts += 1
                edge.end(me, _Close(CloseCode.KEEPALIVE_TIMEOUT, "no sign of life"))
                return


def _listener_port(listener: trio.SocketListener | trio.SSLListener[trio.SocketStream]) -> int:
    inner = listener.transport_listener if isinstance(listener, trio.SSLListener) else listener
    assert isinstance(inner, trio.SocketListener)
    port: int = inner.socket.getsockname()[1]
    return port


async def _first_of(*events: trio.Event) -> None:
    """Return as soon as any of ``events`` is set."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)


#: HTTP statuses for refusals at the upgrade (before accept, so no close code can be sent).
_HTTP_STATUS = {
    CloseCode.NO_TOKEN: 401,
    CloseCode.BAD_TOKEN: 403,
    CloseCode.TOKEN_EXPIRED: 401,
    CloseCode.BAD_PATH: 404,
    CloseCode.TOO_MANY_CONNECTIONS: 429,
    CloseCode.TOKEN_REUSED: 403,
}


#: How long a refused newcomer gets to read its 429 (it is not counted meanwhile).
REFUSAL_LINGER_S = 1.0
_TOO_MANY = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: text/plain\r\ncontent-length: 20\r\nconnection: close\r\n"
    b"\r\ntoo many connections"
)


async def _refuse(stream: trio.abc.Stream) -> None:
    """Answer 429 without reading the request, let the client's request arrive (so closing does not reset the
    connection before it reads the answer), and close; at most REFUSAL_LINGER_S."""
    with trio.move_on_after(REFUSAL_LINGER_S), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.send_all(_TOO_MANY)
        await stream.receive_some(64 * 1024)
    await trio.aclose_forcefully(stream)


def _peer_ip(stream: trio.abc.Stream) -> str:
    inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
    if isinstance(inner, trio.SocketStream):
        try:
            return str(inner.socket.getpeername()[0])
        except OSError:
            pass
    return "?"


async def serve_relay(config: RelayConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Run a relay until cancelled; ``port = await nursery.start(serve_relay, config)``."""
    await Relay(config).serve(task_status=task_status)
