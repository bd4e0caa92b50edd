"""A node's two links: accept the predecessor, dial the successor (TCP or a relay edge), keep both alive.

Liveness: both ends send KEEPALIVE on a link that has been quiet for ``keepalive_interval`` (the downstream end also
echoes the upstream's, which measures the hop's round trip), and every receive runs under an idle timeout. A peer
that goes silent (a phone that lost its network, a NAT mapping dropped, a half-open TCP connection) is noticed within
``idle_timeout`` and its link closed, which frees the predecessor slot for a replacement. TCP sockets also set
SO_KEEPALIVE so the kernel notices a dead peer under a link whose receive is not waiting (a busy node).

Security (protocol v2, when the manifest names every rank's key and the node has its identity): each link is opened
by :class:`~kvasir.ring.opener.LinkOpener`, through the key-bound handshake of :mod:`kvasir.ring.secure`, and then
carries its frames inside TLS 1.3, over TCP or end to end through a relay edge.

What happens to the requests when a link ends or the successor link is made again is the
:class:`LinkWatcher`'s (the node's :class:`~kvasir.ring.failover.Failover`).

The receive timeout is safe against busy neighbours: a node computing does not read its predecessor link (that is
the ring's backpressure), so the timeout only runs while it waits in ``receive``; its own keepalives go out from a
separate task, so its predecessor keeps hearing from it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from kvasir.core.errors import ProtocolError, RingError
from kvasir.core.identity import PublicKey
from kvasir.ring.edges import RingEdges
from kvasir.ring.links import Link, StreamLink, handshake, link_error
from kvasir.ring.manifest import Manifest
from kvasir.ring.opener import (
    LinkOpener,
    StreamHandler,
    SuccessorTaken,
    SuccessorUnreachable,
    TcpTransport,
    Transport,
)
from kvasir.ring.secure import Credentials, LinkAuthError, PeerPolicy
from kvasir.ring.status import LinkStatus
from kvasir.util.backoff import Backoff
from kvasir.wire import MAX_FRAME_BYTES, Error, Frame, Hello, Keepalive, Side

__all__ = [
    "LINK_ERRORS",
    "LinkManager",
    "LinkWatcher",
    "StreamHandler",
    "SuccessorLost",
    "SuccessorUnreachable",
    "TcpTransport",
    "Transport",
]

log = logging.getLogger("kvasir.node")

#: Errors that end one link (the node goes on and waits for, or redials, the next).
LINK_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel, ProtocolError, RingError)

#: A peer that refused our key is not redialed sooner than this.
REFUSED_BACKOFF_S = 5.0


class SuccessorLost(RingError):
    """The successor link broke while a frame was being sent on it (the frame may not have arrived)."""


class LinkWatcher(Protocol):
    """Told of the links' ends and returns (the node's failover)."""

    async def link_lost(self, side: Side, links: LinkManager) -> None:
        """A live link on ``side`` ended (called shielded: it must finish even as the node stops)."""
        ...

    async def successor_up(self, send: Callable[[Frame], Awaitable[None]], hello: Hello) -> None:
        """The successor link is made: ``send`` goes over it before anything else does (the replay)."""
        ...

    async def went_dormant(self, links: LinkManager) -> None:
        """This node handed its window to another holder (its successor refused it: that one is linked there)."""
        ...


class LinkManager:
    """Both links of one node. ``run`` keeps them; ``send`` hands a frame to the successor; frames from the
    predecessor go to ``on_frame`` one at a time, in arrival order."""

    def __init__(
        self,
        *,
        hello: Hello,
        edges: RingEdges,
        manifest: Callable[[], Manifest],
        on_frame: Callable[[Frame], Awaitable[None]],
        on_link_error: Callable[[], None] = lambda: None,
        watcher: LinkWatcher | None = None,
        keepalive_interval: float = 1.0,
        idle_timeout: float | None = None,
        link_wait: float = 30.0,
        transport: Transport | None = None,
        rng: random.Random | None = None,
        credentials: Credentials | None = None,
        peer_policy: Callable[[], PeerPolicy | None] | None = None,
        ticket: Callable[[], bytes] | None = None,
        dormant: bool = False,
    ) -> None:
        self.hello = hello
        self.rank = hello.rank
        self.edges = edges
        self._manifest = manifest
        self._on_frame = on_frame
        self._on_link_error = on_link_error
        self._watcher = watcher
        self.keepalive_interval = keepalive_interval
        self.idle_timeout = idle_timeout if idle_timeout is not None else 3 * keepalive_interval
        self.link_wait = link_wait
        self._rng = rng or random.Random()
        self.opener = LinkOpener(
            rank=self.rank,
            edges=edges,
            manifest=manifest,
            transport=transport,
            credentials=credentials,
            peer_policy=peer_policy,
            ticket=ticket,
        )
        self.predecessor_key: PublicKey | None = None
        self.max_frame_bytes = MAX_FRAME_BYTES
        self.port = 0
        self.predecessor: Link | None = None
        self.predecessor_hello: Hello | None = None
        self.successor: Link | None = None
        self.successor_hello: Hello | None = None
        self.predecessor_state = "waiting"
        self.successor_state = "starting"
        self._succ_ready = trio.Event()
        self._replaying = False
        self._succ_scope: trio.CancelScope | None = None
        #: When the successor's unanswered ping went out (trio clock); its echo measures the hop's round trip.
        self._ping_sent: float | None = None
        #: Dormant: another node may hold this window, so this one does not dial its successor until a predecessor
        #: links to it (a standby from its start; a node its successor refused while another holder is linked there).
        self.dormant = dormant
        self._woken = trio.Event()  # set when a predecessor links
        self._woke_at: float | None = None  # when a predecessor last woke this node from dormancy (trio clock)
        #: Which holder of the successor's window (0 the primary, then its standbys) the dial loop tries next.
        self._succ_pick = 0

    @property
    def ready(self) -> bool:
        return self.successor is not None and self.predecessor is not None

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep both links; ``started(port)`` once listening (0 when the predecessor is relayed)."""
        me = self._manifest().rank(self.rank)
        async with trio.open_nursery() as nursery:
            if self.edges.predecessor_relayed:
                nursery.start_soon(self._keep_relay_predecessor)
            else:
                listen = self.opener.transport.listen
                self.port = await nursery.start(listen, me.host, me.port, self._accept_predecessor)
            nursery.start_soon(self._keep_successor)
            task_status.started(self.port)

    def redial_successor(self) -> None:
        """Drop the successor link (its address changed); the dial loop reaches the new holder."""
        if self._succ_scope is not None:
            self._succ_scope.cancel()

    @property
    def successor_down(self) -> bool:
        """No successor link and none being replayed into: a frame sent now would wait for one."""
        return self.successor is None and not self._replaying

    async def send(self, frame: Frame) -> None:
        """Send to the successor, waiting up to ``link_wait`` for its link (and as long as a replay into a successor
        that came back is running: that one is not missing, only busy); RingError if there is none."""
        deadline = trio.current_time() + self.link_wait
        while self.successor is None and (self._replaying or trio.current_time() < deadline):
            with trio.move_on_at(deadline if not self._replaying else trio.current_time() + 1.0):
                await self._succ_ready.wait()
        link = self.successor
        if link is None:
            raise RingError(f"no link to the successor for {self.link_wait:.0f} s ({self.successor_state})")
        try:
            await link.send(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise SuccessorLost("the successor link was lost") from None

    def status(self) -> tuple[LinkStatus, LinkStatus]:
        """(predecessor, successor) as the status record shows them."""
        return (
            LinkStatus.of(self.predecessor_state, self.predecessor.stats if self.predecessor else None),
            LinkStatus.of(self.successor_state, self.successor.stats if self.successor else None),
        )

    # ------------------------------------------------------------------------------------------ predecessor

    async def _accept_predecessor(self, stream: trio.abc.Stream, peer: str) -> None:
        admitted = await self.opener.accept(stream, peer, self.hello)
        if admitted is not None:
            await self._run_predecessor(admitted.link, peer, admitted.hello, admitted.key)

    async def _keep_relay_predecessor(self) -> None:
        """Predecessor edge through the relay: dial out as the downstream end, redial with backoff."""
        backoff = Backoff(rng=self._rng)
        edge = self.edges.edge_in
        while True:
            self.predecessor_state = f"dialing relay edge {edge}"
            try:
                async with self.edges.open_relay(edge, upstream=False) as channel:
                    backoff.reset()
                    self.predecessor_state = f"waiting on relay edge {edge}"
                    link, key, window = await self.opener.relay_link(channel, edge, upstream=False)
                    remote = await self.opener.greet(link, f"relay:{edge}", self.hello, window)
                    if remote is not None:
                        await self._run_predecessor(link, f"relay:{edge}", remote, key)
            except (RingError, trio.TooSlowError, trio.BrokenResourceError) as exc:  # relay gone, refused, closed
                self.predecessor_state = f"relay edge {edge}: {exc or 'handshake timed out'}"
            await trio.sleep(backoff.next())

    async def _run_predecessor(self, link: Link, peer: str, remote: Hello, key: PublicKey | None = None) -> None:
        """Run a predecessor's link whose HELLOs :meth:`LinkOpener.greet` exchanged, if the slot is free for it."""
        if isinstance(link, StreamLink):
            link.max_frame_bytes = self.max_frame_bytes  # authenticated by its HELLO (v1) or its key (v2)
        old = self.predecessor
        if old is not None:
            # A live link yields only to the same peer reconnecting: the same key (v2), or the same id (v1).
            same = (
                key == self.predecessor_key
                if key is not None
                else (self.predecessor_hello is not None and remote.node_id == self.predecessor_hello.node_id)
            )
            if not same:
                # The slot frees itself when the linked one goes silent for idle_timeout (a dead peer).
                log.warning("rank %d refused a second predecessor from %s while one is linked", self.rank, peer)
                with trio.move_on_after(1):
                    await link.send(link_error("this node already has a linked predecessor", self.rank))
                await link.aclose()
                return
            await old.aclose()  # the same predecessor reconnecting: its old link is stale
        self.predecessor, self.predecessor_hello, self.predecessor_key = link, remote, key
        self.predecessor_state = f"connected to rank {remote.rank} ({peer})"
        self._woken.set()  # a dormant node now holds the window: it dials its successor
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keepalive, link, False)
                try:
                    await self._read_predecessor(link)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if self.predecessor is link:
                self.predecessor = None
                self.predecessor_state = "waiting"
                if self._watcher is not None:
                    with trio.CancelScope(shield=True):  # the node's requests must hear of it even as we stop
                        await self._watcher.link_lost(Side.PREDECESSOR, self)
            await link.aclose()

    async def _read_predecessor(self, link: Link) -> None:
        try:
            while True:
                frame = await self._receive(link, "predecessor")
                if frame is None:
                    return
                if isinstance(frame, Keepalive):
                    await link.send(Keepalive())  # the echo: the predecessor measures the hop's round trip
                    continue
                await self._on_frame(frame)
        except trio.EndOfChannel:
            log.info("rank %d: predecessor closed the link", self.rank)
        except ProtocolError as exc:
            log.warning("rank %d: closing predecessor link: %s", self.rank, exc)
            self._on_link_error()
            with trio.move_on_after(1):
                await link.send(link_error(str(exc), self.rank))
        except (trio.BrokenResourceError, trio.ClosedResourceError, RingError) as exc:
            log.info("rank %d: predecessor link lost: %s", self.rank, exc)

    async def _receive(self, link: Link, side: str) -> Frame | None:
        """The next frame, or None when the peer was silent for ``idle_timeout`` (the link is then dropped)."""
        with trio.move_on_after(self.idle_timeout):
            return await link.receive()
        log.warning("rank %d: %s silent for %.1f s; dropping its link", self.rank, side, self.idle_timeout)
        return None

    # ------------------------------------------------------------------------------------------ successor

    async def _wait_while_dormant(self) -> None:
        if self.dormant:
            self.successor_state = "dormant: waiting for a predecessor to link here (another node may hold the window)"
            await self._woken.wait()
            self.dormant = False
            self._woke_at = trio.current_time()

    async def _go_dormant(self) -> None:
        """The successor refused this node's link (it has a predecessor linked: another holder of this window, which
        carries the ring now). Two holders redialing would fight for that slot: this one stops dialing until a
        predecessor links to it, and hands back the predecessor it has, whose node then dials this window's next
        holder (the dial loop moves on after a lost link)."""
        log.warning("rank %d: the successor refused this node's link; dormant until a predecessor links", self.rank)
        self.dormant = True
        self._woken = trio.Event()
        if self.predecessor is not None:
            with trio.move_on_after(2):
                await self.predecessor.aclose()  # no ERROR: its node must not take it for a refusal of its own
        if self._watcher is not None:
            await self._watcher.went_dormant(self)

    def _has_other_holders(self) -> bool:
        """Whether the manifest names another node for this node's window (a standby, or the primary of a standby)."""
        return bool(self._manifest().rank(self.rank).standby)

    async def _keep_successor(self) -> None:
        backoff = Backoff(rng=self._rng)
        misses = 0  # holders of the successor's window that did not answer, since the last link or full round
        while True:
            await self._wait_while_dormant()
            successor = self._manifest().successor(self.rank)  # re-read: the manifest may have been updated
            holders = successor.holders()
            pick = self._succ_pick % len(holders)
            target = holders[pick]
            which = f" (standby {pick - 1})" if pick else ""
            via = f"relay edge {self.edges.edges_out[pick]}" if self.edges.successor_relayed else target.address
            self.successor_state = f"dialing rank {target.rank}{which} via {via}"
            at_least = 0.0
            refused = next_holder = retry = False
            with trio.CancelScope() as scope:
                self._succ_scope = scope
                try:
                    async with self.opener.open_successor(target, pick) as link:
                        try:
                            hello = await handshake(link, self.hello, Side.SUCCESSOR, send_first=True)
                        except (ProtocolError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                            raise RingError(f"handshake with rank {target.rank} failed: {exc}") from None
                        backoff.reset()
                        misses = 0
                        connected = f"connected to rank {target.rank}{which} via {via}"
                        refused = await self._run_successor(link, hello, connected)
                        self.successor_state = f"lost rank {target.rank}{which}; redialing"
                except SuccessorTaken as exc:  # the relay's refusal: another holder of this window is linked on
                    self.successor_state = f"rank {target.rank}{which}: {exc}"
                    # Just woken, by a predecessor that gave up on this window's other holder: that one may be hung
                    # yet hold the edge until the successor's idle timeout drops it. Retry until then, not dormant.
                    retry = self._woke_at is not None and trio.current_time() - self._woke_at < self.idle_timeout + 1
                    refused = not retry
                    if refused:
                        log.warning("rank %d: successor link refused: %s", self.rank, exc)
                except SuccessorUnreachable as exc:
                    self.successor_state = str(exc)
                    misses += 1
                    next_holder = misses < len(holders)  # the window's next holder at once, then the backoff
                    misses %= len(holders)
                except LinkAuthError as exc:
                    self.successor_state = f"rank {target.rank}: {exc}"
                    log.warning("rank %d: successor link not authenticated: %s", self.rank, exc)
                    at_least = REFUSED_BACKOFF_S  # it will refuse us again: no redial loop flooding logs
                except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    self.successor_state = f"rank {target.rank}: handshake failed ({exc or 'timed out'})"
                    at_least = 1.0
                except RingError as exc:
                    self.successor_state = f"rank {target.rank}: {exc}"
                    log.warning("rank %d: successor link: %s", self.rank, exc)
                    at_least = 1.0  # refused: no point in hammering it
            self._succ_scope = None
            if retry:
                await trio.sleep(0.25)
                continue
            if scope.cancelled_caught:
                self.successor_state = f"rank {target.rank} moved; redialing"
            elif not refused:
                # The holder died, does not answer, or handed us back (its successor has another holder of its
                # window): the next try goes to the window's next holder, the one that carries it now if another does.
                # A refusal is different: this holder is linked on, it is this node's window that has two holders.
                self._succ_pick = (pick + 1) % len(holders)
            if refused:
                at_least = 1.0  # refused: no point in hammering it
                if self._has_other_holders():
                    await self._go_dormant()
                    continue
            if next_holder:
                continue
            await trio.sleep(backoff.next(at_least=at_least))

    async def _run_successor(self, link: Link, hello: Hello, state: str) -> bool:
        """Run the successor link until it ends; True if the successor ended it with a link-level ERROR (refused)."""
        try:
            if self._watcher is not None:
                # The replay goes first: frames waiting for this link (send() blocks until _succ_ready) follow it.
                self.successor_state = f"replaying to rank {hello.rank}"
                self._replaying = True
                try:
                    await self._watcher.successor_up(link.send, hello)
                except LINK_ERRORS:
                    # The successor may have refused the link (an ERROR, then close) while the replay went out: its
                    # ERROR is still to be read, and a refusal must not be taken for a dead holder (which would move
                    # this node on to the window's next holder and wake it: two holders of one window).
                    with trio.move_on_after(1):
                        return await self._read_successor(link)
                    return False
                finally:
                    self._replaying = False
            self.successor, self.successor_hello = link, hello
            self._succ_ready.set()
            self.successor_state = state
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keepalive, link, True)
                refused = await self._read_successor(link)
                nursery.cancel_scope.cancel()
            return refused
        finally:
            self.successor = None
            if self._succ_ready.is_set():  # a replay that failed never set it: its waiters keep waiting on it
                self._succ_ready = trio.Event()
            if self._watcher is not None:
                with trio.CancelScope(shield=True):
                    await self._watcher.link_lost(Side.SUCCESSOR, self)

    async def _read_successor(self, link: Link) -> bool:
        """The successor only sends keepalives (echoes, or its own when quiet) and link-level errors backwards.

        Returns True when a link-level ERROR (request id 0) ended the link: the successor refused it (today: it has
        another predecessor linked, or got a malformed frame from this node); False for a link that broke.
        """
        try:
            while True:
                frame = await self._receive(link, "successor")
                if frame is None:
                    return False
                if isinstance(frame, Keepalive):
                    if self._ping_sent is not None:
                        link.stats.rtt = trio.current_time() - self._ping_sent
                        self._ping_sent = None
                elif isinstance(frame, Error):
                    log.warning("rank %d: successor reports: %s", self.rank, frame.message)
                    return frame.request_id == 0
        except LINK_ERRORS:
            return False

    # ------------------------------------------------------------------------------------------ keepalive

    async def _keepalive(self, link: Link, upstream: bool) -> None:
        """Every interval: the upstream end pings (timed, for the RTT); the downstream end sends one only when it
        sent nothing else during the interval (its echoes stop while it computes and does not read)."""
        last_out = -1
        try:
            while True:
                if upstream:
                    if self._ping_sent is None:
                        self._ping_sent = trio.current_time()
                    await link.send(Keepalive())
                elif link.stats.frames_out == last_out:
                    await link.send(Keepalive())
                last_out = link.stats.frames_out
                await trio.sleep(self.keepalive_interval)
        except (trio.BrokenResourceError, trio.ClosedResourceError, RingError):
            return
        finally:
            if upstream:
                self._ping_sent = None
