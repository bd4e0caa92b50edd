"""One window lease of a self-enrolling node: claim, renewal, the ticket and grants it carries, release.

:meth:`LeaseKeeper.keep` renews every third of the lease's time (``fetching`` until the node has an endpoint, then
``serving``) and ends the way a lost lease must: by raising :class:`LeaseTaken` out of its own task, which cancels
the session it runs in. A lease that merely expired with nobody else taking the window is claimed again at once.
"""

from __future__ import annotations

import logging

import attrs
import trio

from kvasir.core.errors import KvasirError, MarketError
from kvasir.market.agent.admission import admit
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import ClaimRequest, CoverageEntry, Lease, LeaseRef

log = logging.getLogger("kvasir.enroll")


class LeaseLost(KvasirError):
    """The node gives up its window: it cannot use it (no source, a record not signed by the operator), or it no
    longer holds it (:class:`LeaseTaken`)."""


class LeaseTaken(LeaseLost):
    """The market says the window is another node's or gone: there is nothing to release."""


class LeaseKeeper:
    """The lease on one window (``lease``: None before the claim and after the release)."""

    def __init__(self, market: MarketClient, node_id: str, lease_s: float) -> None:
        self.market = market
        self.node_id = node_id
        self.lease_s = lease_s
        self.lease: Lease | None = None
        #: Where the node serves (``host:port`` or ``relay:URL``); None while it fetches and loads.
        self.endpoint: str | None = None

    async def claim(self, window: CoverageEntry) -> Lease:
        """Claim ``window`` as ``fetching`` (MarketError 409 when another node was faster). A market that asks work
        of new keys (403 ``admission_required``) gets it, once, before the claim is made again."""
        req = ClaimRequest(window.model, window.start, window.end, self.node_id, self.lease_s)
        try:
            self.lease = await self.market.claim(req)
        except MarketError as exc:
            if exc.code != "admission_required":
                raise
            await admit(self.market)
            self.lease = await self.market.claim(req)
        return self.lease

    async def renew(self) -> None:
        lease = self.lease
        assert lease is not None
        req = ClaimRequest(
            lease.model,
            lease.start,
            lease.end,
            self.node_id,
            self.lease_s,
            endpoint=self.endpoint,
            state="serving" if self.endpoint else "fetching",
            lease_id=lease.lease_id,
        )
        try:
            self.lease = await self.market.renew(req)
        except MarketError as exc:
            if exc.code != "lease_expired":
                raise
            # Nobody took it meanwhile: claim it again (keeps serving without a gap).
            self.lease = await self.market.claim(attrs.evolve(req, lease_id=None))

    async def keep(self) -> None:
        """Renew until the market says the window is another's or gone (then LeaseTaken); other failures are
        retried at the next renewal, since the lease may still be ours. Returns once the lease was released (a
        shutdown releases it before it cancels this task)."""
        while True:
            await trio.sleep(self.lease_s / 3)
            if self.lease is None:
                return
            try:
                await self.renew()
            except MarketError as exc:
                if exc.status in (404, 409):
                    raise LeaseTaken(f"lost window: {exc}") from None
                log.warning("node %s: renewing the lease failed (will retry): %s", self.node_id, exc)
            except KvasirError as exc:  # a malformed reply
                log.warning("node %s: renewing the lease failed (will retry): %s", self.node_id, exc)

    async def release(self) -> None:
        """Hand the window back (bounded in time; a failure is logged: the lease then runs out by itself)."""
        lease, self.lease, self.endpoint = self.lease, None, None
        if lease is None:
            return
        with trio.move_on_after(5):
            try:
                await self.market.release(LeaseRef(lease.model, lease.start, lease.end, self.node_id, lease.lease_id))
                log.warning("node %s released window %d:%d", self.node_id, lease.start, lease.end)
            except KvasirError as exc:
                log.warning("node %s: release failed: %s", self.node_id, exc)

    def forget(self) -> None:
        """The lease is lost (another node's now): nothing to release."""
        self.lease, self.endpoint = None, None

    def ticket(self) -> bytes:
        """The current window ticket (renewed with the lease), for the neighbour the node dials."""
        lease = self.lease
        return b"" if lease is None or lease.ticket is None else lease.ticket.encode()

    def grants(self) -> tuple[str, ...]:
        """The relay edge grants the market signed with the last renewal."""
        return () if self.lease is None else self.lease.grants
