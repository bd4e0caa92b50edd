"""The OpenAI-compatible HTTP API of a ring node (docs/api.md).

``serve_api`` owns one nursery: the listeners' accept loops and one task per connection. Each connection reads
requests one at a time (keep-alive); while a request is handled a watcher task notices a client that disconnects
and cancels the handler, which leaves ``node.request(...)`` and so cancels the request on the ring.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
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
from kvasir.errors import InputError, KvasirError, ProtocolError, RingError
from kvasir.httpserve import ApiLimits, ClientGone, HttpConnection, HttpRequest, RequestTimeout, RequestTooLarge
from kvasir.ring.requests import ClientEvent, EndEvent, TokenEvent

log = logging.getLogger("kvasir.api")

#: path → allowed methods
ROUTES: dict[str, tuple[str, ...]] = {
    "/v1/models": ("GET",),
    "/v1/completions": ("POST",),
    "/v1/chat/completions": ("POST",),
}
MODELS_PREFIX = "/v1/models/"


async def serve_api(
    node: ApiBackend[Any],
    host: str,
    port: int,
    *,
    limits: ApiLimits | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the API on ``host:port`` (port 0: any free port) until cancelled; ``started(bound_port)``.

    Pass a loopback host unless the API is meant to be reachable from other machines: it has no authentication.
    """
    server = ApiServer(node, limits or ApiLimits())
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(
            functools.partial(trio.serve_listeners, server.serve_connection, listeners, handler_nursery=nursery)
        )
        log.info("OpenAI API listening on %s:%d", host, bound)
        task_status.started(bound)


class ApiServer:
    def __init__(self, node: ApiBackend[Any], limits: ApiLimits) -> None:
        self.node = node
        self.limits = limits
        self.created = int(time.time())
        self.connections = 0

    # ------------------------------------------------------------------------------------------ connections

    async def serve_connection(self, stream: trio.abc.Stream) -> None:
        """One client connection; never raises (a failing connection must not take the server down)."""
        http = HttpConnection(stream, self.limits)
        self.connections += 1
        try:
            if self.connections > self.limits.max_connections:
                err = ApiError(503, "too many connections", type="server_error", code="overloaded")
                await http.send_json(err.status, err.body(), close=True)
                return
            while True:
                request = await self._read(http)
                if request is None:
                    break
                await self._handle(http, request)
                if not http.next_cycle():
                    break
        except ClientGone:
            pass
        except Exception:
            log.exception("API connection failed")
        finally:
            self.connections -= 1
            await http.close()

    async def _read(self, http: HttpConnection) -> HttpRequest | None:
        """The next request; answers (and returns None for) requests that cannot be read whole."""
        err: ApiError
        try:
            return await http.read_request()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            err = ApiError(status, f"malformed HTTP request: {exc}", type="invalid_request_error")
            if status == 431:
                err.code = "request_header_fields_too_large"
        except RequestTooLarge as exc:
            err = ApiError(413, str(exc), type="invalid_request_error", code="request_too_large")
        except RequestTimeout as exc:
            err = ApiError(408, str(exc), type="invalid_request_error", code="request_timeout")
        if http.can_respond:
            await http.send_json(err.status, err.body(), close=True)
        return None

    async def _handle(self, http: HttpConnection, request: HttpRequest) -> None:
        """Answer one request, watching for the client going away meanwhile."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(http.watch, nursery.cancel_scope)
            try:
                await self._route(http, request)
            except ClientGone:
                http.peer_closed = True
            except ApiError as err:
                await self._send_error(http, err)
            except Exception:
                log.exception("API request %s %s failed", request.method, request.path)
                await self._send_error(http, ApiError(500, "internal server error", type="server_error"))
            nursery.cancel_scope.cancel()

    async def _send_error(self, http: HttpConnection, err: ApiError) -> None:
        try:
            if http.can_respond:
                await http.send_json(err.status, err.body())
            elif http.in_body and not http.peer_closed:
                await http.send_sse(err.body())  # a stream already under way ends with an error object
                await http.end_message()
        except ClientGone:
            http.peer_closed = True

    # ------------------------------------------------------------------------------------------ routing

    async def _route(self, http: HttpConnection, request: HttpRequest) -> None:
        path, method = request.path, request.method
        model = self.node.manifest.model_name
        allowed = ROUTES.get(path)
        if allowed is None and path.startswith(MODELS_PREFIX):
            allowed = ("GET",)
        if allowed is None:
            raise ApiError(404, f"unknown route {method} {path}", type="invalid_request_error", code="not_found")
        if method not in allowed:
            await http.send_json(405, _method_error(method, path).body(), [("allow", ", ".join(allowed))])
            return
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
            await self._generate(http, parse_generation(kind, _json_body(request.body)))

    # ------------------------------------------------------------------------------------------ generation

    async def _tokens(self, req: GenerationRequest) -> list[int]:
        stage = self.node.stage
        vocab = stage.vocab
        if req.kind == "chat":
            template = stage.chat_template()

            def render() -> list[int]:
                return vocab.tokenize_chat(vocab.chat_prompt(req.messages, template))

            return await trio.to_thread.run_sync(render)
        if isinstance(req.prompt, tuple):
            return list(req.prompt)
        assert isinstance(req.prompt, str)
        text = req.prompt
        return await trio.to_thread.run_sync(
            functools.partial(vocab.tokenize, text, add_special=True, parse_special=False)
        )

    async def _generate(self, http: HttpConnection, req: GenerationRequest) -> None:
        param = "prompt" if req.kind == "completion" else "messages"
        try:
            prompt = await self._tokens(req)
        except InputError as exc:
            raise ApiError.invalid(str(exc), param=param) from None
        if not prompt:
            raise ApiError.invalid("the prompt is empty after tokenization", param=param)
        n_ctx = self.node.stage.config.n_ctx
        max_tokens = req.max_tokens if req.max_tokens is not None else n_ctx - len(prompt)
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
            async with self.node.request(prompt, req.params, max_tokens, req.stop) as handle:
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
    if end.code in ("bad_request", "context_full"):  # a node found the request itself unfit
        raise ApiError(400, message, type="invalid_request_error", code=end.code)
    if end.code == "overloaded":
        raise ApiError(503, message, type="server_error", code="overloaded")
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
