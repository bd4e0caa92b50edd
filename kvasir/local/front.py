"""``kvasir ring up --api-port``'s front: one API port for clients, every node of the ring an entry behind it.

Every node (standbys included) serves the OpenAI-compatible API on its own loopback port, behind a key made for this
run (``LocalRing.entry_key``). The front listens on the public port, checks the client's key itself (the same key
file and rules as a node's API) and forwards each request to one live node's API, choosing by the nodes' readiness
(:func:`entry_order`, from their control sockets, polled). A refused connection, an entry lost before any byte of
the answer went out, or a 503 or 429 the entry answered before its first token, is retried on the next entry (until
``retry_s`` after the first failure); streams pass through event by event. An entry that dies mid-stream ends its
stream with an SSE error event; one that dies under a non-streamed request is retried, the client saw nothing yet.
docs/architecture.md § API front says why a front and not the API on rank 0.
"""

from __future__ import annotations

import contextlib
import enum
import hmac
import json
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import trio

from kvasir.api.schema import ApiError
from kvasir.api.server import ApiAccess, OpenAiError, openai_error
from kvasir.core.errors import InputError
from kvasir.net.http import RECEIVE_BYTES, ApiLimits, HttpConnection, HttpRequest, serve_http
from kvasir.net.upstream import Upstream, UpstreamLost
from kvasir.ring.status import NodeStatus

log = logging.getLogger("kvasir.front")

#: Paths whose requests hold a sequence of the ring while they run (counted against a client's cap).
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
#: Request headers the front sets itself (or that describe only the hop from the client).
_HOP_HEADERS = frozenset(
    {"authorization", "connection", "content-length", "expect", "host", "keep-alive", "te", "transfer-encoding"}
)
#: An answer's headers the front passes on (the rest are per hop, or its own).
_PASSED_HEADERS = frozenset({"content-type", "allow", "retry-after", "cache-control"})
#: Error codes in a stream that say "not this entry, not now": another entry, or the same one a moment later, may
#: serve it.
RETRYABLE_CODES = frozenset({"overloaded", "ring_error"})
#: Statuses of an entry's answer that say the same: the ring busy or broken (503), or a node's cap on one client hit
#: by the front's requests, which all come as one client (429; the front caps each real client itself).
RETRYABLE_STATUSES = frozenset({429, 503})
#: Largest non-streamed answer the front buffers (a whole context of text is far below).
MAX_ANSWER_BYTES = 16 * 1024 * 1024


class EntryState(enum.Enum):
    """What the front knows of one node, from its last status (or a failed connection since)."""

    DOWN = "down"  # no answer on its control socket, or its API refused a connection
    LINKING = "linking"  # answers, not dormant, a link missing: a request there waits for the ring to heal
    READY = "ready"  # both links up
    DORMANT = "dormant"  # a standby (or a restarted primary) that holds no window: never an entry


@attrs.frozen
class Entry:
    """One node as an entry: its index in the ring's processes, its name, its internal API port, its control."""

    index: int
    label: str
    port: int
    control: Path


def entry_state(status: NodeStatus | None) -> EntryState:
    """A node's state as an entry, from its control status (None: it did not answer, or not a status)."""
    if status is None:
        return EntryState.DOWN
    if status.ready:
        return EntryState.READY
    if status.successor.state.startswith("dormant"):
        return EntryState.DORMANT
    return EntryState.LINKING


def entry_order(states: Sequence[EntryState], inflight: Sequence[int], tried: set[int]) -> list[int]:
    """The entries to try, best first: the ready ones, fewest requests in flight first (then by index); only when
    none is ready, the linking ones (a request waits there for the ring to heal). Never a dormant or down one, nor
    one in ``tried``."""
    for wanted in (EntryState.READY, EntryState.LINKING):
        found = [i for i, s in enumerate(states) if s is wanted and i not in tried]
        if found:
            return sorted(found, key=lambda i: (inflight[i], i))
    return []


def sse_kind(event: bytes) -> str:
    """One SSE event of an entry's stream: ``preamble`` (a chat's opening role delta), ``error`` or ``content``."""
    payload = event.removeprefix(b"data:").strip()
    try:
        obj = json.loads(payload)
    except ValueError:
        return "content"  # "[DONE]"
    if not isinstance(obj, dict):
        return "content"
    if "error" in obj:
        return "error"
    choices = obj.get("choices")
    if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
        choice = choices[0]
        if choice.get("delta") == {"role": "assistant", "content": ""} and choice.get("finish_reason") is None:
            return "preamble"
    return "content"


def error_from_body(status: int, body: bytes) -> ApiError:
    """An entry's error answer (OpenAI's body), as an :class:`ApiError` to retry or pass on."""
    try:
        err = json.loads(body)["error"]
        kind = str(err.get("type") or "server_error")
        return ApiError(status, str(err["message"]), type=kind, param=err.get("param"), code=err.get("code"))
    except (ValueError, KeyError, TypeError):
        return ApiError(status, f"the entry node answered {status}", type="server_error", code="entry_error")


@attrs.define
class Front:
    """The front's state: the entries, what it knows of them, and the requests it forwards."""

    entries: tuple[Entry, ...]
    #: The key every node's internal API requires (``Authorization: Bearer``), set by the front on each request.
    entry_key: str
    access: ApiAccess = attrs.field(factory=ApiAccess)
    host: str = "127.0.0.1"
    #: How long after a request's first failed try the front keeps trying (other entries, then again).
    retry_s: float = 15.0
    poll_s: float = 0.5
    connect_timeout_s: float = 2.0
    limits: ApiLimits = attrs.field(factory=ApiLimits)
    states: list[EntryState] = attrs.field(init=False)
    inflight: list[int] = attrs.field(init=False)
    running: dict[str, int] = attrs.field(factory=dict)  # client -> generation requests in flight
    #: Tries that failed and were retried elsewhere, and streams an entry left mid-answer (for logs and tests).
    retries: int = 0
    cut: int = 0
    #: The ring is being stopped: a failed try is answered as it is, not retried.
    closing: bool = False

    def __attrs_post_init__(self) -> None:
        self.states = [EntryState.DOWN] * len(self.entries)
        self.inflight = [0] * len(self.entries)

    async def serve(self, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Poll the entries and serve the front on ``host:port`` until cancelled; ``started(bound_port)``."""
        async with trio.open_nursery() as nursery:
            for i in range(len(self.entries)):
                nursery.start_soon(self._poll, i)
            bound = await nursery.start(self._serve_http, port)
            task_status.started(bound)

    async def _serve_http(self, port: int, *, task_status: trio.TaskStatus[int]) -> None:
        await serve_http(
            self.handle,
            self.host,
            port,
            limits=self.limits,
            error_shape=openai_error,
            name="OpenAI API front",
            task_status=task_status,
        )

    async def _poll(self, i: int) -> None:
        while True:
            self.states[i] = entry_state(await control_status(self.entries[i].control, self.connect_timeout_s))
            await trio.sleep(self.poll_s)

    # ------------------------------------------------------------------------------------------ requests

    async def handle(self, http: HttpConnection, request: HttpRequest) -> None:
        client = self._authorize(http, request)
        generation = request.method == "POST" and request.path in GENERATION_PATHS
        if not generation:
            await self._forward(http, request, lambda: None)
            return
        if self.running.get(client, 0) >= self.access.max_requests_per_client:
            raise OpenAiError(
                ApiError(
                    429,
                    f"at most {self.access.max_requests_per_client} requests at once per client",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            )
        self.running[client] = self.running.get(client, 0) + 1
        held = True

        def release() -> None:
            """The client's place back, once: as its answer's last event goes out (a client that sends its next
            request on seeing ``[DONE]`` must not find it still taken), or when the request ends otherwise."""
            nonlocal held
            if held:
                held = False
                self.running[client] -= 1
                if not self.running[client]:
                    del self.running[client]

        try:
            await self._forward(http, request, release)
        finally:
            release()

    def _authorize(self, http: HttpConnection, request: HttpRequest) -> str:
        """As a node's API does (kvasir.api.server.ApiServer): a bearer key from the file, compared in constant time
        with every key; the client's identity for the per-client cap."""
        if not self.access.keys:
            return http.peer
        given = [v for k, v in request.headers if k.lower() == "authorization"]
        key = given[0][len("Bearer ") :].strip() if len(given) == 1 and given[0].startswith("Bearer ") else ""
        matched = [k for k in self.access.keys if hmac.compare_digest(k.encode(), key.encode())]
        if not matched:
            err = ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                type="invalid_request_error",
                code="invalid_api_key",
            )
            raise OpenAiError(err, [("www-authenticate", "Bearer")])
        return "key:" + matched[0]

    async def _forward(self, http: HttpConnection, request: HttpRequest, release: Callable[[], None]) -> None:
        """Try entries until one answers; retryable failures (nothing sent to the client yet) move on."""
        tried: set[int] = set()
        first_failure: float | None = None
        last: ApiError | None = None
        while True:
            order = entry_order(self.states, self.inflight, tried)
            if order:
                failure = await self._attempt(http, request, order[0], release)
                if failure is None:
                    return
                tried.add(order[0])
                last = failure
                self.retries += 1
                log.info("%s: %s; trying another entry", self.entries[order[0]].label, failure.message)
            first_failure = trio.current_time() if first_failure is None else first_failure
            if self.closing or trio.current_time() - first_failure > self.retry_s:
                raise OpenAiError(last or _no_entry())
            if not order:  # every entry tried once (or none is live): wait for the ring to heal, then again
                tried.clear()
                await trio.sleep(min(0.2, self.poll_s))

    async def _attempt(
        self, http: HttpConnection, request: HttpRequest, i: int, release: Callable[[], None]
    ) -> ApiError | None:
        """Forward ``request`` to entry ``i``. None: answered (or a stream ended with an error event). An error:
        this entry failed before any byte reached the client, try another."""
        entry = self.entries[i]
        self.inflight[i] += 1
        try:
            stream: trio.SocketStream | None = None
            with trio.move_on_after(self.connect_timeout_s):
                try:
                    stream = await trio.open_tcp_stream(self.host, entry.port)
                except OSError as exc:
                    self.states[i] = EntryState.DOWN
                    return _entry_error(f"{entry.label} refused the connection ({exc.strerror or exc})")
            if stream is None:  # a stopped (SIGSTOP) or swamped node: its backlog is full
                self.states[i] = EntryState.DOWN
                return _entry_error(f"{entry.label} did not accept the connection in {self.connect_timeout_s:.0f} s")
            async with stream:
                return await self._exchange(http, request, i, Upstream(stream, max_bytes=MAX_ANSWER_BYTES), release)
        finally:
            self.inflight[i] -= 1

    async def _exchange(
        self, http: HttpConnection, request: HttpRequest, i: int, up: Upstream, release: Callable[[], None]
    ) -> ApiError | None:
        entry = self.entries[i]
        try:
            headers = [(k, v) for k, v in request.headers if k.lower() not in _HOP_HEADERS]
            headers += [("host", f"{self.host}:{entry.port}"), ("authorization", f"Bearer {self.entry_key}")]
            await up.send_request(request.method, request.target, headers, request.body)
            head = await up.head()
            if head.event_stream:
                return await self._stream(http, i, up, release)
            body = await up.body()
        except UpstreamLost as exc:
            self.states[i] = EntryState.DOWN
            return _entry_error(f"{entry.label} was lost before its answer ({exc})")
        if head.status in RETRYABLE_STATUSES:
            return error_from_body(head.status, body)
        passed = [(k, v) for k, v in head.headers if k in _PASSED_HEADERS]
        if head.status == 401:  # the node refused the front's key: the front's fault, not the client's
            raise OpenAiError(ApiError(502, f"{entry.label} refused the front's key", type="server_error"))
        out = [*passed, ("content-length", str(len(body))), ("server", "kvasir")]
        release()
        await http.send_response(head.status, out, body)
        return None

    async def _stream(self, http: HttpConnection, i: int, up: Upstream, release: Callable[[], None]) -> ApiError | None:
        """Pass an SSE answer on, event by event. Held back until its first event past a chat's role delta: an
        entry that fails the request before its first token (overloaded, the ring broken) is retried elsewhere."""
        entry = self.entries[i]
        held: list[bytes] = []
        try:
            while True:
                event = await up.next_sse_event()
                if event is None:
                    raise UpstreamLost("the stream ended without [DONE]")
                held.append(event)
                kind = sse_kind(event)
                if kind == "error":
                    err = error_from_body(503, event.removeprefix(b"data:").strip())
                    if err.code in RETRYABLE_CODES:
                        return err
                if kind != "preamble":
                    break
        except UpstreamLost as exc:
            self.states[i] = EntryState.DOWN
            return _entry_error(f"{entry.label} was lost before its first token ({exc})")
        await http.start_sse()
        try:
            for event in held:
                await self._pass(http, event, release)
            while (event := await up.next_sse_event()) is not None:
                await self._pass(http, event, release)
        except UpstreamLost as exc:
            self.cut += 1
            self.states[i] = EntryState.DOWN
            message = f"the entry node ({entry.label}) was lost mid-answer ({exc}); retry the request"
            raise OpenAiError(ApiError(502, message, type="server_error", code="entry_lost")) from None
        release()
        await http.end_message()
        return None

    @staticmethod
    async def _pass(http: HttpConnection, event: bytes, release: Callable[[], None]) -> None:
        """One event of an entry's stream to the client; at ``[DONE]`` the client's place is given back first (the
        answer is whole, the entry freed its sequence): a client that sends its next request on seeing it must not
        find its place still taken."""
        if event.removeprefix(b"data:").strip() == b"[DONE]":
            release()
        await http.send_sse_raw(event)


def _entry_error(message: str) -> ApiError:
    return ApiError(502, message, type="server_error", code="entry_unavailable")


def _no_entry() -> ApiError:
    return ApiError(503, "no node of the ring can take requests now", type="server_error", code="entry_unavailable")


async def control_status(path: Path, wait_s: float) -> NodeStatus | None:
    """A node's status from its control socket (None: no answer within ``wait_s``, or not a status)."""
    with trio.move_on_after(wait_s):
        try:
            stream = await trio.open_unix_socket(str(path))
        except OSError:
            return None
        async with stream:
            try:
                await stream.send_all(b'{"op": "status"}\n')
                buffer = b""
                while b"\n" not in buffer and len(buffer) < 4 * 1024 * 1024:
                    data = await stream.receive_some(RECEIVE_BYTES)
                    if not data:
                        return None
                    buffer += data
                reply = json.loads(buffer.split(b"\n", 1)[0])
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ValueError):
                return None
        try:
            return NodeStatus.from_wire(reply.get("status") if isinstance(reply, dict) else None)
        except InputError:
            return None
    return None


class FrontThread:
    """Runs a :class:`Front` on its own trio loop in a thread, beside ``ring up``'s synchronous supervisor (which
    must start the nodes from the main thread, and takes the stop signals there)."""

    def __init__(self, front: Front, port: int) -> None:
        self.front = front
        self.port = port
        self.bound: int | None = None
        self._error: BaseException | None = None
        self._started = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._run, name="kvasir-api-front", daemon=True)

    def start(self, timeout: float = 30.0) -> int:
        """Start serving; the bound port. Raises what stopped it from listening (an ``OSError`` naming the port)."""
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"the API front did not start listening within {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        assert self.bound is not None
        return self.bound

    def stop(self, timeout: float = 5.0) -> None:
        if self._token is not None and self._scope is not None:
            with contextlib.suppress(trio.RunFinishedError):  # it ended already
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to start(); the thread must not die silently
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # the nurseries' wrapping: start() raises what failed (OSError)
            self._error = exc
            self._started.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as scope:
            self._scope = scope
            async with trio.open_nursery() as nursery:
                self.bound = await nursery.start(self.front.serve, self.port)
                self._started.set()
