"""A ring node: one stage, a link to its predecessor and one to its successor, and the request flow between them.

Data path (docs/architecture.md): a request enters at any node, START travels once around the ring, rank 0
prefills in chunks and sends boundaries on, each rank runs its window and passes the boundary on, the last rank
samples and sends the TOKEN to rank 0, which embeds it for the next step. Every frame carries the request's latest
token, so every node sees the stream pass; the entry node streams it to its client. END, CANCEL and ERROR travel
the ring once from their origin so every node frees the request's sequence.

Frames from the predecessor are handled one at a time in arrival order by the link's reader task (that is the
backpressure: a busy node stops reading, TCP fills, its predecessor waits). Compute runs in a worker thread.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from kvasir.errors import InputError, KvasirError, ProtocolError, RingError
from kvasir.ring.edges import RingEdges
from kvasir.ring.events import EventHub
from kvasir.ring.links import Link, StreamLink, handshake, link_error
from kvasir.ring.manifest import Manifest
from kvasir.ring.requests import REASONS, ClientEvent, EndEvent, EntryStream, RequestState, SeqPool
from kvasir.stage.engine import Stage
from kvasir.stage.pipeline import PREFILL_CHUNK, find_stop
from kvasir.stage.vocab import TextStream
from kvasir.wire import (
    Boundary,
    BoundaryDType,
    Cancel,
    End,
    EndReason,
    Error,
    ErrorCode,
    Frame,
    Hello,
    Keepalive,
    SamplingParams,
    Side,
    StartRequest,
    Token,
    choose_dtype,
)

log = logging.getLogger("kvasir.node")


@attrs.frozen
class NodeConfig:
    manifest: Manifest
    rank: int
    node_id: str = attrs.field(factory=lambda: secrets.token_hex(6))
    #: Prompt tokens per prefill boundary: smaller chunks let stages overlap sooner. Keep it equal to the reference's
    #: (``kvasir generate``) for bit-identical results: llama.cpp's numbers depend on the batching.
    prefill_chunk: int = PREFILL_CHUNK
    #: How long a frame waits for a missing successor link before its request fails.
    link_wait: float = 30.0
    #: A request with no progress for this long is failed at its entry node.
    stall_timeout: float = 120.0
    keepalive_interval: float = 1.0
    #: Send both links through this relay (``ws://`` or ``wss://``), whatever the manifest says.
    relay: str | None = None
    #: Boundary encoding this node sends when its successor accepts it (f32 is bit-exact; f16/bf16 halve the bytes).
    boundary_dtype: BoundaryDType = BoundaryDType.F32


@attrs.define
class RequestHandle:
    request_id: int
    prompt_tokens: int
    events: trio.MemoryReceiveChannel[ClientEvent]


class Node:
    def __init__(self, config: NodeConfig, stage: Stage) -> None:
        m = config.manifest
        if m.size < 2:
            raise InputError("a ring needs at least 2 ranks (one stage: use `kvasir generate`)")
        me = m.rank(config.rank)
        info = stage.info
        if (info.start, info.end) != (me.start, me.end):
            raise InputError(
                f"rank {config.rank} must hold layers {me.start}:{me.end}, its stage holds {info.start}:{info.end}"
            )
        if info.model_sha256 and info.model_sha256 != m.model_sha256:
            raise InputError(
                f"stage file is cut from model {info.model_sha256[:12]}…, the ring serves {m.model_sha256[:12]}…"
            )
        self.config = config
        self.manifest = m
        self.rank = config.rank
        self.stage = stage
        self.first = info.first
        self.last = info.last
        self.hub = EventHub()
        self.hello = Hello(
            node_id=config.node_id,
            model_id=m.model_sha256,
            rank=config.rank,
            ring_size=m.size,
            window_start=me.start,
            window_end=me.end,
            n_layers=m.n_layers,
            n_embd=info.n_embd,
            dtypes=frozenset(BoundaryDType),
        )
        self.edges = RingEdges.for_node(m, config.rank, config.relay)
        self._requests: dict[int, RequestState] = {}
        self._seqs = SeqPool(stage.config.n_seq_max)
        self._admission = trio.Semaphore(stage.config.n_seq_max)
        self._succ: Link | None = None
        self._succ_ready = trio.Event()
        self._pred: Link | None = None
        self._pred_hello: Hello | None = None
        self._succ_hello: Hello | None = None
        self.successor_state = "starting"
        self.predecessor_state = "waiting"
        self._nursery: trio.Nursery | None = None
        self._keepalive_sent: float | None = None
        self.started_at = time.monotonic()
        self.counters = {"requests": 0, "tokens": 0, "boundaries": 0, "errors": 0}
        self.contribution_tokens = 0
        #: The market's coverage map of this ring (windows, holders, rewards), set by a self-enrolled node's loop.
        self.market_view: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------------------------------ service

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep both links (TCP or relay); ``started(port)`` once listening (0 when the predecessor is relayed)."""
        me = self.manifest.rank(self.rank)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            port = 0
            if self.edges.predecessor_relayed:
                nursery.start_soon(self._keep_relay_predecessor)
            else:
                listeners = await nursery.start(
                    functools.partial(trio.serve_tcp, self._serve_predecessor, me.port, host=me.host)
                )
                port = listeners[0].socket.getsockname()[1]
            nursery.start_soon(self._keep_successor)
            nursery.start_soon(self._reap_stale)
            log.info("rank %d up (port %d), layers %d:%d", self.rank, port, me.start, me.end)
            task_status.started(port)

    @property
    def ready(self) -> bool:
        return self._succ is not None and self._pred is not None

    def update_manifest(self, manifest: Manifest) -> None:
        """Take a newer manifest of the same ring (a self-enrolled node rebuilds it from the market's coverage map).

        Ranks and windows stay; addresses may change. When the successor's address changes, its link is closed so
        the dial loop reaches the new holder.
        """
        if manifest.size != self.manifest.size or manifest.model_sha256 != self.manifest.model_sha256:
            raise InputError("a manifest update must keep the ring's model and size")
        old = self.manifest.successor(self.rank)
        self.manifest = manifest
        if manifest.successor(self.rank).address != old.address and self._succ is not None and self._nursery:
            self._nursery.start_soon(self._succ.aclose)

    async def shutdown(self) -> None:
        """Fail every in-flight request with an error reply (not silence), then let the owner cancel us."""
        for state in list(self._requests.values()):
            if state.done:
                continue
            with trio.move_on_after(1):
                await self._originate_error(state, ErrorCode.SHUTTING_DOWN, f"node rank {self.rank} is shutting down")

    # ------------------------------------------------------------------------------------------ links

    async def _serve_predecessor(self, stream: trio.SocketStream) -> None:
        try:
            peer = "{}:{}".format(*stream.socket.getpeername()[:2])
        except OSError:
            peer = "?"
        await self._run_predecessor(StreamLink(stream, peer), peer)

    async def _keep_relay_predecessor(self) -> None:
        """Predecessor edge through the relay: dial out as the downstream end, redial with backoff."""
        backoff = 0.05
        while True:
            self.predecessor_state = f"dialing relay edge {self.edges.edge_in}"
            try:
                async with self.edges.open_relay(self.edges.edge_in, upstream=False) as link:
                    backoff = 0.05
                    self.predecessor_state = f"waiting on relay edge {self.edges.edge_in}"
                    await self._run_predecessor(link, f"relay:{self.edges.edge_in}")
            except RingError as exc:  # relay unreachable, refused or closed
                self.predecessor_state = f"relay edge {self.edges.edge_in}: {exc}"
            await trio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _run_predecessor(self, link: Link, peer: str) -> None:
        try:
            remote = await handshake(link, self.hello, Side.PREDECESSOR, send_first=False)
        except (RingError, ProtocolError, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.warning("rank %d refused a predecessor from %s: %s", self.rank, peer, exc)
            await link.aclose()
            return
        old = self._pred
        if old is not None:
            if self._pred_hello is None or remote.node_id != self._pred_hello.node_id:
                log.warning("rank %d refused a second predecessor from %s while one is linked", self.rank, peer)
                with trio.move_on_after(1):
                    await link.send(link_error("this node already has a linked predecessor", self.rank))
                await link.aclose()
                return
            await old.aclose()  # the same predecessor reconnecting: its old link is stale
        self._pred, self._pred_hello = link, remote
        self.predecessor_state = f"connected to rank {remote.rank} ({peer})"
        try:
            while True:
                frame = await link.receive()
                if isinstance(frame, Keepalive):
                    await link.send(Keepalive())
                    continue
                await self._on_frame(frame)
        except trio.EndOfChannel:
            log.info("rank %d: predecessor closed the link", self.rank)
        except ProtocolError as exc:
            log.warning("rank %d: closing predecessor link: %s", self.rank, exc)
            self.counters["errors"] += 1
            with trio.move_on_after(1):
                await link.send(link_error(str(exc), self.rank))
        except (trio.BrokenResourceError, trio.ClosedResourceError, RingError) as exc:
            log.info("rank %d: predecessor link lost: %s", self.rank, exc)
        finally:
            if self._pred is link:
                self._pred = None
                self.predecessor_state = "waiting"
            await link.aclose()

    @asynccontextmanager
    async def _open_successor(self) -> AsyncIterator[Link]:
        target = self.manifest.successor(self.rank)
        if self.edges.successor_relayed:
            async with self.edges.open_relay(self.edges.edge_out, upstream=True) as link:
                yield link
            return
        if target.port == 0:
            raise RingError(f"waiting for rank {target.rank} (no address yet)")
        try:
            stream = await trio.open_tcp_stream(target.host, target.port)
        except OSError as exc:
            raise RingError(f"waiting for rank {target.rank} at {target.address} ({exc.strerror or exc})") from None
        link = StreamLink(stream, target.address)
        try:
            yield link
        finally:
            await link.aclose()

    async def _keep_successor(self) -> None:
        backoff = 0.05
        while True:
            target = self.manifest.successor(self.rank)  # re-read: the manifest may have been updated
            via = f"relay edge {self.edges.edge_out}" if self.edges.successor_relayed else target.address
            self.successor_state = f"dialing rank {target.rank} via {via}"
            try:
                async with self._open_successor() as link:
                    try:
                        self._succ_hello = await handshake(link, self.hello, Side.SUCCESSOR, send_first=True)
                    except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                        raise RingError(f"handshake with rank {target.rank} failed: {exc}") from None
                    backoff = 0.05
                    self._succ = link
                    self._succ_ready.set()
                    self.successor_state = f"connected to rank {target.rank} via {via}"
                    try:
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._keepalive, link)
                            await self._read_successor(link)
                            nursery.cancel_scope.cancel()
                    finally:
                        self._succ = None
                        self._succ_ready = trio.Event()
                    self.successor_state = f"lost rank {target.rank}; redialing"
            except RingError as exc:
                self.successor_state = str(exc) if "waiting" in str(exc) else f"rank {target.rank}: {exc}"
                if "waiting" not in str(exc):
                    log.warning("rank %d: successor link: %s", self.rank, exc)
                    backoff = max(backoff, 1.0)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _keepalive(self, link: Link) -> None:
        while True:
            self._keepalive_sent = time.perf_counter()
            try:
                await link.send(Keepalive())
            except (trio.BrokenResourceError, trio.ClosedResourceError, RingError):
                return
            await trio.sleep(self.config.keepalive_interval)

    async def _read_successor(self, link: Link) -> None:
        """The successor only echoes keepalives and reports link-level errors backwards."""
        try:
            while True:
                frame = await link.receive()
                if isinstance(frame, Keepalive) and self._keepalive_sent is not None:
                    link.stats.rtt = time.perf_counter() - self._keepalive_sent
                elif isinstance(frame, Error):
                    log.warning("rank %d: successor reports: %s", self.rank, frame.message)
                    return
        except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError, RingError):
            return

    async def _send(self, frame: Frame) -> None:
        with trio.move_on_after(self.config.link_wait):
            while self._succ is None:
                await self._succ_ready.wait()
        link = self._succ
        if link is None:
            raise RingError(f"no link to the successor for {self.config.link_wait:.0f} s ({self.successor_state})")
        try:
            await link.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise RingError("the successor link was lost") from None

    def _boundary(self, request_id: int, pos: int, hidden: Any, *, final: bool, latest_token: int = -1) -> Boundary:
        hello = self._succ_hello
        dtype = choose_dtype(self.config.boundary_dtype, hello) if hello else BoundaryDType.F32
        try:
            return Boundary.from_array(request_id, pos, hidden, dtype=dtype, final=final, latest_token=latest_token)
        except ProtocolError:  # a value beyond f16's range (gemma's BOS row reaches 8e4): send this one exact
            return Boundary.from_array(request_id, pos, hidden, final=final, latest_token=latest_token)

    def _forwards(self, origin_rank: int) -> bool:
        """Whether a ring-circling frame from ``origin_rank`` goes on to our successor."""
        return (self.rank + 1) % self.manifest.size != origin_rank

    # ------------------------------------------------------------------------------------------ frames

    async def _reap_stale(self) -> None:
        """Free requests nothing has happened to for ``stall_timeout + link_wait``.

        The entry node gives up on a stalled request after ``stall_timeout`` and sends CANCEL; a node that never
        hears it (its entry died, a link stayed down) would otherwise keep the request's sequence forever.
        """
        limit = self.config.stall_timeout + self.config.link_wait
        while True:
            await trio.sleep(max(0.05, limit / 4))
            now = time.monotonic()
            for state in list(self._requests.values()):
                if not state.done and now - state.touched > limit:
                    log.warning(
                        "rank %d: request %x made no progress for %.0f s; freeing it",
                        self.rank,
                        state.request_id,
                        limit,
                    )
                    await self._finish(
                        state, "error", f"no progress for {limit:.0f} s at rank {self.rank}", ErrorCode.STAGE_FAILED
                    )

    async def _on_frame(self, frame: Frame) -> None:
        live = self._requests.get(frame.request_id)
        if live is not None:
            live.touched = time.monotonic()
        try:
            match frame:
                case Boundary() | Token() | End() if frame.latest_token >= self.stage.vocab.n_tokens:
                    # Never let it reach llama.cpp: a token id outside the vocabulary aborts the process there.
                    state = self._requests.get(frame.request_id)
                    if state is not None:
                        message = f"token {frame.latest_token} outside the vocabulary of {self.stage.vocab.n_tokens}"
                        await self._originate_error(state, ErrorCode.BAD_REQUEST, message)
                case StartRequest():
                    await self._on_start(frame)
                case Boundary():
                    await self._on_boundary(frame)
                case Token():
                    await self._on_token(frame)
                case End():
                    await self._on_end(frame)
                case Cancel():
                    await self._on_cancel(frame)
                case Error():
                    await self._on_error(frame)
                case Hello():
                    raise ProtocolError("HELLO after the handshake")
        except RingError as exc:  # e.g. no successor link for link_wait: the request cannot go on from here
            log.warning("rank %d: %s", self.rank, exc)
            state = self._requests.get(frame.request_id)
            if state is not None:
                await self._finish(state, "error", str(exc), ErrorCode.STAGE_FAILED)

    async def _on_start(self, start: StartRequest) -> None:
        if start.entry_node_id == self.config.node_id:
            return  # our own START came back around the ring
        try:
            state = self._register(start, entry=None)
        except KvasirError as exc:
            code = ErrorCode.OVERLOADED if "sequence" in str(exc) else ErrorCode.BAD_REQUEST
            await self._send(Error.truncating(code, str(exc), self.rank, start.request_id))
            return
        if self._forwards(start.entry_rank):
            await self._send(start)
        if self.first:
            self._spawn_prefill(state)

    def _register(self, start: StartRequest, entry: EntryStream | None) -> RequestState:
        if start.request_id in self._requests:
            raise RingError(f"request {start.request_id:x} is already in flight")
        cfg = self.stage.config
        if len(start.prompt) + start.max_tokens > cfg.n_ctx:
            raise InputError(
                f"prompt ({len(start.prompt)}) + max_tokens ({start.max_tokens}) exceed the context of {cfg.n_ctx}"
            )
        if self.first or self.last:
            self.stage.vocab.check_tokens(start.prompt)
        seq = self._seqs.take()
        if seq is None:
            raise RingError(f"rank {self.rank} has no free sequence (all {cfg.n_seq_max} in use)")
        state = RequestState(start=start, seq=seq, entry=entry)
        if self.last:
            state.sampler = self.stage.new_sampler(start.sampling)
            for t in start.prompt:
                state.sampler.accept(t)
            state.text_stream = TextStream(self.stage.vocab)
        self._requests[start.request_id] = state
        self.counters["requests"] += 1
        self.hub.publish(
            {
                "type": "request",
                "state": "start",
                "request": start.request_id,
                "prompt_tokens": len(start.prompt),
                "entry_rank": start.entry_rank,
            }
        )
        return state

    def _spawn_prefill(self, state: RequestState) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._prefill, state)

    async def _prefill(self, state: RequestState) -> None:
        prompt = list(state.start.prompt)
        chunk = max(1, min(self.config.prefill_chunk, self.stage.config.n_batch))
        try:
            for i in range(0, len(prompt), chunk):
                hidden = await self._compute(state, i, tokens=prompt[i : i + chunk])
                if hidden is None:
                    return
                final = i + chunk >= len(prompt)
                state.touched = time.monotonic()
                await self._send(self._boundary(state.request_id, i, hidden, final=final))
        except KvasirError as exc:
            await self._originate_error(state, ErrorCode.STAGE_FAILED, str(exc))

    async def _compute(self, state: RequestState, pos: int, **inputs: Any) -> Any:
        """Run the stage on one chunk of a request; None if the request ended meanwhile."""
        async with state.lock:
            if state.done:
                return None
            return await self.stage.run(functools.partial(self.stage.forward, state.seq, pos, **inputs))

    async def _on_boundary(self, frame: Boundary) -> None:
        self.counters["boundaries"] += 1
        state = self._requests.get(frame.request_id)
        if state is None or state.done:
            return  # finished or cancelled while this frame was in flight
        if frame.first_position >= state.prompt_len and frame.latest_token >= 0:
            self._see(state, frame.first_position - state.prompt_len, frame.latest_token)
        try:
            if not self.last:
                hidden = await self._compute(state, frame.first_position, hidden=frame.to_array())
                if hidden is not None:
                    await self._send(
                        self._boundary(
                            frame.request_id,
                            frame.first_position,
                            hidden,
                            final=frame.final,
                            latest_token=frame.latest_token,
                        )
                    )
                return
            token = await self._compute_and_sample(state, frame)
        except KvasirError as exc:
            await self._originate_error(state, ErrorCode.STAGE_FAILED, str(exc))
            return
        if token is not None:
            await self._after_sample(state, token)

    async def _compute_and_sample(self, state: RequestState, frame: Boundary) -> int | None:
        """Last rank: run the window and, on a final boundary, sample — one worker-thread round trip for both."""
        sampler = state.sampler
        assert sampler is not None
        hidden = frame.to_array()

        def forward_and_sample() -> int | None:
            self.stage.forward(state.seq, frame.first_position, hidden=hidden)
            return self.stage.sample(sampler) if frame.final else None

        async with state.lock:
            if state.done:
                return None
            return await self.stage.run(forward_and_sample)

    async def _after_sample(self, state: RequestState, token: int) -> None:
        if state.done:
            return  # cancelled or failed while its sample was computed: the token belongs to nobody now
        start = state.start
        if self.stage.vocab.is_eog(token):
            await self._end(state, EndReason.EOG, latest=-1)
            return
        state.generated += 1
        index = state.generated - 1
        self._see(state, index, token)
        assert state.text_stream is not None
        state.text += state.text_stream.push(token)
        if find_stop(state.text, start.stop) is not None:
            await self._end(state, EndReason.STOP, latest=token)
        elif state.generated >= start.max_tokens:
            await self._end(state, EndReason.MAX_TOKENS, latest=token)
        else:
            await self._send(Token(start.request_id, state.prompt_len + index, token))

    async def _on_token(self, frame: Token) -> None:
        state = self._requests.get(frame.request_id)
        if state is None or state.done:
            return
        self._see(state, frame.position - state.prompt_len, frame.token_id)
        try:
            hidden = await self._compute(state, frame.position, tokens=[frame.token_id])
            if hidden is not None:
                await self._send(
                    self._boundary(frame.request_id, frame.position, hidden, final=True, latest_token=frame.token_id)
                )
        except KvasirError as exc:
            await self._originate_error(state, ErrorCode.STAGE_FAILED, str(exc))

    async def _on_end(self, frame: End) -> None:
        state = self._requests.get(frame.request_id)
        if state is not None:
            if frame.latest_token >= 0 and frame.generated_tokens > state.seen:
                self._see(state, frame.generated_tokens - 1, frame.latest_token)
            await self._finish(state, REASONS[frame.reason])
        if self._forwards(frame.origin_rank):
            await self._send(frame)

    async def _on_cancel(self, frame: Cancel) -> None:
        state = self._requests.get(frame.request_id)
        if state is not None:
            await self._finish(state, "cancelled")
        if self._forwards(frame.origin_rank):
            await self._send(frame)

    async def _on_error(self, frame: Error) -> None:
        if frame.request_id == 0:
            log.warning("rank %d: predecessor reports: %s", self.rank, frame.message)
            return
        state = self._requests.get(frame.request_id)
        if state is not None:
            await self._finish(state, "error", frame.message, frame.code)
        if self._forwards(frame.origin_rank):
            await self._send(frame)

    # ------------------------------------------------------------------------------------------ endings

    async def _end(self, state: RequestState, reason: EndReason, latest: int) -> None:
        frame = End(state.request_id, reason, state.prompt_len, state.generated, self.rank, latest)
        await self._finish(state, REASONS[reason])
        await self._send(frame)

    async def _originate_error(self, state: RequestState, code: ErrorCode, message: str) -> None:
        self.counters["errors"] += 1
        await self._finish(state, "error", message, code)
        try:
            await self._send(Error.truncating(code, message, self.rank, state.request_id))
        except RingError as exc:
            log.warning("rank %d: could not report an error for request %x: %s", self.rank, state.request_id, exc)

    async def _finish(
        self, state: RequestState, reason: str, error: str | None = None, code: ErrorCode | None = None
    ) -> None:
        if state.done:
            return
        state.done = True
        self._requests.pop(state.request_id, None)
        try:
            # Wait out a compute of this request before its sequence is reused. Shielded: a caller that gives up
            # (a client's cancel with a deadline, a shutdown) must not leak the sequence; the wait is one compute.
            with trio.CancelScope(shield=True):
                async with state.lock:
                    await self.stage.run(self.stage.free_sequence, state.seq)
                    self._seqs.give(state.seq)
                    if state.sampler is not None:
                        state.sampler.close()
                        state.sampler = None
        finally:
            # Only now tell the client: once it leaves, its admission slot lets the next request in, which must
            # find this sequence free.
            if state.entry is not None:
                state.entry.finish(reason, state.prompt_len, state.seen, error, code.name.lower() if code else None)
        self.hub.publish(
            {
                "type": "request",
                "state": "end",
                "request": state.request_id,
                "reason": reason,
                "generated": state.seen,
                "error": error,
            }
        )

    def _see(self, state: RequestState, index: int, token: int) -> None:
        """A token of ``state`` passes this node; each index is handled once."""
        if index != state.seen:
            return
        state.seen += 1
        self.counters["tokens"] += 1
        self.contribution_tokens += 1
        if state.entry is not None:
            state.entry.push(index, token)
        self.hub.publish(
            {
                "type": "token",
                "request": state.request_id,
                "index": index,
                "token": token,
                "text": self.stage.vocab.piece(token).decode("utf-8", "replace"),
            }
        )

    # ------------------------------------------------------------------------------------------ clients

    @asynccontextmanager
    async def request(
        self, prompt: Sequence[int], params: SamplingParams, max_tokens: int, stop: Sequence[str] = ()
    ) -> AsyncIterator[RequestHandle]:
        """Submit a request at this node; iterate ``handle.events``. Leaving early cancels it."""
        if not prompt:
            raise InputError("empty prompt")
        if max_tokens < 1:
            raise InputError("max_tokens must be at least 1")
        try:
            start = StartRequest(
                request_id=secrets.randbits(63) | 1,
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                entry_rank=self.rank,
                entry_node_id=self.config.node_id,
                sampling=params,
                stop=tuple(stop),
            )
        except ProtocolError as exc:  # beyond a wire limit (prompt length, stop strings…): the client's input
            raise InputError(str(exc).replace("START frame: ", "")) from None
        entry = EntryStream(TextStream(self.stage.vocab), stop, max_tokens)
        async with self._admission:
            state = self._register(start, entry)
            handle = RequestHandle(start.request_id, len(prompt), entry.receive)
            try:
                await self._send(start)
                if self.first:
                    self._spawn_prefill(state)
                yield handle
            except RingError as exc:
                await self._finish(state, "error", str(exc))
                raise
            finally:
                if not state.done:
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await self.cancel(state.request_id)

    async def cancel(self, request_id: int) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return

        async def tell_ring() -> None:
            try:
                await self._send(Cancel(request_id, self.rank))
            except RingError as exc:
                log.warning("rank %d: cancel of %x not sent: %s", self.rank, request_id, exc)

        # Both at once: freeing here waits out a compute of the request, which must not hold back (or, under a
        # caller's deadline, cost) the other nodes' CANCEL; a missing link must not hold back the client's end.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tell_ring)
            await self._finish(state, "cancelled")

    async def events(self, handle: RequestHandle) -> AsyncGenerator[ClientEvent, None]:
        """The request's events; a ring that makes no progress for ``stall_timeout`` ends it with an error."""
        while True:
            with trio.move_on_after(self.config.stall_timeout) as scope:
                try:
                    event = await handle.events.receive()
                except trio.EndOfChannel:
                    return
            if scope.cancelled_caught:
                await self.cancel(handle.request_id)
                yield EndEvent("error", handle.prompt_tokens, 0, error="the ring made no progress (stalled)")
                return
            yield event
            if isinstance(event, EndEvent):
                return

    # ------------------------------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        info = self.stage.info
        return {
            "node_id": self.config.node_id,
            "rank": self.rank,
            "ring_size": self.manifest.size,
            "model": {
                "name": self.manifest.model_name,
                "sha256": self.manifest.model_sha256,
                "layers": self.manifest.n_layers,
            },
            "window": [info.start, info.end],
            "backend": info.backend,
            "threads": info.n_threads,
            "busy_s": round(self.stage.busy_s, 4),
            "ready": self.ready,
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "ranks": [
                {"rank": r.rank, "layers": [r.start, r.end], "address": r.address, "link": r.link}
                for r in self.manifest.ranks
            ],
            "links": {
                "predecessor": {"state": self.predecessor_state, **(self._pred.stats.to_json() if self._pred else {})},
                "successor": {"state": self.successor_state, **(self._succ.stats.to_json() if self._succ else {})},
            },
            "requests": {"in_flight": len(self._requests), "free_sequences": self._seqs.free, **self.counters},
            "contribution": {
                "tokens": self.contribution_tokens,
                "layer_tokens": self.contribution_tokens * (info.end - info.start),
            },
            "memory": _memory(),
            "market": self.market_view,
        }


def _memory() -> dict[str, int]:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return {"rss_bytes": int(line.split()[1]) * 1024}
    except OSError:
        pass
    import resource

    return {"rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
