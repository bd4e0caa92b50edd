"""The OpenAI-compatible HTTP API against a scripted fake node: routing, shapes, SSE, errors, disconnects, and
the official ``openai`` client (run in a worker thread while the server runs in the test's nursery)."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import h11
import pytest
import trio

from kvasir.api import ApiAccess, ApiBackend, ApiLimits, serve_api
from kvasir.core.clientauth import sign_auth
from kvasir.core.errors import InputError, RingError
from kvasir.core.identity import Identity
from kvasir.net.http import Handler, HttpConnection, HttpError, HttpRequest, serve_http
from kvasir.ring.requests import ClientEvent, EndEvent, TokenEvent
from kvasir.wire import SamplingParams

if TYPE_CHECKING:
    from kvasir.ring.node import Node, RequestHandle

    def _node_is_a_backend(node: Node) -> None:
        backend: ApiBackend[RequestHandle] = node  # mypy proves the real Node satisfies the protocol
        del backend


MODEL = "fake-model"
TIMEOUT = 10


# ---------------------------------------------------------------------------------------------------- the fake


class FakeVocab:
    """One token per whitespace-separated word (id = length of the word + 2), plus BOS=1 with add_special."""

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        words = [1 if parse_special and w == "<bos>" else len(w) + 2 for w in text.split()]
        return ([1] if add_special else []) + words

    def chat_tokens(self, messages: Sequence[tuple[str, str]], template: str | None) -> list[int]:
        """BOS + ``<role> content`` words + ``<assistant>``; the template "refuse" refuses (as a Jinja template's
        ``raise_exception`` does), "no-bos" leaves BOS out."""
        if template == "refuse":
            raise InputError("the model's chat template refused the conversation: roles must alternate")
        rendered = "".join(f"<{role}> {content} " for role, content in messages) + "<assistant>"
        return self.tokenize(rendered, add_special=template != "no-bos", parse_special=True)

    def longest_piece(self) -> int:
        return 4


@attrs.define
class FakeStageConfig:
    n_ctx: int = 64
    n_seq_max: int = 16


@attrs.define
class FakeStage:
    vocab: FakeVocab = attrs.field(factory=FakeVocab)
    config: FakeStageConfig = attrs.field(factory=FakeStageConfig)
    template: str | None = None

    def chat_template(self) -> str | None:
        return self.template


@attrs.frozen
class FakeManifest:
    model_name: str = MODEL
    model_sha256: str = "ab" * 32


@attrs.define
class Call:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    ended: bool = False
    cancelled: bool = False
    speculate: int | None = None
    client_auth: str = ""


@attrs.define
class FakeBackend:
    """Streams ``pieces`` (one TokenEvent each, ``delay`` apart), then ends with ``reason``.

    ``max_tokens`` truncates with reason max_tokens; ``refuse`` makes request() raise on entry.
    """

    pieces: list[str] = attrs.field(factory=lambda: ["Hello", ",", " world", "", "!"])
    reason: str = "eog"
    error: str | None = None
    code: str | None = None
    origin: int | None = None
    delay: float = 0.0
    refuse: Exception | None = None
    manifest: FakeManifest = attrs.field(factory=FakeManifest)
    stage: FakeStage = attrs.field(factory=FakeStage)
    calls: list[Call] = attrs.field(factory=list)
    cancelled: trio.Event = attrs.field(factory=trio.Event)

    @asynccontextmanager
    async def request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        stop: Sequence[str] = (),
        *,
        speculate: int | None = None,
        client_auth: str = "",
    ) -> AsyncIterator[Call]:
        if self.refuse is not None:
            raise self.refuse
        call = Call(list(prompt), params, max_tokens, tuple(stop), speculate=speculate, client_auth=client_auth)
        self.calls.append(call)
        try:
            yield call
        finally:
            if not call.ended:  # like Node: leaving before the end cancels the request
                call.cancelled = True
                self.cancelled.set()

    async def events(self, handle: Call) -> AsyncIterator[ClientEvent]:
        n = 0
        text = ""
        for i, piece in enumerate(self.pieces):
            if i >= handle.max_tokens:
                break
            await trio.sleep(self.delay)
            n += 1
            text += piece
            yield TokenEvent(i, 100 + i, piece)
        reason = "max_tokens" if len(self.pieces) > handle.max_tokens else self.reason
        handle.ended = True
        yield EndEvent(reason, len(handle.prompt), n, text, self.error, self.code, self.origin)


_fake_is_a_backend: ApiBackend[Call] = FakeBackend()


# ---------------------------------------------------------------------------------------------------- helpers


async def start(nursery: trio.Nursery, backend: FakeBackend, access: ApiAccess | None = None, **limits: Any) -> int:
    serve = functools.partial(serve_api, backend, "127.0.0.1", 0, limits=ApiLimits(**limits), access=access)
    port: int = await nursery.start(serve)
    return port


@attrs.frozen
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[Any]:
        """The SSE ``data:`` payloads, parsed (``[DONE]`` kept as a string)."""
        assert self.headers["content-type"].startswith("text/event-stream")
        out: list[Any] = []
        for block in self.body.decode().split("\n\n"):
            if block:
                assert block.startswith("data: "), block
                data = block[len("data: ") :]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out


class Client:
    """A raw HTTP/1.1 keep-alive client on one trio connection."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)

    @classmethod
    async def connect(cls, port: int) -> Client:
        return cls(await trio.open_tcp_stream("127.0.0.1", port))

    async def send(self, method: str, path: str, body: object = None, headers: Sequence[tuple[str, str]] = ()) -> None:
        if self.h11.our_state is h11.DONE:
            self.h11.start_next_cycle()
        data = b"" if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs = [("host", "test"), ("content-length", str(len(data))), *headers]
        out = self.h11.send(h11.Request(method=method, target=path, headers=hdrs))
        out += self.h11.send(h11.Data(data=data)) if data else b""
        out += self.h11.send(h11.EndOfMessage())
        await self.stream.send_all(out)

    async def _event(self) -> Any:
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.stream.receive_some(65536))

    async def head(self) -> tuple[int, dict[str, str]]:
        event = await self._event()
        assert isinstance(event, h11.Response), event
        return event.status_code, {k.decode(): v.decode() for k, v in event.headers}

    async def receive(self) -> Reply:
        status, headers = await self.head()
        body = b""
        while not isinstance(event := await self._event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data), event
            body += event.data
        return Reply(status, headers, body)

    async def call(self, method: str, path: str, body: object = None) -> Reply:
        await self.send(method, path, body)
        return await self.receive()

    async def aclose(self) -> None:
        await self.stream.aclose()


async def call(port: int, method: str, path: str, body: object = None) -> Reply:
    client = await Client.connect(port)
    try:
        return await client.call(method, path, body)
    finally:
        await client.aclose()


async def raw(port: int, data: bytes) -> bytes:
    """Send raw bytes, read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        out = b""
        while chunk := await stream.receive_some(65536):
            out += chunk
        return out


def assert_error(reply: Reply, status: int, param: str | None = None) -> dict[str, Any]:
    assert reply.status == status, reply
    err: dict[str, Any] = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# ---------------------------------------------------------------------------------------------------- routes


async def test_models(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend())
        reply = await call(port, "GET", "/v1/models")
        assert reply.status == 200
        assert reply.headers["content-type"] == "application/json"
        body = reply.json()
        assert body["object"] == "list"
        [model] = body["data"]
        assert model["id"] == MODEL and model["object"] == "model" and model["owned_by"] == "kvasir"
        assert isinstance(model["created"], int)
        one = await call(port, "GET", f"/v1/models/{MODEL}")
        assert one.json() == model
        assert assert_error(await call(port, "GET", "/v1/models/gpt-4"), 404)["code"] == "model_not_found"


async def test_completion_shape(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend()
        port = await start(nursery, fake)
        reply = await call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "say hi", "max_tokens": 8})
        assert reply.status == 200, reply
        body = reply.json()
        assert body["id"].startswith("cmpl-")
        assert body["object"] == "text_completion"
        assert body["model"] == MODEL and isinstance(body["created"], int)
        assert body["choices"] == [{"index": 0, "text": "Hello, world!", "logprobs": None, "finish_reason": "stop"}]
        assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        [c] = fake.calls
        assert c.prompt == [1, 5, 4]  # BOS + one token per word: add_special=True
        assert c.max_tokens == 8 and c.stop == () and not c.cancelled
        # OpenAI's defaults for OpenAI's fields, llama.cpp's for the extensions
        assert (c.params.temperature, c.params.top_p, c.params.top_k, c.params.min_p) == (1.0, 1.0, 40, 0.05)
        assert c.params.seed is None


async def test_a_client_authorisation_is_forwarded_and_bounds_max_tokens(nursery: trio.Nursery) -> None:
    """docs/api.md § Paid requests: ``X-Kvasir-Client-Auth`` goes to the node as is (START carries it); the entry
    never asks for more tokens than it pays for; a forged or malformed one is a 400 and nothing is submitted."""
    client, market = Identity.generate(), Identity.generate()
    paid = sign_auth(client, market.public, "ab" * 32, max_tokens=6, max_price=10, not_after=2**31)
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend()
        port = await start(nursery, fake)

        async def post(body: dict[str, Any], auth: str) -> Reply:
            c = await Client.connect(port)
            try:
                await c.send("POST", "/v1/completions", {"model": MODEL, "prompt": "say hi", **body},
                             [("x-kvasir-client-auth", auth)])  # fmt: skip
                return await c.receive()
            finally:
                await c.aclose()

        assert (await post({"max_tokens": 4}, paid)).status == 200
        assert (await post({"max_tokens": 6}, paid)).status == 200  # all it pays for
        assert [(c.client_auth, c.max_tokens) for c in fake.calls] == [(paid, 4), (paid, 6)]
        assert assert_error(await post({"max_tokens": 7}, paid), 400, "max_tokens")["code"] == "invalid_client_auth"
        body, sig = paid.rsplit(".", 1)
        forged = f"{body}.{sig[:-4]}AAAA"
        other = sign_auth(client, market.public, "cd" * 32, max_tokens=6, max_price=10, not_after=2**31)
        for bad in (forged, "ka1.x.y", "nonsense", other):
            assert assert_error(await post({"max_tokens": 4}, bad), 400)["code"] == "invalid_client_auth"
        assert len(fake.calls) == 2
        assert (
            await call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        ).status == 200
        assert fake.calls[-1].client_auth == ""  # unpaid: nothing forwarded


async def test_completion_params_and_prompt_forms(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend()
        port = await start(nursery, fake)
        body = {
            "prompt": ["a b"],
            "temperature": 0,
            "top_p": 0.5,
            "seed": 7,
            "stop": "\n",
            "top_k": 3,
            "min_p": 0.1,
            "repeat_penalty": 1.1,
            "n": 1,
        }
        assert (await call(port, "POST", "/v1/completions", body)).status == 200
        c = fake.calls[-1]
        assert c.prompt == [1, 3, 3]
        assert c.params == SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1, repeat_penalty=1.1, seed=7)
        assert c.params.greedy and c.stop == ("\n",)
        assert c.max_tokens == 16  # OpenAI's completions default
        assert (await call(port, "POST", "/v1/completions", {"prompt": [5, 6, 7], "stop": ["x", "y"]})).status == 200
        assert fake.calls[-1].prompt == [5, 6, 7] and fake.calls[-1].stop == ("x", "y")
        assert fake.calls[-1].speculate is None  # not asked: the node's --speculate
        assert (await call(port, "POST", "/v1/completions", {"prompt": "a", "speculate": 4})).status == 200
        assert fake.calls[-1].speculate == 4
        bad = await call(port, "POST", "/v1/completions", {"prompt": "a", "speculate": 17})
        assert bad.status == 400 and "speculate" in bad.json()["error"]["message"]


async def test_finish_reason_length(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend())
        body = (await call(port, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})).json()
        assert body["choices"][0]["text"] == "Hello,"
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 2


async def test_chat_shape(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend(reason="stop")
        port = await start(nursery, fake)
        messages = [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]},
        ]
        body = {"model": "anything", "messages": messages, "max_completion_tokens": 9, "max_tokens": 3}
        reply = await call(port, "POST", "/v1/chat/completions", body)
        assert reply.status == 200, reply
        out = reply.json()
        assert out["id"].startswith("chatcmpl-") and out["object"] == "chat.completion" and out["model"] == MODEL
        [choice] = out["choices"]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"] == "Hello, world!"
        assert choice["finish_reason"] == "stop" and choice["index"] == 0
        [c] = fake.calls
        # BOS + "<system> be brief <user> hi there <assistant>"
        assert c.prompt == [1, 10, 4, 7, 8, 4, 7, 13]
        assert c.max_tokens == 9  # max_completion_tokens wins
        assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 5, "total_tokens": 13}


async def test_chat_uses_the_stages_template(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend(stage=FakeStage(template="no-bos"))
        port = await start(nursery, fake)
        reply = await call(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status == 200
        assert fake.calls[0].prompt == [8, 4, 13]


async def test_a_conversation_the_template_refuses_is_a_400(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend(stage=FakeStage(template="refuse"))
        port = await start(nursery, fake)
        reply = await call(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status == 400 and not fake.calls
        error = reply.json()["error"]
        assert error["param"] == "messages" and "roles must alternate" in error["message"]


async def test_chat_default_max_tokens_fills_the_context(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend()
        port = await start(nursery, fake)
        reply = await call(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert reply.status == 200
        assert fake.calls[0].max_tokens == 64 - len(fake.calls[0].prompt)


# ---------------------------------------------------------------------------------------------------- streaming


async def test_completion_stream(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend())
        reply = await call(port, "POST", "/v1/completions", {"prompt": "x", "stream": True})
        assert reply.status == 200
        events = reply.events()
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
        assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in chunks)
        assert [c["choices"][0]["text"] for c in chunks] == ["Hello", ",", " world", "!", ""]  # empty delta skipped
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["stop"]
        assert all("usage" not in c for c in chunks)


async def test_chat_stream_with_usage(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend())
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 3,
        }
        events = (await call(port, "POST", "/v1/chat/completions", body)).events()
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["choices"][0]["delta"] for c in chunks[1:4]] == [{"content": t} for t in ("Hello", ",", " world")]
        assert chunks[4]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
        assert all(c["usage"] is None for c in chunks[:5])
        assert chunks[5]["choices"] == []
        assert chunks[5]["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}


async def test_stream_error_is_an_sse_error_object(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(reason="error", error="rank 2 failed"))
        reply = await call(port, "POST", "/v1/completions", {"prompt": "x", "stream": True})
        assert reply.status == 200
        events = reply.events()
        assert "[DONE]" not in events
        assert events[-1]["error"]["message"] == "rank 2 failed"
        assert set(events[-1]["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(
    ("code", "status"),
    [
        ("bad_request", 400),
        ("context_full", 400),
        ("overloaded", 503),
        ("params_mismatch", 503),
        ("chain_mismatch", 503),
    ],
)
async def test_ring_error_codes_map_to_statuses(nursery: trio.Nursery, code: str, status: int) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(reason="error", error="rank 1 refused it", code=code))
        err = assert_error(await call(port, "POST", "/v1/completions", {"prompt": "x"}), status)
        assert err["message"] == "rank 1 refused it" and err["code"] == code


@pytest.mark.parametrize("stream", [True, False])
async def test_another_members_error_text_never_reaches_the_client(nursery: trio.Nursery, stream: bool) -> None:
    """N18 (security-2): the text of an ERROR frame from any member reached the API client (a 503 body, or the
    stream's error event). Now a request another rank failed gets a fixed message naming the rank and the code."""
    words = "rank 1 says: your account is suspended, visit http://evil.example"
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend(reason="error", error=words, code="chain_mismatch", origin=2)
        port = await start(nursery, fake)
        body = {"prompt": "x", "stream": stream}
        if stream:
            reply = await call(port, "POST", "/v1/completions", body)
            err = reply.events()[-1]["error"]
        else:
            err = assert_error(await call(port, "POST", "/v1/completions", body), 503)
        assert err["message"] == "rank 2 failed the request (chain_mismatch)" and err["code"] == "chain_mismatch"
        assert "evil" not in json.dumps(err)


async def test_non_stream_ring_error_is_503(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(reason="error", error="the ring made no progress (stalled)"))
        err = assert_error(await call(port, "POST", "/v1/completions", {"prompt": "x"}), 503)
        assert err["message"] == "the ring made no progress (stalled)" and err["type"] == "server_error"


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels_the_request(nursery: trio.Nursery, stream: bool) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend(pieces=["tok"] * 1000, delay=0.01, stage=FakeStage(config=FakeStageConfig(n_ctx=4096)))
        port = await start(nursery, fake)
        client = await Client.connect(port)
        await client.send("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1000, "stream": stream})
        if stream:
            assert (await client.head())[0] == 200
        await trio.sleep(0.05)
        await client.aclose()
        await fake.cancelled.wait()
        assert fake.calls[0].cancelled
        # ... and the server still serves
        assert (await call(port, "GET", "/v1/models")).status == 200


# ---------------------------------------------------------------------------------------------------- errors


async def test_request_errors(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend())
        client = await Client.connect(port)
        chat = "/v1/chat/completions"
        comp = "/v1/completions"
        cases: list[tuple[str, str, object, int, str | None]] = [
            ("GET", "/nope", None, 404, None),
            ("POST", "/v1/models", {}, 405, None),
            ("GET", comp, None, 405, None),
            ("POST", comp, b"{not json", 400, None),
            ("POST", comp, b"", 400, None),
            ("POST", comp, b"[1]", 400, None),
            ("POST", comp, b"[" * 100000, 400, None),
            ("POST", comp, {}, 400, "prompt"),
            ("POST", comp, {"prompt": 5}, 400, "prompt"),
            ("POST", comp, {"prompt": ["a", "b"]}, 400, "prompt"),
            ("POST", comp, {"prompt": "x", "n": 2}, 400, "n"),
            ("POST", comp, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
            ("POST", comp, {"prompt": "x", "temperature": -1}, 400, "temperature"),
            ("POST", comp, {"prompt": "x", "top_p": 0}, 400, "top_p"),
            ("POST", comp, {"prompt": "x", "seed": 1.5}, 400, "seed"),
            ("POST", comp, {"prompt": "x", "seed": -1}, 400, "seed"),
            ("POST", comp, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
            ("POST", comp, {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
            ("POST", comp, {"prompt": "x", "stop": [1]}, 400, "stop"),
            ("POST", comp, {"prompt": "x", "stop": ["s"] * 17}, 400, "stop"),
            ("POST", comp, {"prompt": "x", "stream": "yes"}, 400, "stream"),
            ("POST", comp, {"prompt": "x", "echo": True}, 400, "echo"),
            ("POST", comp, {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
            ("POST", comp, {"prompt": "x", "max_tokens": 64}, 400, "prompt"),  # 2 + 64 > n_ctx 64
            ("POST", comp, {"prompt": "\ud800"}, 400, "prompt"),
            ("POST", chat, {"messages": []}, 400, "messages"),
            ("POST", chat, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
            ("POST", chat, {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
            ("POST", chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
            ("POST", chat, {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools"),
            ("POST", chat, {"messages": [{"role": "user", "content": "x " * 70}]}, 400, "messages"),
        ]
        for method, path, body, status, param in cases:
            reply = await client.call(method, path, body)  # one keep-alive connection survives every error
            err = assert_error(reply, status, param)
            if status == 405:
                assert "allow" in reply.headers
            if status == 400:
                assert err["type"] == "invalid_request_error"
        assert (await client.call("POST", comp, {"prompt": "x"})).status == 200
        await client.aclose()


@pytest.mark.parametrize(
    ("refuse", "status"),
    [(InputError("prompt token id 99 out of range"), 400), (RingError("no link to the successor"), 503)],
)
async def test_node_refusals(nursery: trio.Nursery, refuse: Exception, status: int) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(refuse=refuse))
        for stream in (False, True):
            err = assert_error(await call(port, "POST", "/v1/completions", {"prompt": "x", "stream": stream}), status)
            assert err["message"] == str(refuse)


async def test_internal_error_is_500_and_server_survives(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(refuse=ZeroDivisionError("boom")))
        err = assert_error(await call(port, "POST", "/v1/completions", {"prompt": "x"}), 500)
        assert err["type"] == "server_error" and "boom" not in err["message"]
        assert (await call(port, "GET", "/v1/models")).status == 200


async def test_body_too_large_is_refused_before_reading(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(), max_body_bytes=1000)
        # Content-Length announces 10 MB; only the head is sent: the 413 must come without the body.
        head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000\r\n\r\n"
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(head)
            data = await stream.receive_some(65536)
        assert data.startswith(b"HTTP/1.1 413 ")
        # chunked bodies are counted as they arrive
        body = b"x" * 2000
        chunked = (
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n0\r\n\r\n"
        )
        assert (await raw(port, chunked)).startswith(b"HTTP/1.1 413 ")
        assert (await call(port, "GET", "/v1/models")).status == 200


async def test_malformed_http_gets_400(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend())
        assert (await raw(port, b"GARBAGE\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        big = b"GET /v1/models HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n"
        assert (await raw(port, big)).startswith(b"HTTP/1.1 431 ")
        assert (await call(port, "GET", "/v1/models")).status == 200


async def test_timeouts_close_slow_and_idle_connections(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(), idle_timeout=0.2, header_timeout=0.2)
        with trio.fail_after(2):
            assert await raw(port, b"") == b""  # idle: closed without a word
            assert (await raw(port, b"GET /v1/models HTTP/1.1\r\n")).startswith(b"HTTP/1.1 408 ")
        client = await Client.connect(port)
        assert (await client.call("GET", "/v1/models")).status == 200
        await trio.sleep(0.5)
        with pytest.raises((trio.BrokenResourceError, h11.RemoteProtocolError)):
            await client.call("GET", "/v1/models")
        await client.aclose()


async def test_keep_alive_and_pipelining(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(delay=0.01))
        client = await Client.connect(port)
        for _ in range(3):
            assert (await client.call("POST", "/v1/completions", {"prompt": "x"})).status == 200
        await client.aclose()
        one = b"GET /v1/models HTTP/1.1\r\nhost: t\r\n\r\n"
        post = json.dumps({"prompt": "x"}).encode()
        two = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n%s" % (len(post), post)
        last = b"GET /v1/models HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
        out = await raw(port, two + one + last)
        assert out.count(b"HTTP/1.1 200 ") == 3
        assert out.index(b"text_completion") < out.index(b'"object":"list"')


async def test_concurrent_clients(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend(delay=0.01)
        port = await start(nursery, fake)
        results: list[int] = []

        async def one() -> None:
            results.append((await call(port, "POST", "/v1/completions", {"prompt": "x", "stream": True})).status)

        async with trio.open_nursery() as inner:
            for _ in range(8):
                inner.start_soon(one)
        assert results == [200] * 8 and len(fake.calls) == 8


# ---------------------------------------------------------------------------------------------------- one server


async def start_plain(nursery: trio.Nursery, handler: Handler, **limits: Any) -> int:
    port: int = await nursery.start(functools.partial(serve_http, handler, "127.0.0.1", 0, limits=ApiLimits(**limits)))
    return port


async def plain_ok(http: HttpConnection, request: HttpRequest) -> None:
    await http.send_json(200, {"ok": True})


@pytest.mark.parametrize(
    ("data", "status", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400, "bad_request"),
        (b"GET / HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n", 431, "bad_request"),
        (b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 10000000\r\n\r\n", 413, "request_too_large"),
    ],
)
async def test_one_error_mapping_in_each_services_shape(
    nursery: trio.Nursery, data: bytes, status: int, code: str
) -> None:
    """The API and the plain services (market, seeder) share one server: same status and code, own body shape."""
    with trio.fail_after(TIMEOUT):
        api = await start(nursery, FakeBackend(), max_body_bytes=1000)
        plain = await start_plain(nursery, plain_ok, max_body_bytes=1000)
        for port, keys in ((api, {"message", "type", "param", "code"}), (plain, {"message", "code"})):
            reply = await raw(port, data)
            assert reply.startswith(b"HTTP/1.1 %d " % status), reply[:80]
            err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
            assert set(err) == keys and err["code"] == code


async def test_overloaded_server_answers_503_in_each_shape(nursery: trio.Nursery) -> None:
    """503 only when every connection has a request under way (an idle one would make room, N12)."""
    release = trio.Event()

    async def plain_slow(http: HttpConnection, request: HttpRequest) -> None:
        await release.wait()
        await http.send_json(200, {"ok": True})

    with trio.fail_after(TIMEOUT):
        slow = FakeBackend(pieces=["tok"] * 100, delay=0.05, stage=FakeStage(config=FakeStageConfig(n_ctx=4096)))
        for port, keys in (
            (await start(nursery, slow, max_connections=1), {"message", "type", "param", "code"}),
            (await start_plain(nursery, plain_slow, max_connections=1), {"message", "code"}),
        ):
            hold = await Client.connect(port)
            await hold.send("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
            await trio.sleep(0.1)  # its request is under way
            reply = await call(port, "GET", "/v1/models")
            assert reply.status == 503 and set(reply.json()["error"]) == keys
            assert reply.json()["error"]["code"] == "overloaded"
            await hold.aclose()
        release.set()


async def test_plain_handler_is_cancelled_when_the_client_goes(nursery: trio.Nursery) -> None:
    """The disconnect watcher is the server's, so a plain service's handler stops too (a seeder mid-file)."""
    started, cancelled = trio.Event(), trio.Event()

    async def slow(http: HttpConnection, request: HttpRequest) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    with trio.fail_after(TIMEOUT):
        port = await start_plain(nursery, slow)
        client = await Client.connect(port)
        await client.send("GET", "/")
        await started.wait()
        await client.aclose()
        await cancelled.wait()


async def test_plain_sse_error_ends_the_stream_with_an_error_event(nursery: trio.Nursery) -> None:
    async def failing(http: HttpConnection, request: HttpRequest) -> None:
        await http.start_sse()
        await http.send_sse({"n": 1})
        raise HttpError(503, "gone", "upstream went away")

    with trio.fail_after(TIMEOUT):
        port = await start_plain(nursery, failing)
        reply = await call(port, "GET", "/")
        assert reply.status == 200
        assert reply.events() == [{"n": 1}, {"error": {"code": "gone", "message": "upstream went away"}}]


# ---------------------------------------------------------------------------------------------------- openai client


def _openai_client(port: int) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


async def test_openai_client(nursery: trio.Nursery) -> None:
    with trio.fail_after(TIMEOUT * 2):
        port = await start(nursery, FakeBackend())

        def use() -> None:
            with _openai_client(port) as client:
                assert [m.id for m in client.models.list()] == [MODEL]
                comp = client.completions.create(model=MODEL, prompt="hi there", max_tokens=4, temperature=0)
                assert comp.choices[0].text == "Hello, world" and comp.choices[0].finish_reason == "length"
                assert comp.usage is not None and comp.usage.total_tokens == 3 + 4
                chat = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], seed=3, stop=["\n"]
                )
                assert chat.choices[0].message.content == "Hello, world!"
                assert chat.choices[0].finish_reason == "stop"
                parts = [
                    c.choices[0].text
                    for c in client.completions.create(model=MODEL, prompt="hi", max_tokens=10, stream=True)
                ]
                assert "".join(parts) == "Hello, world!"
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = list(stream)
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert text == "Hello, world!"
                assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5

        await trio.to_thread.run_sync(use)


async def test_openai_client_errors(nursery: trio.Nursery) -> None:
    openai = pytest.importorskip("openai")
    with trio.fail_after(TIMEOUT * 2):
        port = await start(nursery, FakeBackend(reason="error", error="stage failed"))

        def use() -> None:
            with _openai_client(port) as client:
                with pytest.raises(openai.BadRequestError) as bad:
                    client.completions.create(model=MODEL, prompt="x", n=2)
                assert bad.value.param == "n"
                with pytest.raises(openai.InternalServerError, match="stage failed"):
                    client.completions.create(model=MODEL, prompt="x")
                with pytest.raises(openai.APIError, match="stage failed"):
                    list(
                        client.chat.completions.create(
                            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
                        )
                    )

        await trio.to_thread.run_sync(use)


# ---------------------------------------------------------------------------------------------------- access


KEY = "k-0123456789abcdef"


async def test_bearer_keys(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        port = await start(nursery, FakeBackend(), ApiAccess(frozenset({KEY})))
        body = {"model": MODEL, "prompt": "hi"}
        for headers in ([], [("authorization", "Bearer wrong-key-0123456789")], [("authorization", KEY)]):
            client = await Client.connect(port)
            await client.send("POST", "/v1/completions", body, headers)
            reply = await client.receive()
            await client.aclose()
            assert reply.status == 401, headers
            assert reply.headers["www-authenticate"] == "Bearer"
            assert reply.json()["error"]["code"] == "invalid_api_key"
        client = await Client.connect(port)
        await client.send("POST", "/v1/completions", body, [("authorization", f"Bearer {KEY}")])
        assert (await client.receive()).status == 200
        await client.aclose()


def test_api_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# ring users\n{KEY}\n\n")
    path.chmod(0o600)
    assert ApiAccess.from_key_file(path).keys == {KEY}
    path.chmod(0o644)
    with pytest.raises(InputError, match="readable by others"):
        ApiAccess.from_key_file(path)
    path.chmod(0o600)
    for text, problem in (("# nothing\n", "no key"), ("short\n", "16 characters")):
        path.write_text(text)
        with pytest.raises(InputError, match=problem):
            ApiAccess.from_key_file(path)


async def test_per_client_request_cap(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        fake = FakeBackend(pieces=["tok"] * 50, delay=0.05, stage=FakeStage(config=FakeStageConfig(n_ctx=4096)))
        port = await start(nursery, fake, ApiAccess(max_requests_per_client=1))
        slow = await Client.connect(port)
        await slow.send("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True})
        assert (await slow.head())[0] == 200  # the first request is running
        reply = await call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert reply.status == 429 and reply.json()["error"]["code"] == "rate_limit_exceeded"
        assert len(fake.calls) == 1
        await slow.aclose()


async def test_per_client_connection_cap(nursery: trio.Nursery) -> None:
    """An address group with every connection busy is refused (429); an idle one would make room (N12)."""
    with trio.fail_after(10):
        fake = FakeBackend(pieces=["tok"] * 100, delay=0.05, stage=FakeStage(config=FakeStageConfig(n_ctx=4096)))
        port = await start(nursery, fake, max_connections_per_client=2)
        held = [await Client.connect(port) for _ in range(2)]
        for client in held:  # both are served, and stay busy
            await client.send("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True})
            assert (await client.head())[0] == 200
        reply = await call(port, "GET", "/v1/models")
        assert reply.status == 429
        for client in held:
            await client.aclose()


async def test_text_longer_than_the_context_is_refused_before_tokenizing(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        tokenized: list[str] = []
        fake = FakeBackend()  # n_ctx 64; FakeVocab's longest piece is 4 bytes: 257 bytes are at least 65 tokens
        original = fake.stage.vocab.tokenize

        def counting(text: str, **kw: Any) -> list[int]:
            tokenized.append(text)
            return original(text, **kw)

        fake.stage.vocab.tokenize = counting  # type: ignore[method-assign]
        reply = await call(
            port := await start(nursery, fake), "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 257}
        )
        assert reply.status == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
        assert tokenized == []
        reply = await call(
            port, "POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "y" * 300}]}
        )
        assert reply.status == 400 and tokenized == []
        # Just within the bound, the text is tokenized (and found to fit: one word is one token here).
        reply = await call(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 256})
        assert reply.status == 200 and tokenized == ["x" * 256]


# ---------------------------------------------------------------------------------------------------- strangers
# Outside security review 2, findings N11, N12 and N16: each test runs the attack, then shows the honest client served.


async def _connect_from(port: int, source: str) -> trio.SocketStream:
    """A connection from ``source`` (any 127/8 address: loopback, so one machine plays many networks)."""
    return await trio.open_tcp_stream("127.0.0.1", port, local_address=source)


async def _closed_by_server(stream: trio.SocketStream, within: float) -> bool:
    """True if the server closes ``stream`` (EOF or reset) within ``within`` seconds."""
    with trio.move_on_after(within):
        try:
            while await stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass
        return True
    return False


async def test_a_keyless_body_is_never_read(nursery: trio.Nursery) -> None:
    """N11: the key is checked on the head; a stranger announcing 4 MiB gets 401 at once, its body unread."""
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(), ApiAccess(frozenset({KEY})))
        head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % (4 * 1024 * 1024 - 1)
        for auth in (b"", b"authorization: Bearer wrong-key-0123456789\r\n"):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(head.replace(b"host: t\r\n", b"host: t\r\n" + auth))
                reply = b""
                with trio.fail_after(2):  # before: the server waited for the 4 MiB (up to body_timeout, 60 s)
                    while chunk := await stream.receive_some(65536):  # until the server closes
                        reply += chunk
                assert reply.startswith(b"HTTP/1.1 401 "), reply[:80]
                assert b"connection: close" in reply.lower() and b"invalid_api_key" in reply
        # The key holder's request, body and all, is answered.
        client = await Client.connect(port)
        await client.send(
            "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}, [("authorization", f"Bearer {KEY}")]
        )
        assert (await client.receive()).status == 200
        await client.aclose()


async def test_idle_strangers_cannot_lock_out_key_holders(nursery: trio.Nursery) -> None:
    """N12: idle connections from many networks fill the server; a key holder still gets in (the oldest idle
    stranger makes room), and a request under way is never evicted."""
    with trio.fail_after(TIMEOUT):
        fake = FakeBackend(pieces=["tok"] * 20, delay=0.05, stage=FakeStage(config=FakeStageConfig(n_ctx=4096)))
        port = await start(nursery, fake, ApiAccess(frozenset({KEY})), max_connections=8, max_connections_per_client=4)
        auth = [("authorization", f"Bearer {KEY}")]
        busy = Client(await _connect_from(port, "127.0.9.1"))
        await busy.send(
            "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "max_tokens": 20}, auth
        )
        assert (await busy.head())[0] == 200
        # 4 networks x 4 idle connections: twice the server's room, sent nothing at all.
        idle = [await _connect_from(port, f"127.0.{net}.1") for net in (1, 2, 3, 4) for _ in range(4)]
        await trio.sleep(0.1)
        # The key holder from yet another network is served, on a fresh connection, several times over.
        for _ in range(3):
            client = Client(await _connect_from(port, "127.0.10.1"))
            await client.send("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, auth)
            reply = await client.receive()
            assert reply.status == 200, reply
            await client.aclose()
        # The streaming request under way was never touched: it ends normally.
        body = b""
        while not isinstance(event := await busy._event(), h11.EndOfMessage):
            body += event.data
        assert body.count(b'"tok"') == 20 and body.endswith(b"data: [DONE]\n\n"), body
        # The oldest idle strangers were the ones closed; the newest still wait.
        closed = [await _closed_by_server(s, 0.05) for s in idle]
        assert closed[:4] == [True] * 4 and closed[-1] is False
        for s in idle:
            await s.aclose()
        await busy.aclose()


async def test_address_groups_are_ipv4_slash_24(nursery: trio.Nursery) -> None:
    """N12: a second address of the same /24 shares its group's cap: it takes an idle place of its own group rather
    than one more place of the server's."""
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(), max_connections=3, max_connections_per_client=2)
        first, second = await _connect_from(port, "127.0.5.1"), await _connect_from(port, "127.0.5.1")
        neighbour = await _connect_from(port, "127.0.6.1")  # another network: one of the server's 3 places
        await trio.sleep(0.05)
        third = await _connect_from(port, "127.0.5.2")  # same /24 as the first two: evicts the oldest of them
        assert await _closed_by_server(first, 2)
        assert not await _closed_by_server(neighbour, 0.2) and not await _closed_by_server(second, 0.01)
        client = Client(third)
        assert (await client.call("GET", "/v1/models")).status == 200
        for s in (first, second, neighbour, third):
            await s.aclose()


async def test_a_silent_connection_is_closed_soon(nursery: trio.Nursery) -> None:
    """N12: before its first request a connection may idle only ``first_timeout`` (10 s by default, not 60 s);
    a client that was served keeps its keep-alive connection for ``idle_timeout``."""
    assert ApiLimits().first_timeout <= 10
    with trio.fail_after(TIMEOUT):
        port = await start(nursery, FakeBackend(), first_timeout=0.3, idle_timeout=30)
        silent = await trio.open_tcp_stream("127.0.0.1", port)
        with trio.fail_after(2):
            assert await _closed_by_server(silent, 2)
        await silent.aclose()
        client = await Client.connect(port)
        assert (await client.call("GET", "/v1/models")).status == 200
        await trio.sleep(0.6)
        assert (await client.call("GET", "/v1/models")).status == 200
        await client.aclose()


async def test_one_client_holds_at_most_half_the_sequences(nursery: trio.Nursery) -> None:
    """N16: with 4 sequences one key may run 2 requests at once (not 8); another key still gets its answer."""
    with trio.fail_after(TIMEOUT):
        other = "k-fedcba9876543210"
        fake = FakeBackend(pieces=["tok"] * 40, delay=0.05, stage=FakeStage(config=FakeStageConfig(4096, n_seq_max=4)))
        port = await start(nursery, fake, ApiAccess(frozenset({KEY, other})))
        body = {"model": MODEL, "prompt": "hi", "stream": True}
        held = []
        for _ in range(2):
            c = await Client.connect(port)
            await c.send("POST", "/v1/completions", body, [("authorization", f"Bearer {KEY}")])
            assert (await c.head())[0] == 200
            held.append(c)
        c = await Client.connect(port)
        await c.send("POST", "/v1/completions", body, [("authorization", f"Bearer {KEY}")])
        reply = await c.receive()
        assert reply.status == 429 and "at most 2 requests" in reply.json()["error"]["message"]
        await c.aclose()
        c = await Client.connect(port)
        await c.send(
            "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}, [("authorization", f"Bearer {other}")]
        )
        assert (await c.receive()).status == 200
        await c.aclose()
        for c in held:
            await c.aclose()
