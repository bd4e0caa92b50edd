"""What a node sends its successor, and how a request fails at it.

A request's data frames (START, BOUNDARY, TOKEN) are sealed by the node's observer, kept in the replay log, and
held there while the successor is away; the ring-circling END, CANCEL and ERROR are remembered for a replay too.
:meth:`Outbox.fails` is the one place where an exception that stops a request becomes an ERROR code
(:func:`error_code`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from kvasir.core.errors import KvasirError, ProtocolError, RequestRefused, RingError
from kvasir.ring.config import NodeConfig
from kvasir.ring.failover import Failover
from kvasir.ring.linkmgr import LinkManager, SuccessorLost
from kvasir.ring.observe import RequestObserver
from kvasir.ring.requests import REASONS, RequestState, RequestTable
from kvasir.wire import (
    Boundary,
    BoundaryDType,
    Cancel,
    End,
    EndReason,
    Error,
    ErrorCode,
    Frame,
    StartRequest,
    choose_dtype,
)

log = logging.getLogger("kvasir.node")


def error_code(exc: BaseException) -> ErrorCode:
    """The ERROR code a request that ``exc`` stopped is failed with (pure; docs/protocol.md § ERROR)."""
    if isinstance(exc, RequestRefused):
        return exc.code  # the request itself (BAD_REQUEST, CONTEXT_FULL) or this node's room (OVERLOADED)
    if isinstance(exc, RingError):
        return ErrorCode.LINK_LOST  # no link to go on with
    if isinstance(exc, ProtocolError):
        return ErrorCode.PROTOCOL  # a malformed frame: the link's fault, not the request's
    if isinstance(exc, KvasirError):
        return ErrorCode.STAGE_FAILED
    return ErrorCode.INTERNAL


class Outbox:
    """The sending side of one node; ``send_s`` is the time spent in link sends of data frames (status)."""

    def __init__(
        self,
        config: NodeConfig,
        links: LinkManager,
        failover: Failover,
        requests: RequestTable,
        observer: RequestObserver,
    ) -> None:
        self._links, self._failover, self._requests, self._observer = links, failover, requests, observer
        self.rank, self.size, self.dtype = config.rank, config.manifest.size, config.boundary_dtype
        self.send_s = 0.0

    def forwards(self, origin_rank: int) -> bool:
        """Whether a ring-circling frame from ``origin_rank`` goes on to our successor."""
        return (self.rank + 1) % self.size != origin_rank

    async def data(self, state: RequestState, frame: Frame) -> None:
        """Send a request's START, boundary or token, keeping it in the request's replay log first."""
        if not state.done:
            if isinstance(frame, Boundary):
                frame = self._observer.seal(frame)  # recorded: committed, stamped with the chain head (FLAG_CHAIN)
            self._failover.log(state, frame)
        if self._failover.successor_lost and self._links.successor_down and not isinstance(frame, StartRequest):
            # The successor link broke (which armed the give-up timer of every request then in flight): the frame
            # waits in the replay log for the window to come back, and this node goes on reading its predecessor,
            # where an END or ERROR for this very request may be next (waiting here would hold it up to link_wait).
            return
        t0 = time.perf_counter()
        try:
            await self._links.send(frame)
        except SuccessorLost:
            if state.done:
                raise
            # It is in the replay log: the successor that comes back gets it (or the request fails after the wait).
        finally:
            self.send_s += time.perf_counter() - t0

    async def terminal(self, frame: End | Cancel | Error) -> None:
        """Send a ring-circling END, CANCEL or ERROR, remembered for a replay (it may die with the successor)."""
        self._failover.remember(frame)
        with contextlib.suppress(SuccessorLost):  # kept for the replay, as above
            await self._links.send(frame)

    def boundary(
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
        """A boundary in the encoding the successor takes (f32 when it has not said)."""
        hello = self._links.successor_hello
        dtype = choose_dtype(self.dtype, hello) if hello else BoundaryDType.F32
        make = functools.partial(
            Boundary.from_array, request_id, pos, hidden, final=final, latest_token=latest_token, drafts=drafts, row=row
        )
        try:
            return make(dtype=dtype)
        except ProtocolError:  # a value beyond f16's range (gemma's BOS row reaches 8e4): send this one exact
            return make()

    async def end(self, state: RequestState, reason: EndReason, latest: int) -> None:
        """The request ends here (the last rank decided it): END round the ring."""
        # The START's parameters hash echoed (every node checked it against the parameters), and this rank's output
        # chain head when it records (the head its receipt signs): issue 24, N8 and N9.
        head = self._observer.head(state.request_id)
        frame = End(
            state.request_id,
            reason,
            state.prompt_len,
            state.generated,
            self.rank,
            latest,
            state.start.params_hash,
            head,
        )
        await self._requests.finish(state, REASONS[reason])
        await self.terminal(frame)

    async def error(self, state: RequestState, code: ErrorCode, message: str) -> None:
        """The request fails here: its client hears of it, and the ring with an ERROR."""
        self._requests.errors += 1
        await self._requests.finish(state, "error", message, code)
        try:
            await self.terminal(Error.truncating(code, message, self.rank, state.request_id))
        except RingError as exc:
            log.warning("rank %d: could not report an error for request %x: %s", self.rank, state.request_id, exc)

    @asynccontextmanager
    async def fails(self, request_id: int) -> AsyncIterator[None]:
        """Whatever stops request ``request_id`` inside the block fails it with its :func:`error_code`: round the
        ring, or, without a successor link (RingError), here only (the ring hears of the loss from the failover
        timers). A request that ended meanwhile has nothing left to fail. Nothing raises out of it (issue 24, N3):
        what a neighbour's frame sets off is its request's failure, never its link's or the node's. (A malformed
        frame is refused before: the link manager's decoder closes the link.)"""
        try:
            yield
        except Exception as exc:
            code = error_code(exc)
            state = self._requests.get(request_id)
            if code is ErrorCode.INTERNAL:
                log.exception("rank %d: request %x failed", self.rank, request_id)
            elif code in (ErrorCode.LINK_LOST, ErrorCode.PROTOCOL) or state is None:
                log.warning("rank %d: request %x: %s", self.rank, request_id, exc)
            if state is None or state.done:
                return
            try:
                if code is ErrorCode.LINK_LOST:
                    self._requests.errors += 1
                    await self._requests.finish(state, "error", str(exc), code)
                else:
                    await self.error(state, code, str(exc))
            except Exception:  # freeing the sequence failed (llama.cpp): the request is over here all the same
                log.exception("rank %d: request %x: failing it failed", self.rank, request_id)
