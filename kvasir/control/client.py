"""A small client of the control socket (``kvasir status``, ``kvasir ring up``, tests)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvasir.core.errors import InputError, RingError
from kvasir.ring.status import NodeStatus


class ControlClient:
    """Blocking JSON-lines client; one per connection."""

    def __init__(self, path: Path, timeout: float | None = 30.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(path))
        except OSError as exc:
            self._sock.close()
            raise RingError(f"cannot reach the node at {path} ({exc.strerror or exc})") from None
        self._file = self._sock.makefile("rb")

    def send(self, obj: dict[str, Any]) -> None:
        self._sock.sendall(json.dumps(obj).encode() + b"\n")

    def read(self) -> dict[str, Any]:
        line = self._file.readline()
        if not line:
            raise RingError(f"the node at {self.path} closed the control connection")
        obj = json.loads(line)
        if obj.get("type") == "error":
            raise RingError(str(obj.get("error")))
        return obj  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        self.send({"op": "status"})
        return self.read()["status"]  # type: ignore[no-any-return]

    def node_status(self) -> NodeStatus:
        """The node's status as the typed record (the same schema the node wrote)."""
        try:
            return NodeStatus.from_wire(self.status())
        except InputError as exc:
            raise RingError(f"the node at {self.path} sent a malformed status: {exc}") from None

    def generate(self, **request: Any) -> Iterator[dict[str, Any]]:
        self.send({"op": "generate", **request})
        while True:
            msg = self.read()
            yield msg
            if msg.get("type") == "end":
                return

    def complete(self, **request: Any) -> dict[str, Any]:
        """Run one request to its end: ``{"tokens": [...], **end}`` (the end message's fields)."""
        tokens: list[int] = []
        end: dict[str, Any] = {}
        for msg in self.generate(**request):
            if msg.get("type") == "token" and msg["token"] >= 0:
                tokens.append(msg["token"])
            elif msg.get("type") == "end":
                end = msg
        return {"tokens": tokens, **end}

    def close(self) -> None:
        self._file.close()
        self._sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
