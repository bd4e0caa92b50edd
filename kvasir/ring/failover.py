"""Failover at one node: the replay logs, the link generations and the lost-link timers (docs/architecture.md
§ Failover, docs/protocol.md § Replay).

:class:`Failover` is what the link manager tells of its links (:class:`~kvasir.ring.linkmgr.LinkWatcher`): a live
link ended (:meth:`Failover.link_lost`), or the successor link is made again (:meth:`Failover.successor_up`, the
replay, before anything else goes over it). In between the requests in flight stay: the window behind the break is
expected back (the same node relinking, a restart, a standby, a claimant). Only if it stays away for the failover
wait do they fail, on every node: the node after the break sends LINK_LOST round the ring to the node before it.

The node writes the logs as it sends (:meth:`Failover.log`, :meth:`Failover.remember`) and asks, for each frame that
arrives, whether it is a replay of one seen before (:meth:`Failover.seen_before`). A request fails here through
``fail`` (the node's outbox: an ERROR round the ring).
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from kvasir.core.errors import RequestRefused
from kvasir.ring.config import NodeConfig
from kvasir.ring.events import EventHub, FailedOver
from kvasir.ring.requests import RequestState, RequestTable
from kvasir.ring.status import FailoverStatus
from kvasir.wire import Boundary, Cancel, End, Error, ErrorCode, Frame, Hello, Side, StartRequest

if TYPE_CHECKING:
    from kvasir.ring.linkmgr import LinkManager

log = logging.getLogger("kvasir.node")

#: After giving up on its successor, how long a node waits for the error that comes round the ring before failing a
#: request on its own (the node after the break sends it; this covers a ring broken in two places).
LINK_LOST_GRACE_S = 5.0
#: Ring-circling frames (END, CANCEL, ERROR) a node keeps to replay to a successor that comes back: one of them may
#: have died with the old holder, and the nodes behind it would wait for it until their stall timers.
TERMINAL_MEMORY = 1024

#: How a request fails at this node with an ERROR sent round the ring (the node's outbox).
Fail = Callable[[RequestState, ErrorCode, str], Awaitable[None]]


class ReplayMismatch(RequestRefused):
    """A replayed frame differs from the one received before at its position (REPLAY_MISMATCH)."""


class Failover:
    """One node's failover: ``status`` counts what it did (the node's status shows it)."""

    def __init__(
        self, config: NodeConfig, requests: RequestTable, hub: EventHub, nursery: trio.Nursery, *, fail: Fail
    ) -> None:
        self.rank, self.size = config.rank, config.manifest.size
        self.failover_wait, self.link_wait = config.failover_wait, config.link_wait
        self._requests, self._hub, self._nursery, self._fail = requests, hub, nursery, fail
        self.status = FailoverStatus()
        self._terminal: deque[tuple[float, Frame]] = deque(maxlen=TERMINAL_MEMORY)
        #: Link generations: a give-up timer acts only if no newer link came (and went) since it started.
        self._pred_gen = self._succ_gen = 0
        self._succ_lost_at: float | None = None
        #: Each time this node turns dormant (a give-up timer acts only for the latest).
        self._dormant_gen = 0

    def refuse_if_given_up(self, links: LinkManager) -> None:
        """A new request is refused at once once the ring gave up on the successor (in-flight requests failed past
        the failover wait), with the reason: not after ``link_wait``."""
        lost = None if self._succ_lost_at is None else trio.current_time() - self._succ_lost_at
        if lost is not None and lost > self.failover_wait and links.successor_down:
            message = f"rank {self.rank} lost its successor link {lost:.0f} s ago ({links.successor_state})"
            raise RequestRefused(ErrorCode.LINK_LOST, message)

    @property
    def successor_lost(self) -> bool:
        """The successor link broke and no replay has gone to a successor since."""
        return self._succ_lost_at is not None

    # ------------------------------------------------------------------------------------------ the logs

    def log(self, state: RequestState, frame: Frame) -> None:
        """A data frame of ``state`` (START, boundary, token) goes to the successor: keep it in the replay log."""
        state.sent.append(frame)
        state.sent_bytes += frame_bytes(frame)

    def remember(self, frame: End | Cancel | Error) -> None:
        """A ring-circling frame goes to the successor: keep it for a replay (it may die with the successor)."""
        self._terminal.append((trio.current_time(), frame))

    def duplicate(self) -> None:
        """A replayed frame this node has seen before was dropped."""
        self.status = attrs.evolve(self.status, duplicates=self.status.duplicates + 1)

    def seen_before(self, state: RequestState, key: tuple[int, int], digest: bytes) -> bool:
        """Whether a frame for ``key`` (its position, and its row in a verify batch) of ``state`` arrived before (a
        replay, then dropped). It must be identical: else :class:`ReplayMismatch` (a replay never silently
        diverges)."""
        previous = state.received.get(key)
        if previous is None:
            state.received[key] = digest
            return False
        if previous != digest:
            message = f"rank {self.rank}: a replayed frame at position {sum(key)} differs from the one received before"
            log.error("request %x: %s", state.request_id, message)
            raise ReplayMismatch(ErrorCode.REPLAY_MISMATCH, message)
        self.duplicate()
        return True

    # ------------------------------------------------------------------------------------------ the link watcher

    async def link_lost(self, side: Side, links: LinkManager) -> None:
        """A live link ended, and frames in transit on it with it: arm the give-up timers."""
        in_flight = sum(1 for state in self._requests if not state.done)
        log.warning(
            "rank %d lost its %s link; holding %d request(s) up to %.0f s for the window to come back",
            self.rank, side.value, in_flight, self.failover_wait,
        )  # fmt: skip
        if side is Side.PREDECESSOR:
            self._pred_gen += 1
            self._nursery.start_soon(self._fail_if_predecessor_stays_away, links, self._pred_gen)
        else:
            self._succ_gen += 1
            self._succ_lost_at = trio.current_time()
            for state in list(self._requests):
                if not state.done:
                    self._nursery.start_soon(self._fail_if_successor_stays_away, links, state, self._succ_gen)

    async def _fail_if_predecessor_stays_away(self, links: LinkManager, generation: int) -> None:
        await trio.sleep(self.failover_wait)
        if generation != self._pred_gen or links.predecessor is not None or links.dormant:
            return  # dormant: another holder of this window carries its requests on
        message = f"rank {self.rank} lost its predecessor link for {self.failover_wait:.0f} s"
        for state in list(self._requests):
            if not state.done:
                with trio.move_on_after(2):
                    await self._fail(state, ErrorCode.LINK_LOST, message)

    async def _fail_if_successor_stays_away(self, links: LinkManager, state: RequestState, generation: int) -> None:
        # Nothing can be sent forward; the node after the break reports the loss round the ring to us (and a leaving
        # successor's own SHUTTING_DOWN comes round too, saying why): wait for those first.
        await trio.sleep(self.failover_wait + LINK_LOST_GRACE_S)
        if state.done or generation != self._succ_gen or links.successor is not None or links.dormant:
            return
        self._requests.errors += 1
        message = f"rank {self.rank} lost its successor link"
        await self._requests.finish(state, "error", message, ErrorCode.LINK_LOST)

    async def went_dormant(self, links: LinkManager) -> None:
        """This node handed its window to another holder, which carries the ring on: the requests that entered here
        get their tokens only if this node holds the window again (a replay brings them). Past the failover wait
        still dormant, their clients hear so, not after the stall timeout (120 s: the chaos benchmark's 3 hung
        streams). The other requests stay: were this node to hold the window again, a replay finds them as it left
        them."""
        self._dormant_gen += 1
        self._nursery.start_soon(self._fail_entries_if_still_dormant, links, self._dormant_gen)

    async def _fail_entries_if_still_dormant(self, links: LinkManager, generation: int) -> None:
        await trio.sleep(self.failover_wait)
        if generation != self._dormant_gen or not links.dormant:
            return
        message = f"rank {self.rank} handed its window to another holder mid-answer; retry the request"
        for state in list(self._requests):
            if not state.done and state.entry is not None:
                self._requests.errors += 1
                await self._requests.finish(state, "error", message, ErrorCode.LINK_LOST)

    async def successor_up(self, send: Callable[[Frame], Awaitable[None]], hello: Hello) -> None:
        """The successor link is (re)made: before anything else goes over it, resend every request in flight here
        as this node sent it (START, then each boundary or token with its original schedule), then the recent
        ring-circling frames. A new holder of the window rebuilds each request's state from them exactly; a holder
        that kept its state recognises what it has seen (checking it is identical) and drops it."""
        started = trio.current_time()
        self._succ_gen += 1  # the window is back: pending give-up timers are stale (a long replay must not trip them)
        successor = (self.rank + 1) % self.size
        horizon = started - (self.failover_wait + self.link_wait)
        states = [s for s in self._requests if not s.done and (s.sent or s.start.entry_rank == successor)]
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
                nbytes += frame_bytes(frame)
        for frame in terminal:
            await send(frame)
        done = trio.current_time()
        stall = None if self._succ_lost_at is None else round(done - self._succ_lost_at, 3)
        self._succ_lost_at = None
        f = self.status
        self.status = attrs.evolve(
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
        self._hub.publish(
            FailedOver(hello.rank, (hello.window_start, hello.window_end), len(states), frames, nbytes, stall)
        )


def frame_bytes(frame: Frame) -> int:
    """What a frame holds in a replay log, roughly: its payload (boundaries) or token ids, plus a fixed overhead."""
    match frame:
        case Boundary():
            return len(frame.payload) + 64
        case StartRequest():
            return 4 * len(frame.prompt) + 256
        case _:
            return 64


def boundary_digest(frame: Boundary) -> bytes:
    """What identifies a boundary's content: a replayed one must give the same digest."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{frame.dtype.value}:{frame.n_tokens}:{frame.final}:{frame.latest_token}:".encode())
    if frame.drafts:
        h.update(f"{frame.drafts}:{frame.row}:".encode())
    h.update(frame.payload)
    return h.digest()


def tokens_digest(tokens: tuple[int, ...]) -> bytes:
    """What identifies a TOKEN's content at rank 0 (its token and drafts): a replayed one must give the same."""
    return b"".join(t.to_bytes(4, "little") for t in tokens)
