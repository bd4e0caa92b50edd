"""The node's control socket: JSON lines over a Unix socket, for the TUI and ``kvasir status``.

Protocol (docs/protocol.md § Control socket): the client writes one JSON object per line, ``{"op": ...}``;
the node answers with JSON lines. ``status`` answers once; ``watch`` streams status snapshots and events until the
client leaves; ``generate`` streams the request's tokens and its end; ``cancel`` cancels a request.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import trio

from kvasir.errors import KvasirError
from kvasir.ring.node import Node
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.wire import SamplingParams

log = logging.getLogger("kvasir.control")
MAX_LINE = 1 << 20


async def serve_control(
    node: Node, path: Path, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    _unlink(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket file is created 0600
    try:
        await sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            await trio.serve_listeners(functools.partial(_serve_client, node), [listener], handler_nursery=nursery)
    finally:
        _unlink(path)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class _Lines:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def read(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            if len(self.buf) > MAX_LINE:
                raise ValueError("line too long")
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.buf += data
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        obj = json.loads(line)
        if not isinstance(obj, dict):
            raise ValueError("each line must be a JSON object")
        return obj

    async def write(self, obj: dict[str, Any]) -> None:
        await self.stream.send_all(json.dumps(obj).encode() + b"\n")


async def _serve_client(node: Node, stream: trio.SocketStream) -> None:
    lines = _Lines(stream)
    try:
        while True:
            try:
                msg = await lines.read()
            except (ValueError, RecursionError) as exc:  # not JSON, not an object, or nested beyond the parser
                await lines.write({"type": "error", "error": f"bad request: {exc}"})
                return
            if msg is None:
                return
            op = msg.get("op")
            try:
                if op == "status":
                    await lines.write({"type": "status", "status": node.status().to_wire()})
                elif op == "watch":
                    await _watch(node, lines, float(msg.get("interval", 1.0)))
                    return
                elif op == "generate":
                    await _generate(node, lines, msg)
                elif op == "cancel":
                    await node.cancel(int(msg.get("request", 0)))
                    await lines.write({"type": "cancelled", "request": msg.get("request")})
                else:
                    await lines.write(
                        {"type": "error", "error": f"unknown op {op!r} (status, watch, generate, cancel)"}
                    )
            except (KvasirError, ValueError, TypeError, OverflowError) as exc:  # OverflowError: int(Infinity)
                await lines.write({"type": "error", "error": str(exc)})
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        await stream.aclose()


async def _watch(node: Node, lines: _Lines, interval: float) -> None:
    interval = min(max(interval, 0.1), 10.0)
    async with node.hub.subscribe() as events:
        await lines.write({"type": "status", "status": node.status().to_wire()})
        next_status = trio.current_time() + interval
        while True:
            event = None
            with trio.move_on_at(next_status):
                event = await events.receive()
            if event is not None:
                await lines.write(event)  # outside the deadline: a line cut short would tear the stream
                continue
            await lines.write({"type": "status", "status": node.status().to_wire()})
            next_status = trio.current_time() + interval


def prompt_tokens(node: Node, text: str, chat: bool) -> list[int]:
    vocab = node.stage.vocab
    if chat:
        rendered = vocab.chat_prompt([("user", text)], node.stage.chat_template())
        return vocab.tokenize_chat(rendered)
    return vocab.tokenize(text, add_special=True, parse_special=False)


async def _generate(node: Node, lines: _Lines, msg: dict[str, Any]) -> None:
    if "tokens" in msg:
        tokens = [int(t) for t in msg["tokens"]]
    else:
        tokens = prompt_tokens(node, str(msg.get("prompt", "")), bool(msg.get("chat", False)))
    params = SamplingParams(
        temperature=float(msg.get("temperature", 0.0)),
        top_k=int(msg.get("top_k", 40)),
        top_p=float(msg.get("top_p", 0.95)),
        min_p=float(msg.get("min_p", 0.05)),
        repeat_penalty=float(msg.get("repeat_penalty", 1.0)),
        seed=None if msg.get("seed") is None else int(msg["seed"]),
    )
    stop = [str(s) for s in msg.get("stop", [])]
    async with node.request(tokens, params, int(msg.get("max_tokens", 64)), stop) as handle:
        await lines.write({"type": "accepted", "request": handle.request_id, "prompt_tokens": handle.prompt_tokens})
        async for ev in node.events(handle):
            if isinstance(ev, TokenEvent):
                await lines.write({"type": "token", "index": ev.index, "token": ev.token, "text": ev.text})
            elif isinstance(ev, EndEvent):
                await lines.write(
                    {
                        "type": "end",
                        "reason": ev.reason,
                        "prompt_tokens": ev.prompt_tokens,
                        "generated_tokens": ev.generated_tokens,
                        "text": ev.text,
                        "error": ev.error,
                        "code": ev.code,
                    }
                )
