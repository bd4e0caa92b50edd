"""`ring up --api-port`'s front (kvasir.local.front): every node an entry, a dead one skipped, streams passed on.

The front's choices are pure functions (tested first); its forwarding runs over real sockets against scripted
entries (raw HTTP written by hand, so that an entry can die mid-answer exactly where a test wants it); a real ring
of node processes checks answers, keys and the internal ports (tests/test_front_faults.py kills nodes under it).
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from kvasir.api.server import ApiAccess
from kvasir.local.front import Entry, EntryState, Front, FrontThread, entry_order, entry_state, sse_kind
from kvasir.local.launcher import ENTRY_KEY_FILE, free_ports
from kvasir.ring.status import LinkStatus, NodeStatus
from tests.ringutil import running_ring, whole_model

READY, LINKING, DORMANT, DOWN = EntryState.READY, EntryState.LINKING, EntryState.DORMANT, EntryState.DOWN


def test_entry_state_from_a_node_status() -> None:
    def status(ready: bool, successor: str) -> NodeStatus:
        # Through the wire shape, as the front reads it from a control socket.
        bare = NodeStatus("n", 0, 3, "m", "", 6, (0, 2), ready=ready, successor=LinkStatus(successor))
        return NodeStatus.from_wire(bare.to_wire())

    assert entry_state(None) is DOWN
    assert entry_state(status(True, "up")) is READY
    assert entry_state(status(False, "dormant: waiting for a predecessor to link here")) is DORMANT
    assert entry_state(status(False, "connecting")) is LINKING


def test_entry_order_prefers_ready_and_idle_and_never_takes_a_dormant_node() -> None:
    assert entry_order([READY, READY, READY], [2, 0, 1], set()) == [1, 2, 0]
    assert entry_order([READY, READY, READY], [0, 0, 0], {0}) == [1, 2]
    # A linking node only when no node is ready; a dormant or down one never (a restarted rank 0 beside its standby).
    assert entry_order([DORMANT, LINKING, READY, DOWN], [0, 0, 5, 0], set()) == [2]
    assert entry_order([DORMANT, LINKING, LINKING, DOWN], [0, 3, 0, 0], set()) == [2, 1]
    assert entry_order([DORMANT, DOWN], [0, 0], set()) == []


def test_sse_kind_tells_the_chat_preamble_from_content_and_errors() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    text = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    assert sse_kind(b"data: " + json.dumps(role).encode()) == "preamble"
    assert sse_kind(b"data: " + json.dumps(text).encode()) == "content"
    assert sse_kind(b'data: {"error": {"message": "x", "code": "overloaded"}}') == "error"
    assert sse_kind(b"data: [DONE]") == "content"


# ---------------------------------------------------------------------------------------------- scripted entries


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


def _chunked_head() -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


TEXT = {"choices": [{"index": 0, "text": "tok", "finish_reason": None}]}
DONE = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
OVERLOADED = {"error": {"message": "rank 1 has no free sequence", "type": "server_error", "code": "overloaded"}}


class Scripted:
    """An entry that reads one request and writes ``reply`` (raw bytes); ``cut``: then drops the connection."""

    def __init__(self, reply: bytes, *, cut: bool = False, delay: float = 0.0, tail: bytes = b"") -> None:
        """``tail``: written ``delay`` s after the reply (before it, without one)."""
        self.reply, self.cut, self.delay, self.tail = reply, cut, delay, tail
        self.requests: list[bytes] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = next(int(v) for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k == b"content-length")
        while len(body) < length:
            body += await stream.receive_some(65536)
        self.requests.append(head)
        if self.tail:
            await stream.send_all(self.reply)
            await trio.sleep(self.delay)
            await stream.send_all(self.tail)
        else:
            await trio.sleep(self.delay)
            await stream.send_all(self.reply)
        if self.cut:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: a reset
        await stream.aclose()


@asynccontextmanager
async def scripted_front(
    entries: list[Scripted | None], access: ApiAccess | None = None
) -> AsyncIterator[tuple[Front, str]]:
    """A front whose entries are ``entries`` (None: a port nobody listens on), all taken as ready."""
    async with trio.open_nursery() as nursery:
        ports: list[int] = []
        for scripted in entries:
            if scripted is None:
                ports.append(free_ports(1)[0])
                continue
            listeners = await nursery.start(trio.serve_tcp, scripted.handle, 0)
            ports.append(listeners[0].socket.getsockname()[1])
        front = Front(
            tuple(Entry(i, f"rank {i}", p, Path("/nonexistent")) for i, p in enumerate(ports)),
            "internal-key-0123456789",
            access or ApiAccess(),
            retry_s=2.0,
        )
        front.states = [READY] * len(entries)
        port = await nursery.start(front._serve_http, 0)
        yield front, f"http://127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


async def _post(url: str, body: object, headers: dict[str, str] | None = None) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(url + "/v1/completions", json=body, headers=headers)


def _events(text: str) -> list[object]:
    return [json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]" for line in text.split("\n") if line]


async def test_a_refused_entry_is_skipped_and_the_next_one_answers() -> None:
    body = b'{"ok":true}'
    good = Scripted(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n" + body)
    async with scripted_front([None, good]) as (front, url):
        r = await _post(url, {"prompt": "x"})
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert front.retries == 1 and front.states[0] is DOWN  # not tried again until its status says so
        r = await _post(url, {"prompt": "x"})
        assert r.status_code == 200 and front.retries == 1


async def test_an_entry_lost_mid_stream_ends_the_stream_with_an_error_event() -> None:
    # Two whole events, then half of a third: the client gets the two, then the front's error, then the end.
    cut = Scripted(_chunked_head() + _chunk(_sse(TEXT, TEXT) + b'data: {"cho'), cut=True)
    async with scripted_front([cut]) as (front, url):
        r = await _post(url, {"prompt": "x", "stream": True})
        assert r.status_code == 200
        events = _events(r.text)
        assert events[:2] == [TEXT, TEXT] and len(events) == 3
        error = events[2]
        assert isinstance(error, dict) and error["error"]["code"] == "entry_lost"
        assert "rank 0" in error["error"]["message"] and front.cut == 1


async def test_an_entry_that_fails_before_its_first_token_is_retried_on_another() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
    busy = Scripted(_chunked_head() + _chunk(_sse(role, OVERLOADED)) + b"0\r\n\r\n")
    good = Scripted(_chunked_head() + _chunk(_sse(role, TEXT, DONE, b"[DONE]")) + b"0\r\n\r\n")
    async with scripted_front([busy, good]) as (front, url):
        r = await _post(url, {"prompt": "x", "stream": True})
        assert _events(r.text) == [role, TEXT, DONE, "[DONE]"]  # the busy entry's role delta never went out
        assert front.retries == 1 and len(busy.requests) == len(good.requests) == 1


async def test_a_non_streamed_answer_lost_before_it_came_is_retried() -> None:
    body = b'{"ok":true}'
    lost = Scripted(b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n{", cut=True)
    good = Scripted(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n" + body)
    async with scripted_front([lost, good]) as (front, url):
        r = await _post(url, {"prompt": "x"})
        assert r.status_code == 200 and r.json() == {"ok": True} and front.retries == 1


async def test_no_live_entry_is_a_502_once_the_retry_time_is_over() -> None:
    async with scripted_front([None, None]) as (front, url):
        start = trio.current_time()
        r = await _post(url, {"prompt": "x"})
        assert r.status_code == 502 and r.json()["error"]["code"] == "entry_unavailable"
        assert 2.0 <= trio.current_time() - start < 5.0 and front.states == [DOWN, DOWN]


async def test_the_front_checks_the_clients_key_and_sends_its_own() -> None:
    good = Scripted(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    access = ApiAccess(frozenset({"key-for-alice-0123456789"}))
    async with scripted_front([good], access) as (_front, url):
        r = await _post(url, {"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer" and good.requests == []
        paid = {"x-kvasir-client-auth": "ka1.Ym9keQ.c2ln"}  # a market client's authorisation goes on to the entry
        r = await _post(url, {"prompt": "x"}, {"authorization": "Bearer key-for-alice-0123456789", **paid})
        assert r.status_code == 200
        (head,) = good.requests
        assert b"authorization: Bearer internal-key-0123456789" in head and b"alice" not in head
        assert b"x-kvasir-client-auth: ka1.Ym9keQ.c2ln" in head


async def test_the_front_caps_each_clients_requests_at_once() -> None:
    slow = Scripted(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}", delay=1.0)
    answers: list[int] = []

    async def one(url: str) -> None:
        answers.append((await _post(url, {"prompt": "x"})).status_code)

    async with scripted_front([slow], ApiAccess(max_requests_per_client=2)) as (_front, url):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(one, url)
        assert sorted(answers) == [200, 200, 429] and len(slow.requests) == 2  # the third never reached a node
        r = await _post(url, {"prompt": "x"})  # the cap counts requests in flight only
        assert r.status_code == 200


async def test_a_clients_place_is_free_again_as_its_answer_ends_not_after_the_entrys_goodbye() -> None:
    """A client at its cap that sends its next request as soon as it read ``[DONE]`` is served, not answered 429: the
    front gave its place back as the answer ended, not once the entry's connection was through (here 1 s later)."""
    lingering = Scripted(_chunked_head() + _chunk(_sse(TEXT, DONE, b"[DONE]")), delay=1.0, tail=b"0\r\n\r\n")
    async with scripted_front([lingering], ApiAccess(max_requests_per_client=1)) as (front, url):
        async with httpx.AsyncClient(timeout=10) as first, httpx.AsyncClient(timeout=10) as second:
            body = {"prompt": "x", "stream": True}
            statuses: list[int] = []
            async with first.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():  # read to the end: an abandoned generator warns
                    if line == "data: [DONE]":
                        again = await second.post(url + "/v1/completions", json=body)
                        assert again.status_code == 200, again.text  # was 429 until the entry's end, 1 s later
                        statuses.append(again.status_code)
                        assert _events(again.text) == [TEXT, DONE, "[DONE]"]
            assert statuses == [200]
        assert front.running == {}


# ---------------------------------------------------------------------------------------------- a real ring

PROMPT = "The ring passes the hidden state on"


def test_every_node_is_an_entry_behind_the_front_and_answers_alike(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model("llama", "f32")
    keys = tmp_path / "api-keys"
    keys.write_text("key-for-alice-0123456789\n")
    keys.chmod(0o600)
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir, entries=True) as ring:
        assert ring.entry_key is not None and len(ring.entry_ports) == 3
        assert (ring.run_dir / ENTRY_KEY_FILE).stat().st_mode & 0o077 == 0
        body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
        texts = []
        for port in ring.entry_ports:  # each node's own API: behind the run's key, and the same answer
            url = f"http://127.0.0.1:{port}/v1/completions"
            assert httpx.post(url, json=body, timeout=60).status_code == 401
            r = httpx.post(url, json=body, headers={"authorization": f"Bearer {ring.entry_key}"}, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        assert texts == [whole_model(model, PROMPT, 10).text] * 3

        front = FrontThread(Front(ring.entries(), ring.entry_key, ApiAccess.from_key_file(keys)), 0)
        port = front.start()
        try:
            url, auth = f"http://127.0.0.1:{port}/v1", {"authorization": "Bearer key-for-alice-0123456789"}
            assert httpx.get(url + "/models", timeout=30).status_code == 401
            assert httpx.get(url + "/models", headers=auth, timeout=30).json()["data"][0]["id"] == model.stem
            r = httpx.post(url + "/completions", json=body, headers=auth, timeout=60)
            assert r.json()["choices"][0]["text"] == texts[0]
            with httpx.stream("POST", url + "/completions", json={**body, "stream": True}, headers=auth) as s:
                chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
            streamed = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks)
            assert streamed == texts[0] and len(chunks) >= 10  # token by token, not one lump
            r = httpx.post(url + "/completions", json={**body, "max_tokens": 10_000}, headers=auth, timeout=60)
            assert r.status_code == 400 and front.front.retries == 0  # the node's own error, passed on as it is
        finally:
            front.stop()


def test_a_front_port_taken_is_an_os_error_naming_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        thread = FrontThread(Front((), "k" * 20), port)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            thread.start()
