"""A ring node: one stage, its two links, and the request flow between them.

Data path (docs/architecture.md): a request enters at any node, START travels once around the ring, rank 0
prefills in chunks and sends boundaries on, each rank runs its window and passes the boundary on, the last rank
samples and sends the TOKEN to rank 0, which embeds it for the next step. Every frame carries the request's latest
token, so every node sees the stream pass; the entry node streams it to its client. END, CANCEL and ERROR travel
the ring once from their origin so every node frees the request's sequence.

The node is thin: :class:`~kvasir.ring.linkmgr.LinkManager` keeps the links (frames from the predecessor arrive here
one at a time in arrival order: a busy node stops reading, TCP fills, its predecessor waits: that is the
backpressure), :class:`~kvasir.ring.requests.RequestTable` keeps the requests, and the node dispatches frames and runs
compute in a worker thread. ``async with open_node(config, stage) as node:`` runs it and shuts it down.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import random
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from kvasir.core.identity import Identity
from kvasir.core.sampling import MAX_SEED
from kvasir.core.schedule import PREFILL_CHUNK
from kvasir.core.speculate import Drafter, DraftPolicy, RowSampler
from kvasir.core.stops import find_stop
from kvasir.errors import InputError, InvalidRequest, KvasirError, ProtocolError, RequestRefused, RingError
from kvasir.ring.batching import DecodeBatcher, DecodeStep, batchable, compute_batch
from kvasir.ring.compute import RingStage
from kvasir.ring.edges import RelayConnect, RingEdges
from kvasir.ring.events import EventHub, FailedOver
from kvasir.ring.linkmgr import LinkManager, SuccessorLost, Transport
from kvasir.ring.manifest import Manifest
from kvasir.ring.record import NodeRecorder
from kvasir.ring.requests import (
    REASONS,
    ClientEvent,
    EndEvent,
    EntryStream,
    RequestState,
    RequestTable,
    start_needs_tokens,
    uses_penalties,
)
from kvasir.ring.secure import Credentials, PeerPolicy
from kvasir.ring.speculation import RingPace, RowFate, VerifyBatch, row_fate, window_step
from kvasir.ring.status import FailoverStatus, MarketWindow, NodeStatus, RankStatus, RequestCounters
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
    SamplingParams,
    Side,
    StartRequest,
    Token,
    choose_dtype,
)

log = logging.getLogger("kvasir.node")

#: After giving up on its successor, how long a node waits for the error that comes round the ring before failing a
#: request on its own (the node after the break sends it; this covers a ring broken in two places).
LINK_LOST_GRACE_S = 5.0
#: Ring-circling frames (END, CANCEL, ERROR) a node keeps to replay to a successor that comes back: one of them may
#: have died with the old holder, and the nodes behind it would wait for it until their stall timers.
TERMINAL_MEMORY = 1024

#: What a node shows of the market it enrolled through (None: started from a manifest).
MarketView = Callable[[], Sequence[MarketWindow] | None]


@attrs.frozen
class NodeConfig:
    manifest: Manifest
    rank: int
    node_id: str = attrs.field(factory=lambda: secrets.token_hex(6))
    #: This node's key pair. Required when the manifest names the ranks' keys: links then run protocol v2
    #: (authenticated by those keys, encrypted); the node id is then the key's fingerprint.
    identity: Identity | None = None
    #: Market rings: who else may neighbour this node (a market ticket check), asked at each handshake; with it the
    #: links run protocol v2 even before every rank's key is known.
    peer_policy: Callable[[], PeerPolicy | None] | None = None
    #: Market rings: this node's current window ticket, presented when it dials its successor.
    ticket: Callable[[], bytes] | None = None
    #: Prompt tokens per prefill boundary: smaller chunks let stages overlap sooner. Keep it equal to the reference's
    #: (``kvasir generate``) for bit-identical results: llama.cpp's numbers depend on the batching.
    prefill_chunk: int = PREFILL_CHUNK
    #: How long a frame waits for a missing successor link before its request fails (at least ``failover_wait``).
    link_wait: float = 30.0
    #: How long a node whose neighbour's link broke keeps the requests in flight for that window to come back (the
    #: same node relinking, ``ring up`` restarting it, a standby, a market claimant): it then replays them into it.
    #: Past this the requests fail with LINK_LOST on every node.
    failover_wait: float = 15.0
    #: A request with no progress for this long is failed at its entry node.
    stall_timeout: float = 120.0
    keepalive_interval: float = 1.0
    #: A link that brings nothing (not even a keepalive) for this long is dropped; None: 3 keepalive intervals.
    idle_timeout: float | None = None
    #: Send both links through this relay (``ws://`` or ``wss://``), whatever the manifest says.
    relay: str | None = None
    #: Opens relay edges (``relay.ringlink.relay_connector``); needed only when a link is relayed.
    relay_connect: RelayConnect | None = None
    #: Boundary encoding this node sends when its successor accepts it (f32 is bit-exact; f16/bf16 halve the bytes).
    boundary_dtype: BoundaryDType = BoundaryDType.F32
    #: A standby (``Manifest.as_standby``): dormant, linked to nothing until a predecessor fails over to it.
    standby: bool = False
    #: Speculative decoding for requests entering here that do not say: up to K prompt-lookup drafts per step
    #: (0: plain one-token steps). The request's START carries its K; the last rank drafts (docs/speculation.md).
    speculate: int = 0
    #: How the last rank drafts: eagerly on a latency-bound ring ("auto"), or always one way (docs/speculation.md).
    draft_policy: DraftPolicy = "auto"
    #: Batched decode (kvasir.ring.batching): up to this many requests' decode steps in one llama_decode. 1 (the
    #: default) keeps one sequence per decode, bit-exact against ``generate``; more trades exactness for throughput.
    batch: int = 1


@attrs.define
class RequestHandle:
    request_id: int
    prompt_tokens: int
    events: trio.MemoryReceiveChannel[ClientEvent]


@asynccontextmanager
async def open_node(
    config: NodeConfig,
    stage: RingStage,
    *,
    market_view: MarketView | None = None,
    transport: Transport | None = None,
    rng: random.Random | None = None,
    recorder: NodeRecorder | None = None,
) -> AsyncIterator[Node]:
    """Run a node: its links (listening once this returns: ``node.port``), its reaper and its requests' compute.

    Leaving the block fails every request still in flight with an error reply (SHUTTING_DOWN), then stops.
    ``transport`` replaces TCP for direct links (fast tests); ``rng`` draws the redial jitter; ``recorder`` writes
    the node's signed receipts (kvasir.ring.record).
    """
    credentials = _credentials(config, config.manifest)  # before the nursery: a bad key is one plain InputError
    async with trio.open_nursery() as nursery:
        node = Node(
            config, stage, nursery, market_view=market_view, transport=transport, rng=rng, credentials=credentials
        )
        node.recorder = recorder
        if recorder is not None:
            node.requests.on_end.add(lambda ended: node._record_end(ended.request))
        await nursery.start(node.links.run)
        nursery.start_soon(node.requests.reap, config.stall_timeout + config.link_wait)
        if node.batcher is not None:
            nursery.start_soon(node.batcher.run)
        log.info("rank %d up (port %d), layers %d:%d", node.rank, node.port, stage.info.start, stage.info.end)
        try:
            yield node
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await node.shutdown()
            nursery.cancel_scope.cancel()


class Node:
    """Use :func:`open_node`; the nursery runs the node's prefill tasks."""

    def __init__(
        self,
        config: NodeConfig,
        stage: RingStage,
        nursery: trio.Nursery,
        *,
        market_view: MarketView | None = None,
        transport: Transport | None = None,
        rng: random.Random | None = None,
        credentials: Credentials | None = None,
    ) -> None:
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
        if credentials is not None:
            config = attrs.evolve(config, node_id=credentials.identity.node_id)
        self.config = config
        self.manifest = m
        self.rank = config.rank
        self.stage = stage
        self.first = info.first
        self.last = info.last
        self.hub = EventHub()
        self._nursery = nursery
        self._market_view = market_view
        self.started_at = trio.current_time()
        #: Seconds in link sends of data frames (status: where a step's time goes, docs/benchmarks.md).
        self.send_s = 0.0
        self.requests = RequestTable(stage, self.hub, config.rank)
        self.recorder: NodeRecorder | None = None
        self.failover = FailoverStatus()
        self.batcher = DecodeBatcher(config.batch, self._decode_batch) if config.batch > 1 else None
        self._terminal: deque[tuple[float, Frame]] = deque(maxlen=TERMINAL_MEMORY)
        self._pace = RingPace()  # last rank: the ring's pace, for the drafting policy
        #: Link generations: a failover timer acts only if no newer link came (and went) since it started.
        self._pred_gen = self._succ_gen = 0
        self._succ_lost_at: float | None = None
        self._closing = False  # shutting down: no new request
        self.links = LinkManager(
            hello=Hello(
                node_id=config.node_id,
                model_id=m.model_sha256,
                rank=config.rank,
                ring_size=m.size,
                window_start=me.start,
                window_end=me.end,
                n_layers=m.n_layers,
                n_embd=info.n_embd,
                dtypes=frozenset(BoundaryDType),
            ),
            edges=RingEdges.for_node(m, config.rank, config.relay, config.relay_connect),
            manifest=lambda: self.manifest,
            on_frame=self._on_frame,
            on_link_error=self._count_error,
            on_link_lost=self._link_lost,
            on_successor_up=self._replay,
            keepalive_interval=config.keepalive_interval,
            idle_timeout=config.idle_timeout,
            link_wait=config.link_wait,
            transport=transport,
            rng=rng,
            credentials=credentials,
            peer_policy=config.peer_policy,
            ticket=config.ticket,
            dormant=config.standby,
        )

    @property
    def port(self) -> int:
        """The predecessor listener's port (0 when the predecessor is relayed)."""
        return self.links.port

    @property
    def ready(self) -> bool:
        return self.links.ready

    def update_manifest(self, manifest: Manifest) -> None:
        """Take a newer manifest of the same ring (a self-enrolled node rebuilds it from the market's coverage map).

        Ranks and windows stay; addresses may change. When the successor's address changes, its link is dropped so
        the dial loop reaches the new holder.
        """
        if manifest.size != self.manifest.size or manifest.model_sha256 != self.manifest.model_sha256:
            raise InputError("a manifest update must keep the ring's model and size")
        old = self.manifest.successor(self.rank)
        self.manifest = manifest
        if manifest.successor(self.rank).address != old.address:
            self.links.redial_successor()

    async def shutdown(self) -> None:
        """Refuse new requests, fail every in-flight one with an error reply (not silence); ``open_node`` calls it on
        the way out."""
        self._closing = True
        for state in self.requests:
            if state.done:
                continue
            with trio.move_on_after(1):
                await self._originate_error(state, ErrorCode.SHUTTING_DOWN, f"node rank {self.rank} is shutting down")

    async def _link_lost(self, side: Side) -> None:
        """A live link ended, and frames in transit on it with it. The requests in flight stay: the window behind the
        break is expected back (the same node relinking, a restart, a standby, a claimant), and its predecessor then
        replays them into it (:meth:`_replay`). Only if it stays away for ``failover_wait`` do they fail, on every
        node: the node after the break sends LINK_LOST round the ring to the node before it."""
        in_flight = sum(1 for state in self.requests if not state.done)
        log.warning(
            "rank %d lost its %s link; holding %d request(s) up to %.0f s for the window to come back",
            self.rank, side.value, in_flight, self.config.failover_wait,
        )  # fmt: skip
        if side is Side.PREDECESSOR:
            self._pred_gen += 1
            self._nursery.start_soon(self._fail_if_predecessor_stays_away, self._pred_gen)
        else:
            self._succ_gen += 1
            self._succ_lost_at = trio.current_time()
            for state in list(self.requests):
                if not state.done:
                    self._nursery.start_soon(self._fail_if_successor_stays_away, state, self._succ_gen)

    async def _fail_if_predecessor_stays_away(self, generation: int) -> None:
        await trio.sleep(self.config.failover_wait)
        if generation != self._pred_gen or self.links.predecessor is not None or self.links.dormant:
            return  # dormant: another holder of this window carries its requests on
        message = f"rank {self.rank} lost its predecessor link for {self.config.failover_wait:.0f} s"
        for state in list(self.requests):
            if not state.done:
                with trio.move_on_after(2):
                    await self._originate_error(state, ErrorCode.LINK_LOST, message)

    async def _fail_if_successor_stays_away(self, state: RequestState, generation: int) -> None:
        # Nothing can be sent forward; the node after the break reports the loss round the ring to us (and a leaving
        # successor's own SHUTTING_DOWN comes round too, saying why): wait for those first.
        await trio.sleep(self.config.failover_wait + LINK_LOST_GRACE_S)
        if state.done or generation != self._succ_gen or self.links.successor is not None or self.links.dormant:
            return
        self.requests.errors += 1
        message = f"rank {self.rank} lost its successor link"
        await self.requests.finish(state, "error", message, ErrorCode.LINK_LOST)

    async def _replay(self, send: Callable[[Frame], Any], hello: Hello) -> None:
        """The successor link is (re)made: before anything else goes over it, resend every request in flight here
        as this node sent it (START, then each boundary or token with its original schedule), then the recent
        ring-circling frames. A new holder of the window rebuilds each request's state from them exactly; a holder
        that kept its state recognises what it has seen (checking it is identical) and drops it."""
        started = trio.current_time()
        self._succ_gen += 1  # the window is back: pending give-up timers are stale (a long replay must not trip them)
        successor = (self.rank + 1) % self.manifest.size
        horizon = started - (self.config.failover_wait + self.config.link_wait)
        states = [s for s in self.requests if not s.done and (s.sent or s.start.entry_rank == successor)]
        terminal = [frame for at, frame in self._terminal if at >= horizon]
        if not states and not terminal:
            self._succ_lost_at = None
            return
        frames = nbytes = 0
        for state in states:
            log_ = list(state.sent)
            if state.start.entry_rank == successor:
                # Its entry is the successor: if that node restarted, this START tells it the request's client is gone.
                log_.insert(0, state.start.withheld())
            for frame in log_:
                await send(frame)
                frames += 1
                nbytes += _frame_bytes(frame)
        for frame in terminal:
            await send(frame)
        done = trio.current_time()
        stall = None if self._succ_lost_at is None else round(done - self._succ_lost_at, 3)
        self._succ_lost_at = None
        f = self.failover
        self.failover = attrs.evolve(
            f,
            replays=f.replays + 1,
            requests=f.requests + len(states),
            frames=f.frames + frames,
            bytes=f.bytes + nbytes,
            last_stall_s=stall,
            last_window=(hello.window_start, hello.window_end),
        )
        log.info(
            "rank %d: replayed %d request(s), %d frame(s), %d bytes to rank %d (%s) in %.3f s; stalled %s s",
            self.rank, len(states), frames, nbytes, hello.rank, hello.node_id, done - started, stall,
        )  # fmt: skip
        self.hub.publish(
            FailedOver(hello.rank, (hello.window_start, hello.window_end), len(states), frames, nbytes, stall)
        )

    def _count_error(self) -> None:
        self.requests.errors += 1

    def _record_end(self, request_id: int) -> None:
        """The request ended here: sign and write its receipt off the event loop (it is answered already)."""
        assert self.recorder is not None
        record, recorder = self.recorder.end(request_id), self.recorder
        if record is None:
            return

        async def write() -> None:
            with trio.CancelScope(shield=True):  # a node shutting down still writes what it answered (milliseconds)
                await trio.to_thread.run_sync(recorder.write, record)

        try:
            self._nursery.start_soon(write)
        except RuntimeError:  # the node has stopped (a request ended in its teardown): write it here
            recorder.write(record)

    # ------------------------------------------------------------------------------------------ sending

    async def _send(self, frame: Frame) -> None:
        await self.links.send(frame)

    async def _send_data(self, state: RequestState, frame: Frame) -> None:
        """Send a request's START, boundary or token, keeping it in the request's replay log first."""
        if not state.done:
            if self.recorder is not None and isinstance(frame, Boundary):
                frame = self.recorder.seal(frame)  # committed, and stamped with the chain head (FLAG_CHAIN)
            state.sent.append(frame)
            state.sent_bytes += _frame_bytes(frame)
        if self._succ_lost_at is not None and self.links.successor_down and not isinstance(frame, StartRequest):
            # The successor link broke (which armed the give-up timer of every request then in flight): the frame
            # waits in the replay log for the window to come back, and this node goes on reading its predecessor,
            # where an END or ERROR for this very request may be next (waiting here would hold it up to link_wait).
            return
        t0 = time.perf_counter()
        try:
            await self.links.send(frame)
        except SuccessorLost:
            if state.done:
                raise
            # It is in the replay log: the successor that comes back gets it (or the request fails after the wait).
        finally:
            self.send_s += time.perf_counter() - t0

    async def _send_terminal(self, frame: End | Cancel | Error) -> None:
        """Send a ring-circling END, CANCEL or ERROR, remembered for a replay (it may die with the successor)."""
        self._terminal.append((trio.current_time(), frame))
        with contextlib.suppress(SuccessorLost):  # kept for the replay, as above
            await self.links.send(frame)

    def _boundary(
        self,
        request_id: int,
        pos: int,
        hidden: Any,
        *,
        final: bool,
        latest_token: int = -1,
        drafts: tuple[int, ...] = (),
        row: int = 0,
    ) -> Boundary:
        hello = self.links.successor_hello
        dtype = choose_dtype(self.config.boundary_dtype, hello) if hello else BoundaryDType.F32
        make = functools.partial(
            Boundary.from_array,
            request_id,
            pos,
            hidden,
            final=final,
            latest_token=latest_token,
            drafts=drafts,
            row=row,
        )
        try:
            return make(dtype=dtype)
        except ProtocolError:  # a value beyond f16's range (gemma's BOS row reaches 8e4): send this one exact
            return make()

    def _outgoing_start(self, start: StartRequest) -> StartRequest:
        """START as our successor gets it: the prompt's token ids only while a node ahead needs them."""
        successor = (self.rank + 1) % self.manifest.size
        # The last rank needs the prompt's ids for repeat penalties, and to draft from when the request speculates.
        penalties = uses_penalties(start.sampling) or start.speculate > 0
        if start_needs_tokens(successor, start.entry_rank, self.manifest.size, penalties=penalties):
            return start
        return start.withheld()

    def _forwards(self, origin_rank: int) -> bool:
        """Whether a ring-circling frame from ``origin_rank`` goes on to our successor."""
        return (self.rank + 1) % self.manifest.size != origin_rank

    # ------------------------------------------------------------------------------------------ frames

    async def _on_frame(self, frame: Frame) -> None:
        live = self.requests.get(frame.request_id)
        if live is not None:
            live.touched = trio.current_time()
        try:
            match frame:
                case Boundary() | Token() | End() if _top_token(frame) >= self.stage.vocab.n_tokens:
                    # Never let it reach llama.cpp: a token id outside the vocabulary aborts the process there.
                    state = self.requests.get(frame.request_id)
                    if state is not None:
                        message = f"token {_top_token(frame)} outside the vocabulary of {self.stage.vocab.n_tokens}"
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
            state = self.requests.get(frame.request_id)
            if state is not None:
                await self.requests.finish(state, "error", str(exc), ErrorCode.STAGE_FAILED)

    async def _on_start(self, start: StartRequest) -> None:
        known = self.requests.get(start.request_id) is not None or self.requests.ended(start.request_id)
        if start.entry_rank == self.rank:
            # A START reaches its entry rank only in a replay. Unknown here: this node restarted, and the client it
            # was streaming to went with the old process. Free the request round the ring.
            if not known:
                message = f"request {start.request_id:x} entered at rank {self.rank}, which restarted: its client left"
                await self._send_terminal(Error.truncating(ErrorCode.LINK_LOST, message, self.rank, start.request_id))
            return
        if known:  # a replay of a request this node has (or had): what it holds stands
            self.failover = attrs.evolve(self.failover, duplicates=self.failover.duplicates + 1)
            return
        if self.first and not start.prompt:  # rank 0 embeds the prompt: a sender withheld what it must not
            reason = "rank 0 got a START without the prompt's token ids"
            await self._send(Error.truncating(ErrorCode.BAD_REQUEST, reason, self.rank, start.request_id))
            return
        try:
            state = self._register(start, entry=None)
        except RequestRefused as exc:
            await self._send(Error.truncating(exc.code, str(exc), self.rank, start.request_id))
            return
        except KvasirError as exc:  # the stage could not set the request up (its sampler)
            await self._send(Error.truncating(ErrorCode.STAGE_FAILED, str(exc), self.rank, start.request_id))
            return
        if self._forwards(start.entry_rank):
            await self._send_data(state, self._outgoing_start(start))
        if self.first:
            self._spawn_prefill(state)

    def _register(self, start: StartRequest, entry: EntryStream | None) -> RequestState:
        sampler = None
        if self.last:
            if start.speculate and not start.prompt:  # drafts from anything less would not be generate's
                raise InvalidRequest(ErrorCode.BAD_REQUEST, "the last rank got a speculative START without its prompt")
            sampler = functools.partial(self.stage.new_sampler, start.sampling)
        state = self.requests.register(start, entry, check_vocab=self.first or self.last, sampler=sampler)
        if self.recorder is not None:
            self.recorder.begin(start.request_id, last=self.last, sampling=start.sampling, history=start.prompt)
        if self.last:
            state.text_stream = TextStream(self.stage.vocab)
            if start.speculate:
                state.drafter = Drafter.for_prompt(start.prompt, start.speculate)
        return state

    def _spawn_prefill(self, state: RequestState) -> None:
        self._nursery.start_soon(self._prefill, state)

    async def _prefill(self, state: RequestState) -> None:
        prompt = list(state.start.prompt)
        chunk = max(1, min(self.config.prefill_chunk, self.stage.config.n_batch))
        try:
            for i in range(0, len(prompt), chunk):
                if self.recorder is not None:
                    self.recorder.on_tokens(state.request_id, i, prompt[i : i + chunk])
                hidden = await self._compute(state, i, tokens=prompt[i : i + chunk])
                if hidden is None:
                    return
                final = i + chunk >= len(prompt)
                state.touched = trio.current_time()
                await self._send_data(state, self._boundary(state.request_id, i, hidden, final=final))
        except KvasirError as exc:
            await self._originate_error(state, ErrorCode.STAGE_FAILED, str(exc))
        finally:
            state.prefilled.set()

    async def _compute(self, state: RequestState, pos: int, **inputs: Any) -> Any:
        """Run the stage on one chunk of a request; None if the request ended meanwhile."""
        async with state.lock:
            if state.done:
                return None
            return await self.stage.run(self._window, state, pos, inputs)

    def _window(self, state: RequestState, pos: int, inputs: dict[str, Any]) -> Any:
        """Worker thread: one chunk of a request through this window (rolling back rejected drafts first)."""
        return window_step(self.stage, state.seq, state.cache, state.start.speculate > 0, pos, inputs)

    async def _on_boundary(self, frame: Boundary) -> None:
        self.requests.boundaries += 1
        state = self.requests.get(frame.request_id)
        if state is None or state.done:
            return  # finished or cancelled while this frame was in flight
        if await self._seen_before(state, (frame.first_position, frame.row), _boundary_digest(frame)):
            return
        # A decode step passes (a verify batch's rows after row 0 show nothing new).
        step = frame.first_position >= state.prompt_len and frame.latest_token >= 0 and frame.row == 0
        if step and state.step_sent_at is not None:  # last rank: the step it sent is back round
            self._pace.waits.append(trio.current_time() - state.step_sent_at)
            state.step_sent_at = None
        try:
            await self._boundary_step(state, frame)
        finally:
            # Seen (streamed to a client here, published) only once the step is on its way: that work is off the
            # ring's path to the successor (docs/benchmarks.md § The ring on loopback).
            if step:
                self.requests.see_step(state, frame.first_position, (frame.latest_token, *frame.drafts))

    async def _boundary_step(self, state: RequestState, frame: Boundary) -> None:
        if self.recorder is not None and (broken := self.recorder.take(frame)) is not None:
            log.error("request %x: rank %d: %s", state.request_id, self.rank, broken)
            await self._originate_error(state, ErrorCode.CHAIN_MISMATCH, f"rank {self.rank}: {broken}")
            return
        if await self._batched(state, frame):
            return
        try:
            if not self.last:
                hidden = await self._compute(state, frame.position, hidden=frame.to_array())
                if hidden is not None:
                    await self._send_data(
                        state,
                        self._boundary(
                            frame.request_id,
                            frame.first_position,
                            hidden,
                            final=frame.final,
                            latest_token=frame.latest_token,
                            drafts=frame.drafts,
                            row=frame.row,
                        ),
                    )
                return
            batch = self._verify_batch(state, frame) if frame.drafts else None
            if frame.drafts and batch is None:  # a stale row: behind a rejected draft, nothing to compute
                if self.recorder is not None:
                    self.recorder.on_skip(frame.request_id, frame.position, frame.n_tokens)
                return
            tokens = await self._compute_and_sample(state, frame, batch)
        except InvalidRequest as exc:
            await self._originate_error(state, exc.code, str(exc))
            return
        except KvasirError as exc:
            await self._originate_error(state, ErrorCode.STAGE_FAILED, str(exc))
            return
        if tokens is not None:
            await self._after_sample(state, tokens, len(frame.drafts), step=frame.first_position >= state.prompt_len)

    def _verify_batch(self, state: RequestState, frame: Boundary) -> VerifyBatch | None:
        """Last rank, a verify row arriving: the batch it extends (a new one at row 0); None when the row is stale
        (after a rejected draft: dropped uncomputed). InvalidRequest when it is out of order."""
        fate = row_fate(state.verifying, frame.first_position, frame.row)
        if fate is RowFate.START:
            assert state.sampler is not None
            sample = functools.partial(self.stage.sample, state.sampler)
            state.verifying = VerifyBatch(frame.first_position, RowSampler(sample, frame.drafts))
        elif fate is RowFate.UNEXPECTED:
            raise InvalidRequest(
                ErrorCode.BAD_REQUEST,
                f"verify row {frame.row} at position {frame.first_position} is not the next row of a batch here",
            )
        return None if fate is RowFate.STALE else state.verifying

    async def _compute_and_sample(
        self, state: RequestState, frame: Boundary, batch: VerifyBatch | None
    ) -> list[int] | None:
        """Last rank: run the window and, on a final boundary, sample (a verify row: sample it, and the batch's tokens
        once that row closes it) — one worker-thread round trip for both."""
        sampler = state.sampler
        assert sampler is not None
        inputs = {"hidden": frame.to_array()}

        recorder = self.recorder if self.recorder is not None and self.recorder.records(frame.request_id) else None

        def forward_and_sample() -> list[int] | None:
            self._window(state, frame.position, inputs)
            if not frame.final:
                tokens = None
            elif batch is not None:
                tokens = batch.sample(frame.row)
            else:
                tokens = [self.stage.sample(sampler)]
            if recorder is not None:  # hashes the logits row (1 MiB on a 262k vocabulary) here, off the event loop
                logits = self.stage.logits().tobytes()
                if batch is not None:  # a verify row: its own token (the batch's tokens come once it closes)
                    token: int | None = batch.rows.tokens[frame.row]
                else:
                    token = tokens[0] if tokens else None
                recorder.on_sample(frame.request_id, frame.position, frame.n_tokens, logits, token)
            return tokens

        async with state.lock:
            if state.done:
                return None
            t0 = trio.current_time()
            tokens = await self.stage.run(forward_and_sample)
            if state.drafter is not None and frame.first_position >= state.prompt_len:
                self._pace.rows.append(trio.current_time() - t0)
            return tokens

    async def _after_sample(self, state: RequestState, tokens: Sequence[int], drafted: int, *, step: bool) -> None:
        """Last rank: emit a step's sampled tokens (one, or a verify batch's accepted drafts and one more) in
        ``generate``'s order, then send the next step to rank 0, with drafts when the request speculates."""
        if state.done:
            return  # cancelled or failed while its sample was computed: the tokens belong to nobody now
        start = state.start
        assert state.text_stream is not None
        if state.drafter is not None and step:  # a decode step (the prefill's sample is no step: as in generate)
            state.drafter.verified(drafted, len(tokens) - 1, tokens[0])
            self.requests.speculation = self.requests.speculation.after(
                drafted, len(tokens) - 1, eager=state.drafter.eager
            )
        first = state.generated

        def see() -> None:  # streamed and published once the step is on its way (as in _on_boundary)
            for index in range(first, state.generated):
                self.requests.see(state, index, tokens[index - first])

        for token in tokens:
            if self.stage.vocab.is_eog(token):
                see()
                await self._end(state, EndReason.EOG, latest=-1)
                return
            state.generated += 1
            state.text += state.text_stream.push(token)
            if state.drafter is not None:
                state.drafter.emitted(token)
            if find_stop(state.text, start.stop) is not None:
                see()
                await self._end(state, EndReason.STOP, latest=token)
                return
            if state.generated >= start.max_tokens:
                see()
                await self._end(state, EndReason.MAX_TOKENS, latest=token)
                return
        drafts: list[int] = []
        if state.drafter is not None:
            eager = self._pace.eager(self.config.draft_policy, state.drafter.k_max)
            drafts = state.drafter.drafts(start.max_tokens - state.generated, eager=eager)
        position = state.prompt_len + state.generated - 1
        try:
            await self._send_data(state, Token(start.request_id, position, tokens[-1], tuple(drafts)))
            if state.drafter is not None:
                state.step_sent_at = trio.current_time()
        finally:
            see()

    async def _on_token(self, frame: Token) -> None:
        state = self.requests.get(frame.request_id)
        if state is None or state.done:
            return
        await state.prefilled.wait()  # a replay into a rebuilt rank 0 brings the tokens while it still prefills
        fed = (frame.token_id, *frame.drafts)
        if await self._seen_before(state, (frame.position, 0), b"".join(t.to_bytes(4, "little") for t in fed)):
            return
        if self.recorder is not None:
            for row, token in enumerate(fed):  # each row of a verify batch is a step of its own
                self.recorder.on_tokens(state.request_id, frame.position + row, [token])
        try:
            if await self._batched(state, frame):
                return
            # A verify batch goes on row by row, each row as soon as it is computed: the next window starts on it
            # while this one computes the next (docs/speculation.md).
            for row, token in enumerate(fed):
                hidden = await self._compute(state, frame.position + row, tokens=[token])
                if hidden is None:
                    return
                boundary = self._boundary(
                    frame.request_id, frame.position, hidden, final=True, latest_token=frame.token_id,
                    drafts=frame.drafts, row=row,
                )  # fmt: skip
                await self._send_data(state, boundary)
        except KvasirError as exc:
            await self._originate_error(state, ErrorCode.STAGE_FAILED, str(exc))
        finally:
            self.requests.see_step(state, frame.position, fed)  # after the send, as in _on_boundary

    async def _batched(self, state: RequestState, frame: Token | Boundary) -> bool:
        """Batching on and a plain decode step: queue it for the batcher (returns at once, so the next frame is read
        while it waits) and say so. Other frames of a request wait for its queued step: its frames stay in order."""
        if self.batcher is None:
            return False
        recorded = self.recorder is not None and self.recorder.records(state.request_id)
        if not batchable(state, frame, recorded=recorded):
            await self.batcher.idle(state)
            return False
        await self.batcher.submit(DecodeStep(state, frame))
        return True

    async def _decode_batch(self, steps: list[DecodeStep]) -> None:
        """The batcher's compute: the steps in one worker-thread call (each request's lock held, as ``_compute``
        holds it), then each request's next frame exactly as an unbatched step sends it."""
        outs: list[Any] = []
        error: KvasirError | None = None
        async with contextlib.AsyncExitStack() as locks:
            for step in steps:
                await locks.enter_async_context(step.state.lock)
            live = [step for step in steps if not step.state.done]
            try:
                outs = await self.stage.run(compute_batch, self.stage, live) if live else []
            except KvasirError as exc:
                error = exc
        for i, step in enumerate(live):
            state, frame = step.state, step.frame
            try:
                if error is not None:
                    await self._originate_error(state, ErrorCode.STAGE_FAILED, str(error))
                elif self.last:
                    await self._after_sample(state, [outs[i]], 0, step=True)
                else:
                    latest = frame.token_id if isinstance(frame, Token) else frame.latest_token
                    await self._send_data(
                        state, self._boundary(state.request_id, step.pos, outs[i], final=True, latest_token=latest)
                    )
            except RingError as exc:  # as _on_frame: the request cannot go on from here
                log.warning("rank %d: %s", self.rank, exc)
                await self.requests.finish(state, "error", str(exc), ErrorCode.STAGE_FAILED)
            except KvasirError as exc:
                await self._originate_error(state, ErrorCode.STAGE_FAILED, str(exc))

    async def _seen_before(self, state: RequestState, key: tuple[int, int], digest: bytes) -> bool:
        """Whether a frame for ``key`` (its position, and its row in a verify batch) of ``state`` arrived before (a
        replay): then it must be identical (else the request fails with REPLAY_MISMATCH: a replay never silently
        diverges) and is dropped."""
        position = key[0] + key[1]
        previous = state.received.get(key)
        if previous is None:
            state.received[key] = digest
            return False
        if previous == digest:
            self.failover = attrs.evolve(self.failover, duplicates=self.failover.duplicates + 1)
        else:
            message = f"rank {self.rank}: a replayed frame at position {position} differs from the one received before"
            log.error("request %x: %s", state.request_id, message)
            await self._originate_error(state, ErrorCode.REPLAY_MISMATCH, message)
        return True

    async def _on_end(self, frame: End) -> None:
        state = self.requests.get(frame.request_id)
        if state is not None:
            self.requests.see_end(state, frame.generated_tokens, frame.latest_token)
            await self.requests.finish(state, REASONS[frame.reason])
        if self._forwards(frame.origin_rank):
            await self._send_terminal(frame)

    async def _on_cancel(self, frame: Cancel) -> None:
        state = self.requests.get(frame.request_id)
        if state is not None:
            await self.requests.finish(state, "cancelled")
        if self._forwards(frame.origin_rank):
            await self._send_terminal(frame)

    async def _on_error(self, frame: Error) -> None:
        if frame.request_id == 0:
            log.warning("rank %d: predecessor reports: %s", self.rank, frame.message)
            return
        state = self.requests.get(frame.request_id)
        if state is not None:
            await self.requests.finish(state, "error", frame.message, frame.code)
        if self._forwards(frame.origin_rank):
            await self._send_terminal(frame)

    # ------------------------------------------------------------------------------------------ endings

    async def _end(self, state: RequestState, reason: EndReason, latest: int) -> None:
        frame = End(state.request_id, reason, state.prompt_len, state.generated, self.rank, latest)
        await self.requests.finish(state, REASONS[reason])
        await self._send_terminal(frame)

    async def _originate_error(self, state: RequestState, code: ErrorCode, message: str) -> None:
        self.requests.errors += 1
        await self.requests.finish(state, "error", message, code)
        try:
            await self._send_terminal(Error.truncating(code, message, self.rank, state.request_id))
        except RingError as exc:
            log.warning("rank %d: could not report an error for request %x: %s", self.rank, state.request_id, exc)

    # ------------------------------------------------------------------------------------------ clients

    @asynccontextmanager
    async def request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        stop: Sequence[str] = (),
        *,
        speculate: int | None = None,
    ) -> AsyncIterator[RequestHandle]:
        """Submit a request at this node; iterate ``handle.events``. Leaving early cancels it. ``speculate``: up to
        this many drafts per step (None: the node's ``speculate``)."""
        if not prompt:
            raise InputError("empty prompt")
        if max_tokens < 1:
            raise InputError("max_tokens must be at least 1")
        if params.temperature != 0.0 and params.seed is None:
            # Fixed here, at the entry: a last rank rebuilt after a failure replays the same draws.
            params = attrs.evolve(params, seed=secrets.randbelow(MAX_SEED + 1))
        try:
            start = StartRequest(
                request_id=secrets.randbits(63) | 1,
                prompt=tuple(prompt),
                max_tokens=max_tokens,
                entry_rank=self.rank,
                entry_node_id=self.config.node_id,
                sampling=params,
                stop=tuple(stop),
                speculate=self.config.speculate if speculate is None else speculate,
            )
        except ProtocolError as exc:  # beyond a wire limit (prompt length, stop strings…): the client's input
            raise InvalidRequest(ErrorCode.BAD_REQUEST, str(exc)) from None
        if self._closing:
            raise RequestRefused(ErrorCode.SHUTTING_DOWN, f"node rank {self.rank} is shutting down")
        lost = None if self._succ_lost_at is None else trio.current_time() - self._succ_lost_at
        if lost is not None and lost > self.config.failover_wait and self.links.successor_down:
            # The ring gave up on that window already (requests in flight failed): refuse now, not after link_wait.
            message = f"rank {self.rank} lost its successor link {lost:.0f} s ago ({self.links.successor_state})"
            raise RequestRefused(ErrorCode.LINK_LOST, message)
        entry = EntryStream(TextStream(self.stage.vocab), stop, max_tokens)
        async with self.requests.admission:
            state = self._register(start, entry)
            handle = RequestHandle(start.request_id, len(prompt), entry.receive)
            try:
                await self._send_data(state, self._outgoing_start(start))
                if self.first:
                    self._spawn_prefill(state)
                yield handle
            except RingError as exc:
                await self.requests.finish(state, "error", str(exc))
                raise
            finally:
                if not state.done:
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await self.cancel(state.request_id)

    async def cancel(self, request_id: int) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return

        async def tell_ring() -> None:
            try:
                await self._send_terminal(Cancel(request_id, self.rank))
            except RingError as exc:
                log.warning("rank %d: cancel of %x not sent: %s", self.rank, request_id, exc)

        # Both at once: freeing here waits out a compute of the request, which must not hold back (or, under a
        # caller's deadline, cost) the other nodes' CANCEL; a missing link must not hold back the client's end.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tell_ring)
            await self.requests.finish(state, "cancelled")

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

    def _counters(self) -> RequestCounters:
        counters = self.requests.counters()
        if self.batcher is None:
            return counters
        return attrs.evolve(counters, decode_batches=self.batcher.batches, batched_steps=self.batcher.steps)

    def status(self) -> NodeStatus:
        info = self.stage.info
        pred, succ = self.links.status()
        view = self._market_view() if self._market_view is not None else None
        return NodeStatus(
            node_id=self.config.node_id,
            rank=self.rank,
            ring_size=self.manifest.size,
            model_name=self.manifest.model_name,
            model_sha256=self.manifest.model_sha256,
            n_layers=self.manifest.n_layers,
            window=(info.start, info.end),
            backend=info.backend,
            threads=info.n_threads,
            busy_s=round(self.stage.busy_s, 4),
            handoff_s=round(self.stage.handoff_s, 4),
            send_s=round(self.send_s, 4),
            ready=self.ready,
            uptime_s=round(trio.current_time() - self.started_at, 1),
            ranks=tuple(RankStatus(r.rank, (r.start, r.end), r.address, r.link) for r in self.manifest.ranks),
            predecessor=pred,
            successor=succ,
            requests=self._counters(),
            rss_bytes=_rss_bytes(),
            market=None if view is None else tuple(view),
            failover=attrs.evolve(self.failover, log_bytes=self.requests.replay_bytes),
        )


def _frame_bytes(frame: Frame) -> int:
    """What a frame holds in a replay log, roughly: its payload (boundaries) or token ids, plus a fixed overhead."""
    match frame:
        case Boundary():
            return len(frame.payload) + 64
        case StartRequest():
            return 4 * len(frame.prompt) + 256
        case _:
            return 64


def _boundary_digest(frame: Boundary) -> bytes:
    """What identifies a boundary's content: a replayed one must give the same digest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{frame.dtype.value}:{frame.n_tokens}:{frame.final}:{frame.latest_token}:".encode())
    if frame.drafts:
        h.update(f"{frame.drafts}:{frame.row}:".encode())
    h.update(frame.payload)
    return h.digest()


def _top_token(frame: Boundary | Token | End) -> int:
    """The largest token id a data frame carries (its latest token and any drafts)."""
    return max((frame.latest_token, *frame.drafts)) if isinstance(frame, Boundary | Token) else frame.latest_token


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _credentials(config: NodeConfig, m: Manifest) -> Credentials | None:
    """The node's TLS credentials for a keyed (v2) ring, None for a keyless one; InputError if they do not fit."""
    if config.peer_policy is not None:  # a market ring: tickets stand where a manifest names keys
        if config.identity is None:
            raise InputError("a market ring's node needs its identity")
        return Credentials.of(config.identity)
    if not m.secured:
        if config.identity is not None:
            log.warning("the manifest names no node keys: links are unauthenticated and in clear (protocol v1)")
        return None
    if config.identity is None:
        raise InputError("this ring's manifest names its nodes' keys: start the node with its identity (--identity)")
    expected = m.rank(config.rank).key
    if expected != config.identity.public:
        raise InputError(
            f"this node's key {config.identity.public.fingerprint} is not rank {config.rank}'s key in the manifest"
            f" ({expected.fingerprint if expected else 'none'})"
        )
    return Credentials.of(config.identity)
