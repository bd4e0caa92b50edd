"""A stage without a model, and links without sockets: request-flow tests of real nodes in milliseconds.

``FakeStage`` has the interface a node uses (:class:`kvasir.ring.compute.RingStage`) and a deterministic forward:
the first stage writes each token and its position into the boundary rows, every stage adds one to a hop counter,
and the last stage "samples" a token computed from the final row. So a test knows the exact tokens a ring of
``FakeStage`` nodes must produce (:func:`expected_tokens`), and a lost, repeated or misrouted boundary changes them.
Each sequence checks that its positions arrive in order, so a sequence reused without being freed fails loudly.

``MemoryNetwork`` is a :class:`kvasir.ring.linkmgr.Transport` over trio memory streams: with it, a ring runs under
``trio.testing.MockClock(autojump_threshold=0)`` (timeouts of seconds pass instantly, never spuriously).

This is for fast tests of the node's logic only; the real path (llama.cpp stages over TCP) has its own tests.
"""

from __future__ import annotations

import errno
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import trio
import trio.testing

from kvasir.core.errors import InputError, StageError
from kvasir.core.speculate import verify_rows
from kvasir.ring.linkmgr import StreamHandler
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.wire import SamplingParams

T = TypeVar("T")

#: Columns of a fake boundary row: the token, its position, the hops it went through; the rest is padding.
TOKEN, POSITION, HOPS = 0, 1, 2
N_EMBD = 8
N_VOCAB = 64
#: The fake end-of-generation token: ``next_token`` yields it when ``eog_at`` says so.
EOG = N_VOCAB - 1


def next_token(token: int, position: int, period: int | None = None) -> int:
    """The token the fake last stage samples after ``token`` at ``position`` (never EOG, never 0).

    With ``period``, a repetitive text for speculative decoding: counting 1…period round and round, except that
    every 7th position skips one (so prompt-lookup drafts are mostly right and sometimes wrong)."""
    if period is not None:
        return 1 + (token + (1 if position % 7 else 2) - 1) % period
    return 1 + (token * 7 + position * 3 + 5) % (N_VOCAB - 2)


def expected_tokens(prompt: Sequence[int], max_tokens: int, period: int | None = None) -> list[int]:
    """What a ring of FakeStages generates for ``prompt`` (no EOG, no stop strings)."""
    out: list[int] = []
    token, pos = prompt[-1], len(prompt) - 1
    for _ in range(max_tokens):
        token = next_token(token, pos, period)
        out.append(token)
        pos += 1
    return out


@attrs.frozen
class FakeStageInfo:
    start: int
    end: int
    first: bool
    last: bool
    n_embd: int = N_EMBD
    model_sha256: str | None = None
    backend: str = "fake"
    n_threads: int = 1


@attrs.frozen
class FakeStageConfig:
    n_ctx: int = 128
    n_seq_max: int = 2
    n_batch: int = 512


class FakeVocab:
    """Token t is the text ``<t>``; text tokenizes to its bytes modulo the vocabulary (for control-socket tests)."""

    n_tokens = N_VOCAB

    def piece(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.n_tokens]
        if bad:
            raise InputError(f"token id {bad[0]} out of range [0, {self.n_tokens})")

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return ([1] if add_special else []) + [1 + b % (N_VOCAB - 2) for b in text.encode()]

    def chat_tokens(self, messages: Sequence[tuple[str, str]], template: str | None) -> list[int]:
        return self.tokenize("".join(f"{role}: {text}\n" for role, text in messages))

    def longest_piece(self) -> int:
        return 1  # tokenize gives one token per byte


class FakeSampler:
    def __init__(self) -> None:
        self.accepted: list[int] = []
        self.closed = False

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    def close(self) -> None:
        self.closed = True


class FakeStage:
    """A stage holding layers ``[start, end)`` of an ``n_layers`` model, computing with numpy on the event loop.

    ``compute_s`` is the (trio-clock) time each forward takes; ``eog_at`` ends generation with EOG at that position.
    Hold ``limiter`` to keep the stage busy, as a long compute of another request would.
    """

    def __init__(
        self,
        start: int,
        end: int,
        n_layers: int,
        *,
        n_seq_max: int = 2,
        n_ctx: int = 128,
        compute_s: float = 0.0,
        eog_at: int | None = None,
        model_sha256: str | None = None,
        period: int | None = None,
    ) -> None:
        self.info = FakeStageInfo(start, end, start == 0, end == n_layers, model_sha256=model_sha256)
        self.config = FakeStageConfig(n_ctx=n_ctx, n_seq_max=n_seq_max)
        self.vocab = FakeVocab()
        self.limiter = trio.CapacityLimiter(1)
        self.busy_s = 0.0
        self.handoff_s = 0.0  # no worker thread here
        self.compute_s = compute_s
        self.eog_at = eog_at
        self.period = period
        self.forwards = 0
        #: Next position each sequence expects (absent: the sequence is empty).
        self._next_pos: dict[int, int] = {}
        self._rows: np.ndarray[Any, np.dtype[np.float32]] | None = None
        self.verifies = 0
        #: Rows computed in verify batches (the last stage stops at a rejected draft).
        self.verify_rows = 0
        self.truncations = 0
        #: The size of each forward_batch call.
        self.batch_sizes: list[int] = []
        #: (start, end) of each compute in :meth:`run`, on trio's clock: shows which windows computed at once.
        self.spans: list[tuple[float, float]] = []

    def chat_template(self) -> str | None:
        return None

    def new_sampler(self, params: SamplingParams) -> FakeSampler:
        return FakeSampler()

    def forward(
        self,
        seq_id: int,
        pos0: int,
        *,
        tokens: Sequence[int] | None = None,
        hidden: Any = None,
    ) -> np.ndarray[Any, np.dtype[np.float32]] | None:
        if not 0 <= seq_id < self.config.n_seq_max:
            raise InputError(f"sequence id {seq_id} outside [0, {self.config.n_seq_max})")
        if (tokens is None) == (hidden is None):
            raise InputError("forward() takes tokens or hidden states, not both")
        expected = self._next_pos.get(seq_id, 0)
        if pos0 != expected:
            raise StageError(f"sequence {seq_id} expects position {expected}, got {pos0} (reused without a free?)")
        if tokens is not None:
            if not self.info.first:
                raise InputError("only the first stage takes token ids")
            rows = np.zeros((len(tokens), N_EMBD), np.float32)
            rows[:, TOKEN] = tokens
            rows[:, POSITION] = np.arange(pos0, pos0 + len(tokens))
        else:
            rows = np.array(hidden, np.float32, copy=True)
            if rows.ndim != 2 or rows.shape[1] != N_EMBD:
                raise StageError(f"boundary of shape {rows.shape}, expected [n, {N_EMBD}]")
        rows[:, HOPS] += 1
        self._next_pos[seq_id] = pos0 + len(rows)
        self.forwards += 1
        if self.info.last:
            self._rows = rows
            return None
        return rows

    def forward_verify(
        self,
        seq_id: int,
        pos0: int,
        *,
        tokens: Sequence[int] | None = None,
        hidden: Any = None,
        until: Callable[[int], bool] | None = None,
    ) -> np.ndarray[Any, np.dtype[np.float32]] | None:
        """As the real stage: row by row, each row a one-token :meth:`forward`; ``until(i)`` after each row on the
        last stage (True: the later rows are not computed). Counts verify batches and the rows computed."""
        self.verifies += 1
        if (tokens is None) == (hidden is None):
            raise InputError("forward() takes tokens or hidden states, not both")
        n = len(tokens) if tokens is not None else len(hidden)

        def row(i: int, **one: Any) -> np.ndarray[Any, np.dtype[np.float32]] | None:
            self.verify_rows += 1
            return self.forward(seq_id, pos0 + i, **one)

        rows = verify_rows(row, n, tokens=tokens, hidden=hidden, until=until)
        return np.concatenate(rows) if rows else None

    def forward_batch(self, items: Sequence[Any]) -> list[np.ndarray[Any, np.dtype[np.float32]] | None]:
        """Each item as :meth:`forward` (the fake is exact whatever the batch); the last stage keeps every item's rows
        for :meth:`sample` at :meth:`batch_index`. Checks what the real stage refuses; counts each batch's size."""
        ids = [it.seq_id for it in items]
        if not items or any(a >= b for a, b in itertools.pairwise(ids)) or len({it.n for it in items}) != 1:
            raise InputError("forward_batch() takes distinct sequences in ascending order with equal token counts")
        out, rows = [], []
        for it in items:
            out.append(self.forward(it.seq_id, it.pos0, tokens=it.tokens, hidden=it.hidden))
            if self._rows is not None and self.info.last:
                rows.append(self._rows)
        self.forwards -= len(items) - 1
        self.batch_sizes.append(len(items))
        if self.info.last:
            self._rows = np.concatenate(rows)
        return out

    def batch_index(self, item: int, n: int) -> int:
        return (item + 1) * n - 1

    def truncate(self, seq_id: int, pos: int) -> None:
        if pos > self._next_pos.get(seq_id, 0):
            raise StageError(f"sequence {seq_id} cannot roll back to {pos}: it ends at {self._next_pos.get(seq_id, 0)}")
        self._next_pos[seq_id] = pos
        self.truncations += 1

    def sample(self, sampler: FakeSampler, index: int = -1) -> int:
        if not self.info.last or self._rows is None:
            raise StageError("only the last stage samples, after a forward")
        row = self._rows[index]
        token, pos = int(row[TOKEN]), int(row[POSITION])
        if self.eog_at is not None and pos + 1 >= self.eog_at:
            return EOG
        return next_token(token, pos, self.period)

    def logits(self, index: int = -1) -> np.ndarray[Any, np.dtype[np.float32]]:
        if not self.info.last or self._rows is None:
            raise StageError("only the last stage has logits, after a forward")
        row: np.ndarray[Any, np.dtype[np.float32]] = self._rows[index].copy()
        return row

    def free_sequence(self, seq_id: int) -> None:
        self._next_pos.pop(seq_id, None)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        async with self.limiter:
            t0 = trio.current_time()
            if self.compute_s:
                await trio.sleep(self.compute_s)
            try:
                return fn(*args)
            finally:
                self.busy_s += trio.current_time() - t0
                self.spans.append((t0, trio.current_time()))

    def close(self) -> None:
        pass


class MemoryNetwork:
    """Listeners and connections on trio memory streams, addressed by port (the host is ignored)."""

    def __init__(self) -> None:
        self._listeners: dict[int, trio.MemorySendChannel[tuple[trio.abc.Stream, str]]] = {}
        self._ports = itertools.count(40000)
        self._peers = itertools.count(1)

    def port(self) -> int:
        """A port nobody listens on yet (for a manifest written before its nodes start)."""
        return next(p for p in self._ports if p not in self._listeners)

    async def listen(
        self,
        host: str,
        port: int,
        handler: StreamHandler,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        port = port or self.port()
        if port in self._listeners:
            raise OSError(errno.EADDRINUSE, f"port {port} is in use")
        send, receive = trio.open_memory_channel[tuple[trio.abc.Stream, str]](math.inf)
        self._listeners[port] = send
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(port)
                async for stream, peer in receive:
                    nursery.start_soon(handler, stream, peer)
        finally:
            del self._listeners[port]

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        await trio.lowlevel.checkpoint()
        listener = self._listeners.get(port)
        if listener is None:
            raise OSError(errno.ECONNREFUSED, "connection refused")
        ours, theirs = trio.testing.memory_stream_pair()
        listener.send_nowait((theirs, f"mem:{next(self._peers)}"))
        return ours


def fake_ring(
    windows: Sequence[tuple[int, int]], network: MemoryNetwork, *, model: str = "f" * 64, **stage: Any
) -> tuple[Manifest, list[FakeStage]]:
    """A manifest for ``windows`` on ``network``'s ports, and one FakeStage per rank."""
    n_layers = windows[-1][1]
    ranks = tuple(RankEntry(k, a, b, "mem", network.port()) for k, (a, b) in enumerate(windows))
    manifest = Manifest(model, n_layers, ranks, model_name="fake")
    return manifest, [FakeStage(a, b, n_layers, model_sha256=model, **stage) for a, b in windows]
