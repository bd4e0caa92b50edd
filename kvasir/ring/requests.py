"""Per-request state a node keeps, and what the entry node streams to its client."""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import trio

from kvasir.stage.pipeline import find_stop
from kvasir.stage.sampling import Sampler
from kvasir.stage.vocab import TextStream
from kvasir.wire import EndReason, StartRequest


@attrs.frozen
class TokenEvent:
    index: int
    token: int
    text: str


@attrs.frozen
class EndEvent:
    reason: str  # eog | max_tokens | stop | cancelled | error
    prompt_tokens: int
    generated_tokens: int
    text: str = ""
    error: str | None = None
    #: For reason "error": the ring's error code name (e.g. "bad_request", "context_full", "overloaded").
    code: str | None = None


ClientEvent = TokenEvent | EndEvent


class SeqPool:
    """Sequence ids of this node's stage context; each in-flight request holds one."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, seq: int) -> None:
        self._free.append(seq)

    @property
    def free(self) -> int:
        return len(self._free)


class EntryStream:
    """What the client of the entry node receives: text deltas that never show part of a stop string."""

    def __init__(self, text_stream: TextStream, stop: Sequence[str], max_tokens: int) -> None:
        self._text = text_stream
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._buffer = ""
        self.emitted = ""
        # Bounded by the request itself: at most max_tokens token events and one end event.
        self.send, self.receive = trio.open_memory_channel[ClientEvent](max_tokens + 2)

    def push(self, index: int, token: int) -> None:
        self._buffer += self._text.push(token)
        safe = self._buffer
        cut = find_stop(self.emitted + safe, self._stop)
        if cut is not None:
            safe = (self.emitted + safe)[:cut][len(self.emitted) :]
        elif self._hold:
            safe = safe[: max(0, len(safe) - self._hold)]
        self._buffer = self._buffer[len(safe) :]
        self.emitted += safe
        self.send.send_nowait(TokenEvent(index, token, safe))

    def finish(
        self, reason: str, prompt_tokens: int, generated: int, error: str | None = None, code: str | None = None
    ) -> None:
        rest = self._buffer + (self._text.flush() if reason != "stop" else "")
        full = self.emitted + rest
        cut = find_stop(full, self._stop)
        if cut is not None:
            full = full[:cut]
        tail = full[len(self.emitted) :] if len(full) > len(self.emitted) else ""
        self.emitted += tail
        try:
            if tail:
                self.send.send_nowait(TokenEvent(-1, -1, tail))
            self.send.send_nowait(EndEvent(reason, prompt_tokens, generated, self.emitted, error, code))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        self.send.close()


@attrs.define
class RequestState:
    start: StartRequest
    seq: int
    #: Tokens seen passing this node (index of the next expected one).
    seen: int = 0
    generated: int = 0
    sampler: Sampler | None = None
    #: Last rank only: detokenized output, for stop strings.
    text_stream: TextStream | None = None
    text: str = ""
    entry: EntryStream | None = None
    done: bool = False
    #: Held while the stage computes for this request, so its sequence is never freed mid-compute.
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    #: When a frame of this request last passed this node (time.monotonic()); the stale-request reaper reads it.
    touched: float = attrs.field(factory=time.monotonic)

    @property
    def request_id(self) -> int:
        return self.start.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.start.prompt)


REASONS = {
    EndReason.EOG: "eog",
    EndReason.MAX_TOKENS: "max_tokens",
    EndReason.STOP: "stop",
    EndReason.CANCELLED: "cancelled",
    EndReason.ERROR: "error",
}
