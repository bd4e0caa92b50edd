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
import stat
from pathlib import Path
from typing import Any

import attrs
import trio

from kvasir.control.ops import GenerateOp, StatusOp, WatchOp, parse_op
from kvasir.core.errors import InputError, KvasirError
from kvasir.ring.events import event_to_wire
from kvasir.ring.node import Node
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.ring.status import NodeStatus, read_supervisor_state

log = logging.getLogger("kvasir.control")
MAX_LINE = 1 << 20


async def serve_control(
    node: Node, path: Path, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    await _clear_stale(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(str(path))
    # chmod, not a umask flip: the umask is process-wide and other threads create files meanwhile.
    os.chmod(path, 0o600)
    ours = os.stat(path).st_ino
    sock.listen(16)
    listener = trio.SocketListener(sock)
    try:
        async with trio.open_nursery() as nursery:
            task_status.started(path)
            await trio.serve_listeners(functools.partial(_serve_client, node), [listener], handler_nursery=nursery)
    finally:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == ours:  # another node may have taken the path since
                os.unlink(path)


async def _clear_stale(path: Path) -> None:
    """Remove a socket a killed node left at ``path``; refuse anything else (a file, a live node's socket)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise InputError(f"control socket {path}: the path exists and is not a socket; not removing it")
    probe = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await probe.connect(str(path))
    except OSError:  # refused: nobody listens, a stale socket
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise InputError(f"control socket {path}: another process is serving it")


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
            try:
                op = parse_op(msg)
                if isinstance(op, StatusOp):
                    await lines.write({"type": "status", "status": _status(node).to_wire()})
                elif isinstance(op, WatchOp):
                    await _watch(node, lines, op.clamped_interval)
                    return
                elif isinstance(op, GenerateOp):
                    await _generate(node, lines, op)
                else:
                    await node.cancel(op.request)
                    await lines.write({"type": "cancelled", "request": op.request})
            except (KvasirError, ValueError, TypeError, OverflowError) as exc:  # OverflowError: int(Infinity)
                await lines.write({"type": "error", "error": str(exc)})
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        return
    finally:
        await stream.aclose()


def _status(node: Node) -> NodeStatus:
    """The node's status, with ``ring up``'s supervisor's view of the ring when it runs under one (read here, where
    the status leaves the node: a small file, rewritten at each change)."""
    status = node.status()
    path = node.config.supervisor_state
    return status if path is None else attrs.evolve(status, supervisor=read_supervisor_state(path))


async def _watch(node: Node, lines: _Lines, interval: float) -> None:
    async with node.hub.subscribe() as events:
        await lines.write({"type": "status", "status": _status(node).to_wire()})
        next_status = trio.current_time() + interval
        while True:
            event = None
            with trio.move_on_at(next_status):
                event = await events.receive()
            if event is not None:
                await lines.write(event_to_wire(event))  # outside the deadline: a torn line breaks the stream
                continue
            await lines.write({"type": "status", "status": _status(node).to_wire()})
            next_status = trio.current_time() + interval


def prompt_tokens(node: Node, text: str, chat: bool) -> list[int]:
    vocab = node.stage.vocab
    if chat:
        return vocab.chat_tokens([("user", text)], node.stage.chat_template())
    return vocab.tokenize(text, add_special=True, parse_special=False)


async def _generate(node: Node, lines: _Lines, op: GenerateOp) -> None:
    # Tokenizing (and rendering a chat template) is llama.cpp and Jinja work: off the event loop, as the API does.
    tokens = (
        list(op.tokens)
        if op.tokens is not None
        else await trio.to_thread.run_sync(prompt_tokens, node, op.prompt, op.chat)
    )
    async with node.request(tokens, op.sampling, op.max_tokens, op.stop, speculate=op.speculate) as handle:
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
