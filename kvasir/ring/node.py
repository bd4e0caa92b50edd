"""A ring node: one stage, its two links, and the request flow between them.

Data path (docs/architecture.md): a request enters at any node, START travels once around the ring, rank 0
prefills in chunks and sends boundaries on, each rank runs its window and passes the boundary on, the last rank
samples and sends the TOKEN to rank 0, which embeds it for the next step. Every frame carries the request's latest
token, so every node sees the stream pass; the entry node streams it to its client. END, CANCEL and ERROR travel
the ring once from their origin so every node frees the request's sequence.

The node dispatches frames and runs its window's compute; the rest is in the parts it is made of (:class:`Node`):
frames from the predecessor arrive one at a time in arrival order (a busy node stops reading, TCP fills, its
predecessor waits: that is the backpressure). ``async with open_node(config, stage) as node:`` runs it and shuts it
down.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from kvasir.core.errors import InputError, InvalidRequest, ProtocolError, RequestRefused, RingError
from kvasir.ring.compute import RingStage
from kvasir.ring.config import MarketView, NodeConfig, check_stage, node_credentials, node_hello
from kvasir.ring.edges import RingEdges
from kvasir.ring.events import EventHub
from kvasir.ring.failover import Failover, boundary_digest, tokens_digest
from kvasir.ring.lastrank import LastRank
from kvasir.ring.linkmgr import LinkManager, Transport
from kvasir.ring.manifest import Manifest
from kvasir.ring.observe import NO_RECORDING, RequestObserver, finish_off_loop
from kvasir.ring.outbox import Outbox
from kvasir.ring.record import NodeRecorder
from kvasir.ring.requests import (
    REASONS,
    ClientEvent,
    EndEvent,
    EntryStream,
    RequestState,
    RequestTable,
    client_start,
    outgoing_start,
)
from kvasir.ring.secure import Credentials
from kvasir.ring.status import FailoverStatus, NodeStatus, RankStatus, RequestCounters, rss_bytes
from kvasir.ring.window import WindowRunner
from kvasir.stage.vocab import TextStream
from kvasir.wire import (
    Boundary,
    Cancel,
    End,
    Error,
    ErrorCode,
    Frame,
    Hello,
    SamplingParams,
    StartRequest,
    Token,
)

__all__ = ["MarketView", "Node", "NodeConfig", "RequestHandle", "open_node"]

log = logging.getLogger("kvasir.node")


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
    credentials = node_credentials(config)  # before the nursery: a bad key is one plain InputError
    async with trio.open_nursery() as nursery:
        node = Node(
            config,
            stage,
            nursery,
            market_view=market_view,
            transport=transport,
            rng=rng,
            credentials=credentials,
            recorder=recorder,
        )
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
    """Use :func:`open_node`; the nursery runs the node's prefill tasks.

    What it is made of, each given what it uses when it is made: ``requests`` (the table), ``links`` (the link
    manager: it hands each frame from the predecessor to :meth:`_on_frame` and tells the failover of its links), the
    failover (replay logs and lost-link timers; it fails a request through :meth:`_fail`), ``outbox`` (what goes to
    the successor, and the one place where an exception becomes an ERROR code), ``window`` (the window's compute),
    ``lastrank`` (the last rank's sampling; None elsewhere), ``batcher`` (``--batch N``) and the observer
    (``recorder``, or nothing). Those two callbacks are the only calls into the node; the parts call down.
    """

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
        recorder: NodeRecorder | None = None,
    ) -> None:
        m, info = config.manifest, stage.info
        check_stage(config, info)
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
        #: The node's receipts (``--record``): the observer of its requests, when there is one.
        self.recorder = recorder
        self.observer: RequestObserver = NO_RECORDING if recorder is None else recorder
        self.requests = RequestTable(stage, self.hub, config.rank)
        self.requests.on_end.add(lambda ended: self._ended(ended.request))  # lossless (kvasir.ring.events)
        self._closing = False  # shutting down: no new request
        self._failover = Failover(config, self.requests, self.hub, nursery, fail=self._fail)
        self.links = LinkManager(
            hello=node_hello(config, info),
            edges=RingEdges.for_node(m, config.rank, config.relay, config.relay_connect),
            manifest=lambda: self.manifest,
            on_frame=self._on_frame,
            on_link_error=self.requests.count_error,
            watcher=self._failover,
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
        self.outbox = Outbox(config, self.links, self._failover, self.requests, self.observer)
        self.lastrank = LastRank(config, stage, self.requests, self.outbox, self.observer) if self.last else None
        self.window = WindowRunner(config, stage, self.outbox, self.observer, self.lastrank)
        self.batcher = self.window.batcher

    @property
    def port(self) -> int:
        """The predecessor listener's port (0 when the predecessor is relayed)."""
        return self.links.port

    @property
    def ready(self) -> bool:
        return self.links.ready

    @property
    def failover(self) -> FailoverStatus:
        """What failover did here: replays sent, duplicates dropped, the last window that came back."""
        return self._failover.status

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
        """Refuse new requests, fail every in-flight one with an error reply (not silence) (``open_node``'s exit)."""
        self._closing = True
        for state in self.requests:
            if not state.done:
                with trio.move_on_after(1):
                    await self._fail(state, ErrorCode.SHUTTING_DOWN, f"node rank {self.rank} is shutting down")

    async def _fail(self, state: RequestState, code: ErrorCode, message: str) -> None:
        await self.outbox.error(state, code, message)

    def _ended(self, request_id: int) -> None:
        """The request ended here: the observer's work on it runs off the event loop (it is answered already)."""
        work = self.observer.ended(request_id)
        if work is not None:
            finish_off_loop(self._nursery, work)

    # ------------------------------------------------------------------------------------------ sending

    async def _send_data(self, state: RequestState, frame: Frame) -> None:
        await self.outbox.data(state, frame)

    # ------------------------------------------------------------------------------------------ frames

    async def _on_frame(self, frame: Frame) -> None:
        if isinstance(frame, Hello):
            raise ProtocolError("HELLO after the handshake")
        live = self.requests.get(frame.request_id)
        if live is not None:
            live.touched = trio.current_time()
        async with self.outbox.fails(frame.request_id):
            match frame:
                case Boundary() | Token() | End() if _top_token(frame) >= self.stage.vocab.n_tokens:
                    # Never let it reach llama.cpp: a token id outside the vocabulary aborts the process there.
                    message = f"token {_top_token(frame)} outside the vocabulary of {self.stage.vocab.n_tokens}"
                    raise InvalidRequest(ErrorCode.BAD_REQUEST, message)
                case StartRequest():
                    await self._on_start(frame)
                case Boundary():
                    await self._on_boundary(frame)
                case Token():
                    await self._on_token(frame)
                case Error() if frame.request_id == 0:
                    log.warning("rank %d: predecessor reports: %s", self.rank, frame.message)
                case End() | Cancel() | Error():
                    await self._on_terminal(frame)

    async def _on_start(self, start: StartRequest) -> None:
        known = self.requests.get(start.request_id) is not None or self.requests.ended(start.request_id)
        if start.entry_rank == self.rank:
            # A START reaches its entry rank only in a replay. Unknown here: this node restarted, and the client it
            # was streaming to went with the old process. Free the request round the ring.
            if not known:
                message = f"request {start.request_id:x} entered at rank {self.rank}, which restarted: its client left"
                await self.outbox.terminal(Error.truncating(ErrorCode.LINK_LOST, message, self.rank, start.request_id))
            return
        if known:  # a replay of a request this node has (or had): what it holds stands
            self._failover.duplicate()
            return
        if self.first and not start.prompt:  # rank 0 embeds the prompt: a sender withheld what it must not
            reason = "rank 0 got a START without the prompt's token ids"
            await self.links.send(Error.truncating(ErrorCode.BAD_REQUEST, reason, self.rank, start.request_id))
            return
        try:
            state = self._register(start, entry=None)
        except RequestRefused as exc:  # typed: it carries the code the START is answered with
            await self.links.send(Error.truncating(exc.code, str(exc), self.rank, start.request_id))
            return
        if self.outbox.forwards(start.entry_rank):
            await self._send_data(state, outgoing_start(start, self.rank, self.manifest.size))
        if self.first:
            self._nursery.start_soon(self.window.prefill, state)

    def _register(self, start: StartRequest, entry: EntryStream | None) -> RequestState:
        if self.lastrank is not None:
            self.lastrank.admit(start)
        state = self.requests.register(start, entry, check_vocab=self.first or self.last)
        self.observer.begin(
            start.request_id, last=self.last, sampling=start.sampling, history=start.prompt, params=start.params_hash
        )
        if self.lastrank is not None:
            self.lastrank.adopt(state)
        return state

    async def _on_boundary(self, frame: Boundary) -> None:
        self.requests.boundaries += 1
        state = self.requests.get(frame.request_id)
        if state is None or state.done:
            return  # finished or cancelled while this frame was in flight
        if self._failover.seen_before(state, (frame.first_position, frame.row), boundary_digest(frame)):
            return
        # A decode step passes (a verify batch's rows after row 0 show nothing new).
        step = frame.first_position >= state.prompt_len and frame.latest_token >= 0 and frame.row == 0
        try:
            await self.window.boundary(state, frame, came_back=step)
        finally:
            # Seen (streamed to a client here, published) only once the step is on its way: that work is off the
            # ring's path to the successor (docs/benchmarks.md § The ring on loopback).
            if step:
                self.requests.see_step(state, frame.first_position, (frame.latest_token, *frame.drafts))

    async def _on_token(self, frame: Token) -> None:
        state = self.requests.get(frame.request_id)
        if state is None or state.done:
            return
        await state.prefilled.wait()  # a replay into a rebuilt rank 0 brings the tokens while it still prefills
        fed = (frame.token_id, *frame.drafts)
        if self._failover.seen_before(state, (frame.position, 0), tokens_digest(fed)):
            return
        try:
            await self.window.token(state, frame)
        finally:
            self.requests.see_step(state, frame.position, fed)  # after the send, as in _on_boundary

    async def _on_terminal(self, frame: End | Cancel | Error) -> None:
        """A ring-circling END, CANCEL or ERROR: the request ends here too, and the frame goes on round the ring."""
        state = self.requests.get(frame.request_id)
        if state is not None:
            match frame:
                case End():
                    self.requests.see_end(state, frame, self.observer.closes(frame))  # N8, N9: may refuse it
                    await self.requests.finish(state, REASONS[frame.reason])
                case Cancel():
                    await self.requests.finish(state, "cancelled")
                case Error():
                    await self.requests.finish(state, "error", frame.message, frame.code, frame.origin_rank)
        if self.outbox.forwards(frame.origin_rank):
            await self.outbox.terminal(frame)

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
        client_auth: str = "",
    ) -> AsyncIterator[RequestHandle]:
        """Submit a request at this node; iterate ``handle.events``. Leaving early cancels it. ``speculate``: drafts
        per step (None: the node's); ``client_auth``: the client's signed authorisation, which START carries round."""
        speculate = self.config.speculate if speculate is None else speculate
        start = client_start(prompt, params, max_tokens, stop, speculate, self.rank, self.config.node_id, client_auth)
        if self._closing:
            raise RequestRefused(ErrorCode.SHUTTING_DOWN, f"node rank {self.rank} is shutting down")
        self._failover.refuse_if_given_up(self.links)
        entry = EntryStream(TextStream(self.stage.vocab), stop, max_tokens)
        async with self.requests.admission:
            state = self._register(start, entry)
            handle = RequestHandle(start.request_id, len(prompt), entry.receive)
            try:
                await self._send_data(state, outgoing_start(start, self.rank, self.manifest.size))
                if self.first:
                    self._nursery.start_soon(self.window.prefill, state)
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
                await self.outbox.terminal(Cancel(request_id, self.rank))
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
            send_s=round(self.outbox.send_s, 4),
            ready=self.ready,
            uptime_s=round(trio.current_time() - self.started_at, 1),
            ranks=tuple(RankStatus(r.rank, (r.start, r.end), r.address, r.link) for r in self.manifest.ranks),
            predecessor=pred,
            successor=succ,
            requests=self._counters(),
            rss_bytes=rss_bytes(),
            market=None if view is None else tuple(view),
            failover=attrs.evolve(self.failover, log_bytes=self.requests.replay_bytes),
        )


def _top_token(frame: Boundary | Token | End) -> int:
    """The largest token id a data frame carries (its latest token and any drafts)."""
    return max((frame.latest_token, *frame.drafts)) if isinstance(frame, Boundary | Token) else frame.latest_token
