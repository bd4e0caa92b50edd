"""The OpenAI-compatible HTTP API of a ring node (docs/api.md).

``serve_api`` is a handler on the shared server (kvasir.net.http): it reads requests one at a time per connection
(keep-alive); while a request is handled the server's watcher notices a client that disconnects and cancels the
handler, which leaves ``node.request(...)`` and so cancels the request on the ring.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from kvasir.api.backend import ApiBackend
from kvasir.api.schema import (
    FINISH_REASONS,
    ApiError,
    GenerationRequest,
    Kind,
    chunk,
    model_list,
    model_object,
    new_id,
    parse_generation,
    response,
    usage,
    usage_chunk,
)
from kvasir.core.clientauth import ClientAuth, parse_auth
from kvasir.core.errors import InputError, KvasirError, ProtocolError, RingError
from kvasir.net.http import ApiLimits, HttpConnection, HttpError, HttpRequest, serve_http
from kvasir.ring.requests import ClientEvent, EndEvent, TokenEvent

log = logging.getLogger("kvasir.api")

#: path → allowed methods
ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
}
MODELS_PREFIX = "/v1/models/"
#: A market client's signed request authorisation (kvasir.core.clientauth), forwarded in START.
CLIENT_AUTH_HEADER = "x-kvasir-client-auth"
#: Request bodies are parsed in worker threads (a 4 MiB nested body must not stall the node's links); at most this
#: many at once.
_JSON_LIMITER_TOKENS = 2


@attrs.frozen
class ApiAccess:
    """Who may use the API and how much: bearer keys (none: open) and per-client concurrent requests."""

    keys: frozenset[str] = frozenset()
    #: Generation requests one client (its key, or without keys its address group) may have running at once; never
    #: more than half the node's sequences (:meth:`ApiServer.per_client_cap`), so one client cannot take them all.
    max_requests_per_client: int = 8

    @classmethod
    def from_key_file(cls, path: Path, **kw: Any) -> ApiAccess:
        """One key per line (blank lines and ``#`` comments skipped); the file must not be readable by others."""
        try:
            if path.stat().st_mode & 0o077:
                raise InputError(f"API key file {path} is readable by others; chmod 600 it")
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise InputError(f"cannot read API key file {path}: {exc.strerror}") from exc
        keys = frozenset(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
        if not keys:
            raise InputError(f"API key file {path} holds no key")
        if any(len(key) < 16 for key in keys):
            raise InputError(f"API key file {path}: every key needs at least 16 characters")
        return cls(keys, **kw)


async def serve_api(
    node: ApiBackend[Any],
    host: str,
    port: int,
    *,
    limits: ApiLimits | None = None,
    access: ApiAccess | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API on ``host:port`` (port 0: any free port) until cancelled; ``started(bound_port)``.

    Without ``access.keys`` the API is open: pass a loopback host unless it is meant for other machines.
    """
    api = ApiServer(node, access or ApiAccess())
    await serve_http(
        api.handle,
        host,
        port,
        limits=limits,
        error_shape=openai_error,
        name="OpenAI API",
        authorize=api.authorize,
        task_status=task_status,
    )


class OpenAiError(HttpError):
    """An :class:`ApiError` on its way out: OpenAI's body ``{"error": {message, type, param, code}}``."""

    def __init__(self, err: ApiError, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(err.status, err.code or "", err.message, headers)
        self.api_error = err

    def body(self) -> dict[str, Any]:
        return self.api_error.body()


def openai_error(err: HttpError) -> HttpError:
    """The server's own errors (malformed, oversized, slow, overloaded, internal) in OpenAI's shape."""
    if isinstance(err, OpenAiError):
        return err
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    return OpenAiError(ApiError(err.status, err.message, type=kind, code=err.code), err.headers)


class ApiServer:
    """The API's request handler for :func:`kvasir.net.http.serve_http`."""

    def __init__(self, node: ApiBackend[Any], access: ApiAccess | None = None) -> None:
        self.node = node
        self.access = access or ApiAccess()
        self.created = int(time.time())
        self.running: dict[str, int] = {}  # client -> generation requests in flight
        self._json_limiter = trio.CapacityLimiter(_JSON_LIMITER_TOKENS)

    @property
    def per_client_cap(self) -> int:
        """Generation requests one client may run at once: ``max_requests_per_client``, but at most half the
        entry node's sequences (at least one), so one key or address never holds every sequence (security N16)."""
        return min(self.access.max_requests_per_client, max(1, self.node.stage.config.n_seq_max // 2))

    def authorize(self, http: HttpConnection, head: HttpRequest) -> None:
        """The server's check of a request's head, before its body is read (security N11): 401 and close."""
        try:
            self._authorize(http, head)
        except ApiError as err:
            raise OpenAiError(err, [("www-authenticate", "Bearer")]) from None

    async def handle(self, http: HttpConnection, request: HttpRequest) -> None:
        try:
            client = self._authorize(http, request)  # again (cheap): the handler needs the client's identity
            await self._route(http, request, client)
        except ApiError as err:
            headers = [("www-authenticate", "Bearer")] if err.status == 401 else []
            raise OpenAiError(err, headers) from None

    def _authorize(self, http: HttpConnection, request: HttpRequest) -> str:
        """The client's identity for per-client caps; raises 401 without a valid key when keys are set."""
        if not self.access.keys:
            return http.peer
        given = [v for k, v in request.headers if k.lower() == "authorization"]
        key = given[0][len("Bearer ") :].strip() if len(given) == 1 and given[0].startswith("Bearer ") else ""
        # Compare with every key, in constant time each, so timing does not tell which prefix matched.
        matched = [k for k in self.access.keys if hmac.compare_digest(k.encode(), key.encode())]
        if not matched:
            raise ApiError(
                401,
                "a valid API key is required (Authorization: Bearer KEY)",
                type="invalid_request_error",
                code="invalid_api_key",
            )
        return "key:" + matched[0]

    # ------------------------------------------------------------------------------------------ routing

    async def _route(self, http: HttpConnection, request: HttpRequest, client: str) -> None:
        path, method = request.path, request.method
        model = self.node.manifest.model_name
        allowed = ROUTES.get(path)
        if allowed is None and path.startswith(MODELS_PREFIX):
            allowed = ("GET",)
        if allowed is None:
            raise ApiError(404, f"unknown route {method} {path}", type="invalid_request_error", code="not_found")
        if method not in allowed:
            raise OpenAiError(_method_error(method, path), [("allow", ", ".join(allowed))])
        if path == "/v1/models":
            await http.send_json(200, model_list(model, self.created))
        elif path.startswith(MODELS_PREFIX):
            name = path[len(MODELS_PREFIX) :]
            if name != model:
                raise ApiError(
                    404, f"the model '{name}' does not exist", type="invalid_request_error", code="model_not_found"
                )
            await http.send_json(200, model_object(model, self.created))
        else:
            kind: Kind = "completion" if path == "/v1/completions" else "chat"
            if self.running.get(client, 0) >= self.per_client_cap:
                raise ApiError(
                    429,
                    f"at most {self.per_client_cap} requests at once per client",
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                )
            self.running[client] = self.running.get(client, 0) + 1
            try:
                body = await trio.to_thread.run_sync(_json_body, request.body, limiter=self._json_limiter)
                await self._generate(http, parse_generation(kind, body), _client_auth(request))
            finally:
                self.running[client] -= 1
                if not self.running[client]:
                    del self.running[client]

    # ------------------------------------------------------------------------------------------ generation

    async def _tokens(self, req: GenerationRequest) -> list[int]:
        stage = self.node.stage
        vocab = stage.vocab
        await self._refuse_text_over_context(req)
        if req.kind == "chat":
            return await trio.to_thread.run_sync(vocab.chat_tokens, req.messages, stage.chat_template())
        if isinstance(req.prompt, tuple):
            return list(req.prompt)
        assert isinstance(req.prompt, str)
        text = req.prompt
        return await trio.to_thread.run_sync(
            functools.partial(vocab.tokenize, text, add_special=True, parse_special=False)
        )

    async def _refuse_text_over_context(self, req: GenerationRequest) -> None:
        """Refuse, before tokenizing, text that cannot fit: tokenizing megabytes costs memory and a thread."""
        if req.kind == "chat":
            size = sum(len(content.encode()) for _, content in req.messages)
        elif isinstance(req.prompt, str):
            size = len(req.prompt.encode())
        else:
            return
        n_ctx = self.node.stage.config.n_ctx
        if size <= n_ctx:  # a token holds at least one byte: such a text can never be too long
            return
        longest = await trio.to_thread.run_sync(self.node.stage.vocab.longest_piece)
        at_least = math.ceil(size / max(longest, 1))
        if at_least > n_ctx:
            raise ApiError.invalid(
                f"this model's maximum context length is {n_ctx} tokens; the prompt text ({size} bytes) is at "
                f"least {at_least} tokens",
                param="prompt" if req.kind == "completion" else "messages",
                code="context_length_exceeded",
            )

    async def _generate(
        self, http: HttpConnection, req: GenerationRequest, paid: tuple[str, ClientAuth] | None
    ) -> None:
        """``paid``: the client's signed authorisation, as text and parsed (None: an unpaid request)."""
        param = "prompt" if req.kind == "completion" else "messages"
        if paid is not None and paid[1].model != self.node.manifest.model_sha256:
            raise ApiError.invalid(
                f"the client authorisation is for model {paid[1].model[:12]}…, not this ring's",
                code="invalid_client_auth",
            )
        try:
            prompt = await self._tokens(req)
        except InputError as exc:
            raise ApiError.invalid(str(exc), param=param) from None
        if not prompt:
            raise ApiError.invalid("the prompt is empty after tokenization", param=param)
        n_ctx = self.node.stage.config.n_ctx
        max_tokens = req.max_tokens if req.max_tokens is not None else n_ctx - len(prompt)
        if paid is not None:  # never generate what the client did not pay for
            pays_for = paid[1].max_tokens
            if req.max_tokens is not None and req.max_tokens > pays_for:
                raise ApiError.invalid(
                    f"max_tokens {req.max_tokens} exceeds the {pays_for} tokens the client authorisation pays for",
                    param="max_tokens",
                    code="invalid_client_auth",
                )
            max_tokens = min(max_tokens, pays_for)
        if len(prompt) + max(max_tokens, 1) > n_ctx:
            asked = max(max_tokens, 1)
            raise ApiError.invalid(
                f"this model's maximum context length is {n_ctx} tokens; you requested {len(prompt) + asked} "
                f"tokens ({len(prompt)} in the prompt, {asked} for the completion)",
                param=param,
                code="context_length_exceeded",
            )
        rid = new_id(req.kind)
        created = int(time.time())
        model = self.node.manifest.model_name
        try:
            submitted = (
                self.node.request(prompt, req.params, max_tokens, req.stop, speculate=req.speculate)
                if paid is None
                else self.node.request(
                    prompt, req.params, max_tokens, req.stop, speculate=req.speculate, client_auth=paid[0]
                )
            )
            async with submitted as handle:
                if req.stream:
                    await self._stream(http, req, handle, rid, created, model)
                    return
                text: list[str] = []
                end: EndEvent | None = None
                async with _closing(self.node.events(handle)) as events:
                    async for event in events:
                        if isinstance(event, TokenEvent):
                            text.append(event.text)
                        else:
                            end = event
        except (InputError, ProtocolError) as exc:
            raise ApiError.invalid(str(exc), param=param) from None
        except RingError as exc:
            raise _ring_error(str(exc)) from None
        except KvasirError as exc:
            raise ApiError(500, str(exc), type="server_error") from None
        if end is None:
            raise _ring_error("the request ended without a result")
        finish = _finish_reason(end)
        await http.send_json(
            200,
            response(
                req.kind, rid, created, model, "".join(text), finish, usage(end.prompt_tokens, end.generated_tokens)
            ),
        )

    async def _stream(
        self, http: HttpConnection, req: GenerationRequest, handle: Any, rid: str, created: int, model: str
    ) -> None:
        def piece(**kw: Any) -> dict[str, Any]:
            return chunk(req.kind, rid, created, model, include_usage=req.include_usage, **kw)

        await http.start_sse()
        if req.kind == "chat":
            await http.send_sse(piece(role=True))
        async with _closing(self.node.events(handle)) as events:
            async for event in events:
                if isinstance(event, TokenEvent):
                    if event.text:
                        await http.send_sse(piece(text=event.text))
                    continue
                finish = _finish_reason(event)  # raises ApiError: sent as an SSE error object
                await http.send_sse(piece(finish=finish))
                if req.include_usage:
                    use = usage(event.prompt_tokens, event.generated_tokens)
                    await http.send_sse(usage_chunk(req.kind, rid, created, model, use))
                await http.send_sse("[DONE]")
                await http.end_message()
                return
        raise _ring_error("the request ended without a result")


@asynccontextmanager
async def _closing(events: AsyncIterator[ClientEvent]) -> AsyncIterator[AsyncIterator[ClientEvent]]:
    """Close an async generator of events when we stop early (contextlib.aclosing needs a declared aclose)."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _finish_reason(end: EndEvent) -> str:
    finish = FINISH_REASONS.get(end.reason)
    if finish is not None:
        return finish
    if end.reason == "cancelled":
        raise _ring_error("the request was cancelled")
    message = end.error or "the request failed on the ring"
    if end.origin is not None:
        # Another member's words (review N18): the client gets a fixed text, the node's log the member's.
        log.info("rank %d failed a request (%s): %s", end.origin, end.code, message)
        message = f"rank {end.origin} failed the request ({end.code or 'error'})"
    if end.code in ("bad_request", "context_full"):  # a node found the request itself unfit
        raise ApiError(400, message, type="invalid_request_error", code=end.code)
    if end.code in ("overloaded", "params_mismatch", "chain_mismatch"):  # a busy ring, or a member caught cheating
        raise ApiError(503, message, type="server_error", code=end.code)
    raise _ring_error(message)


def _ring_error(message: str) -> ApiError:
    return ApiError(503, message, type="server_error", code="ring_error")


def _method_error(method: str, path: str) -> ApiError:
    return ApiError(
        405, f"method {method} not allowed on {path}", type="invalid_request_error", code="method_not_allowed"
    )


def _json_body(body: bytes) -> Any:
    if not body:
        raise ApiError.invalid("the request body is empty; expected a JSON object")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError.invalid(f"the request body is not valid JSON: {exc}") from None


def _client_auth(request: HttpRequest) -> tuple[str, ClientAuth] | None:
    """The request's ``X-Kvasir-Client-Auth`` (docs/api.md): the client's signed authorisation, which the entry
    forwards in START for the market to settle, as text and parsed; 400 if it is not one."""
    given = [v for k, v in request.headers if k.lower() == CLIENT_AUTH_HEADER]
    if not given:
        return None
    try:
        if len(given) > 1:
            raise InputError("more than one client authorisation")
        auth = parse_auth(given[0].strip())
    except InputError as exc:
        raise ApiError.invalid(f"{CLIENT_AUTH_HEADER}: {exc}", param=None, code="invalid_client_auth") from None
    return given[0].strip(), auth
