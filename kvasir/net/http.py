"""A small HTTP/1.1 server on trio with h11: keep-alive, bounded reads, timeouts, SSE.

Every read and write is bounded in size or time, so one slow or hostile client costs one task and one socket,
never the server. :class:`HttpConnection` is one connection; :func:`serve_http` is the one server loop, and every
HTTP service of Kvasir (the OpenAI API, the market, the model seeder) is a handler on it. Errors are
:class:`HttpError`, sent as JSON ``{"error": {"code": ..., "message": ...}}`` unless the service reshapes them
(the OpenAI API adds ``type`` and ``param``). docs/architecture.md § HTTP server says why this and not an ASGI server.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import ssl
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import attrs
import h11
import trio

from kvasir.util.addrgroup import address_group

RECEIVE_BYTES = 64 * 1024

log = logging.getLogger("kvasir.http")


@attrs.frozen
class ApiLimits:
    #: Largest request body; a larger Content-Length is refused (413) before any of the body is read.
    max_body_bytes: int = 4 * 1024 * 1024
    #: Largest request line plus headers (431 beyond).
    max_header_bytes: int = 64 * 1024
    #: How long a new connection may wait before its first request's first byte (or TLS handshake).
    first_timeout: float = 10.0
    #: How long an open connection may sit idle between requests (keep-alive).
    idle_timeout: float = 60.0
    #: From a request's first byte to the end of its headers.
    header_timeout: float = 30.0
    #: For the whole request body.
    body_timeout: float = 60.0
    #: For any one write to the client (a client that stops reading is treated as gone).
    send_timeout: float = 60.0
    #: Concurrent connections. When full, a newcomer evicts the oldest connection with no request under way
    #: (never-authorized ones first); only when every one is busy is it answered 503 and closed.
    max_connections: int = 256
    #: Concurrent connections from one address group (IPv4 /24, IPv6 /64), evicting within the group likewise;
    #: refused ones (429) never count toward ``max_connections``.
    max_connections_per_client: int = 32
    #: How long a closing connection keeps draining unread request bytes so the client sees our reply.
    linger: float = 1.0


class ClientGone(Exception):
    """The client closed the connection, broke it, or stopped reading."""


class RequestTooLarge(Exception):
    """The request body exceeds ``max_body_bytes``."""


class RequestTimeout(Exception):
    """The client was too slow sending its request."""


@attrs.frozen
class HttpRequest:
    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


class HttpConnection:
    """One server-side connection. Not for concurrent use, except :meth:`watch` alongside a handler."""

    def __init__(self, stream: trio.abc.Stream, limits: ApiLimits) -> None:
        self.stream = stream
        self.limits = limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.peer_closed = False
        self.peer = client_group(stream)
        self._served = False  # a request was answered: later ones may wait the longer keep-alive idle_timeout
        self._watch_buffered = 0
        self._event_stream = False
        #: Cancelled to evict this connection (the server's admission, when full).
        self.scope = trio.CancelScope()
        #: Its head was accepted (by the authorize hook, if any) at least once: a known client, evicted last.
        self.trusted = False
        #: A request is being read past its head or handled: never evicted.
        self.busy = False

    # ------------------------------------------------------------------------------------------ reading

    async def _receive(self) -> None:
        try:
            data = await self.stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone(str(exc)) from None
        if not data:
            self.peer_closed = True
        self.h11.receive_data(bytes(data))

    async def _next_event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                await self._receive()
                continue
            return event

    async def read_request(self, authorize: Authorize | None = None) -> HttpRequest | None:
        """The next request, or None when the client closed or idled out between requests.

        ``authorize`` sees the request's head (its ``body`` empty) before any of the body is read and may raise
        :class:`HttpError` (a 401): then the body is never read. Raises h11.RemoteProtocolError (malformed),
        RequestTimeout, RequestTooLarge, ClientGone, or the HttpError of ``authorize``.
        """
        started = bool(self.h11.trailing_data[0])
        idle = self.limits.idle_timeout if self._served else min(self.limits.idle_timeout, self.limits.first_timeout)
        deadline = trio.current_time() + (self.limits.header_timeout if started else idle)
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                break
            with trio.move_on_at(deadline):
                await self._receive()
                if not started and self.h11.trailing_data[0]:
                    started = True
                    deadline = trio.current_time() + self.limits.header_timeout
                continue
            if started:
                raise RequestTimeout("request headers not received in time")
            return None  # idle keep-alive connection
        if isinstance(event, h11.ConnectionClosed):
            return None
        if not isinstance(event, h11.Request):
            raise h11.RemoteProtocolError(f"unexpected {type(event).__name__}")
        head_size = len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
        if head_size > self.limits.max_header_bytes:
            # h11 bounds only incomplete heads; a complete one that arrived in one read is checked here.
            raise h11.RemoteProtocolError("request headers too large", error_status_hint=431)
        headers = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers)
        method, target = event.method.decode("ascii"), event.target.decode("latin-1")
        length = next((int(v) for k, v in headers if k == "content-length"), None)
        if length is not None and length > self.limits.max_body_bytes:
            raise RequestTooLarge(f"request body of {length} bytes exceeds {self.limits.max_body_bytes}")
        head = HttpRequest(method, target, headers, b"")
        if authorize is not None:
            authorize(self, head)  # before the body: a stranger cannot make us buffer megabytes (security N11)
        self.trusted = self.busy = True
        return attrs.evolve(head, body=await self._read_body())

    async def _read_body(self) -> bytes:
        if self.h11.client_is_waiting_for_100_continue:
            await self.send(h11.InformationalResponse(status_code=100, headers=[]))
        parts: list[bytes] = []
        size = 0
        with trio.move_on_after(self.limits.body_timeout):
            while True:
                event = await self._next_event()
                if isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > self.limits.max_body_bytes:
                        raise RequestTooLarge(f"request body exceeds {self.limits.max_body_bytes} bytes")
                    parts.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(parts)
                elif isinstance(event, h11.ConnectionClosed):
                    raise ClientGone("connection closed mid-request")
        raise RequestTimeout("request body not received in time")

    async def watch(self, on_gone: trio.CancelScope) -> None:
        """While a request is handled: cancel ``on_gone`` if the client disconnects; buffer pipelined bytes."""
        while self._watch_buffered < self.limits.max_header_bytes + self.limits.max_body_bytes:
            try:
                data = await self.stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.peer_closed = True
                on_gone.cancel()
                return
            self._watch_buffered += len(data)
            self.h11.receive_data(bytes(data))
        await trio.sleep_forever()  # enough buffered: stop reading until the handler is done

    # ------------------------------------------------------------------------------------------ writing

    async def send(self, event: Any) -> None:
        data = self.h11.send(event)
        if not data:
            return
        with trio.move_on_after(self.limits.send_timeout) as scope:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ClientGone(str(exc)) from None
        if scope.cancelled_caught:
            raise ClientGone("the client stopped reading")

    async def send_json(
        self, status: int, obj: object, headers: Iterable[tuple[str, str]] = (), *, close: bool = False
    ) -> None:
        await self.send_json_bytes(status, json_bytes(obj), headers, close=close)

    async def send_json_bytes(
        self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = (), *, close: bool = False
    ) -> None:
        """A JSON answer already encoded (by :func:`json_bytes`): for a service that signs the bytes it sends."""
        hdrs = [
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            *_common_headers(close),
            *headers,
        ]
        await self.send(h11.Response(status_code=status, headers=hdrs))
        await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())

    async def send_response(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> None:
        """A whole answer with the caller's headers (a proxy passing one on)."""
        await self.send(h11.Response(status_code=status, headers=list(headers)))
        await self.send(h11.Data(data=body))
        await self.send(h11.EndOfMessage())

    async def send_sse_raw(self, event: bytes) -> None:
        """One server-sent event as it came (without its ``\n\n``), after :meth:`start_sse`."""
        await self.send(h11.Data(data=event + b"\n\n"))

    async def start_sse(self) -> None:
        hdrs = [
            ("content-type", "text/event-stream; charset=utf-8"),
            ("cache-control", "no-cache"),
            ("x-accel-buffering", "no"),
            *_common_headers(False),
        ]
        await self.send(h11.Response(status_code=200, headers=hdrs))
        self._event_stream = True

    async def send_sse(self, obj: object) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        await self.send(h11.Data(data=_encode(f"data: {data}\n\n")))

    async def end_message(self) -> None:
        await self.send(h11.EndOfMessage())

    @property
    def in_body(self) -> bool:
        """A response's head is sent and its body is not finished (an SSE stream under way)."""
        return self.h11.our_state is h11.SEND_BODY

    @property
    def in_event_stream(self) -> bool:
        """An SSE stream is under way: an error can still be sent, as one more event."""
        return self._event_stream and self.in_body

    @property
    def can_respond(self) -> bool:
        return self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE)

    def next_cycle(self) -> bool:
        """Prepare for the next request on this connection; False if it must close instead."""
        if self.peer_closed or self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE:
            return False
        self.h11.start_next_cycle()
        self._served = True
        self._watch_buffered = 0
        self._event_stream = False
        return True

    async def close(self) -> None:
        """Close; if the client may still be sending, half-close and drain briefly so it can read our reply.

        TLS cannot half-close, so a TLS connection is only drained: closing with unread bytes would reset it and
        the client would never read the reply (a 413 for an oversized body)."""
        try:
            unread = self.h11.their_state not in (h11.DONE, h11.IDLE, h11.CLOSED, h11.MUST_CLOSE)
            if unread and not self.peer_closed and isinstance(self.stream, trio.SocketStream | trio.SSLStream):
                with trio.move_on_after(self.limits.linger):
                    if isinstance(self.stream, trio.SocketStream):
                        await self.stream.send_eof()
                    drained = 0
                    while drained < 4 * self.limits.max_body_bytes:  # and at most `linger` seconds
                        data = await self.stream.receive_some(RECEIVE_BYTES)
                        if not data:
                            break
                        drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(self.stream)


def json_bytes(obj: object) -> bytes:
    """``obj`` as the bytes :meth:`HttpConnection.send_json` sends."""
    return _encode(json.dumps(obj, ensure_ascii=False, separators=(",", ":")))


def _encode(text: str) -> bytes:
    return text.encode("utf-8", "replace")  # "replace": a lone surrogate must not break the reply


def _common_headers(close: bool) -> list[tuple[str, str]]:
    hdrs = [("server", "kvasir")]
    if close:
        hdrs.append(("connection", "close"))
    return hdrs


# ---------------------------------------------------------------------------------------------- the server


class HttpError(Exception):
    """An error reply: ``status`` and the JSON body ``{"error": {"code": code, "message": message}}``.

    A service whose errors look different (the OpenAI API) subclasses it and overrides :meth:`body`.
    """

    def __init__(self, status: int, code: str, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = tuple(headers)

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}


Handler = Callable[[HttpConnection, HttpRequest], Awaitable[None]]
#: Checks a request's head (method, target, headers; ``body`` empty) before its body is read; raises HttpError.
Authorize = Callable[[HttpConnection, HttpRequest], None]
#: Turns an error the server makes itself (malformed, oversized, slow, overloaded, internal) into the service's shape.
ErrorShape = Callable[[HttpError], HttpError]


def request_error(exc: h11.RemoteProtocolError | RequestTooLarge | RequestTimeout) -> HttpError:
    """The one mapping from a request that could not be read whole to its 4xx reply."""
    if isinstance(exc, RequestTooLarge):
        return HttpError(413, "request_too_large", str(exc))
    if isinstance(exc, RequestTimeout):
        return HttpError(408, "request_timeout", str(exc))
    return HttpError(exc.error_status_hint, "bad_request", f"malformed HTTP request: {exc}")


def _same(err: HttpError) -> HttpError:
    return err


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    limits: ApiLimits | None = None,
    error_shape: ErrorShape = _same,
    name: str = "HTTP",
    tls: ssl.SSLContext | None = None,
    authorize: Authorize | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``host:port`` (0: any free port) until cancelled; ``started(bound_port)``.

    ``authorize``: checks each request's head before its body is read (an API's bearer key); its HttpError is sent
    and the connection closed. A connection it has passed is a known client, evicted last when the server is full.

    ``tls`` (kvasir.util.tls.server_context): serve HTTPS. The handshake runs on the connection's first read, so
    it is bounded by the same idle and header timeouts as a request; a failed one costs that connection only.

    The handler answers one request on the connection (it may raise :class:`HttpError`). While it runs, a watcher
    cancels it if the client disconnects. Malformed, oversized or slow requests are answered here, and any other
    exception becomes a 500 without taking the server down.
    """
    server = _Server(handler, limits or ApiLimits(), error_shape, authorize)
    listeners: list[trio.abc.Listener[Any]]
    try:
        tcp = await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:  # say where: "address already in use" alone does not name the --listen at fault
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    bound = int(tcp[0].socket.getsockname()[1])
    # https_compatible: a client that closes without close_notify (most do) is an ordinary end of stream.
    listeners = list(tcp) if tls is None else [trio.SSLListener(t, tls, https_compatible=True) for t in tcp]
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trio.serve_listeners, server.serve, listeners, handler_nursery=nursery))
        log.info("%s listening on %s://%s:%d", name, "https" if tls else "http", host, bound)
        task_status.started(bound)


class _Server:
    """Admission and the request loop. Connections are kept in arrival order; when the server or one address group
    is full, the newcomer takes the place of the oldest connection that is not *busy* (no request being read past
    its head or handled): first one that was never authorized, then an idle keep-alive one. So idle or slow
    strangers can never lock out a client whose request is under way or who arrives with a valid key (security
    N12); only when every connection is busy is the newcomer refused (503, or 429 per address group)."""

    def __init__(
        self, handler: Handler, limits: ApiLimits, error_shape: ErrorShape, authorize: Authorize | None = None
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.error_shape = error_shape
        self.authorize = authorize
        self.live: dict[HttpConnection, None] = {}  # admitted connections, oldest first
        self.per_client: dict[str, int] = {}

    @property
    def connections(self) -> int:
        return len(self.live)

    def _victim(self, group: str | None) -> HttpConnection | None:
        """The connection to evict for a newcomer (of ``group``, None: any): oldest never-authorized first."""
        idle = [c for c in self.live if not c.busy and (group is None or c.peer == group)]
        return next((c for c in idle if not c.trusted), idle[0] if idle else None)

    def _admit(self, http: HttpConnection) -> HttpError | None:
        """Make room for ``http`` (evicting if need be) and count it; or the error that refuses it, uncounted."""
        if self.per_client.get(http.peer, 0) >= self.limits.max_connections_per_client:
            victim = self._victim(http.peer)
            if victim is None:
                return HttpError(429, "rate_limited", "too many connections from this address")
            self._release(victim, evict=True)
        if len(self.live) >= self.limits.max_connections:
            victim = self._victim(None)
            if victim is None:
                return HttpError(503, "overloaded", "too many connections")
            self._release(victim, evict=True)
        self.live[http] = None
        self.per_client[http.peer] = self.per_client.get(http.peer, 0) + 1
        return None

    def _release(self, http: HttpConnection, *, evict: bool = False) -> None:
        if http not in self.live:
            return
        del self.live[http]
        self.per_client[http.peer] -= 1
        if not self.per_client[http.peer]:
            del self.per_client[http.peer]
        if evict:
            log.debug("evicting an idle connection from %s to admit a newer one", http.peer)
            http.scope.cancel()

    async def serve(self, stream: trio.abc.Stream) -> None:
        """One client connection; never raises (a failing connection must not take the server down)."""
        http = HttpConnection(stream, self.limits)
        refusal = self._admit(http)
        try:
            if refusal is not None:  # never counted: refused ones cannot fill the server for others
                with trio.move_on_after(self.limits.linger):
                    await self._send_error(http, refusal, close=True)
                return
            with http.scope:
                while True:
                    try:
                        request = await http.read_request(self.authorize)
                    except (h11.RemoteProtocolError, RequestTooLarge, RequestTimeout) as exc:
                        await self._send_error(http, request_error(exc), close=True)
                        return
                    except HttpError as err:  # refused on its head (401): the body is never read
                        await self._send_error(http, err, close=True)
                        return
                    if request is None:
                        return
                    await self._handle(http, request)
                    http.busy = False
                    if not http.next_cycle():
                        return
        except ClientGone:
            pass
        except Exception:
            log.exception("HTTP connection failed")
        finally:
            self._release(http)
            with trio.CancelScope(shield=True):
                await http.close()

    async def _handle(self, http: HttpConnection, request: HttpRequest) -> None:
        """Answer one request, watching for the client going away meanwhile."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(http.watch, nursery.cancel_scope)
            try:
                await self.handler(http, request)
            except ClientGone:
                http.peer_closed = True
            except HttpError as err:
                await self._send_error(http, err)
            except Exception:
                log.exception("%s %s failed", request.method, request.path)
                await self._send_error(http, HttpError(500, "internal", "internal server error"), close=True)
            nursery.cancel_scope.cancel()

    async def _send_error(self, http: HttpConnection, err: HttpError, close: bool = False) -> None:
        err = self.error_shape(err)
        try:
            if http.can_respond:
                await http.send_json(err.status, err.body(), err.headers, close=close)
            elif http.in_event_stream and not http.peer_closed:
                await http.send_sse(err.body())  # a stream already under way ends with an error object
                await http.end_message()
            # else a fixed-length body is under way: the connection closes short of it (next_cycle refuses)
        except ClientGone:
            http.peer_closed = True


def client_group(stream: trio.abc.Stream) -> str:
    """The peer's address group for per-client caps: an IPv4 /24 (one attacker easily holds a few addresses of one
    network, security N12) or an IPv6 /64 (:func:`~kvasir.util.addrgroup.address_group`); "?" when it has none."""
    inner: Any = getattr(stream, "transport_stream", stream)
    try:
        group = address_group(str(inner.socket.getpeername()[0]))
    except (AttributeError, OSError, IndexError):
        return "?"
    try:
        return str(ipaddress.IPv4Network((ipaddress.IPv4Address(group), 24), strict=False))
    except ValueError:  # an IPv6 /64 (or a group already wider than one address)
        return group
