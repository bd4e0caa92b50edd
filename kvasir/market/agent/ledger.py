"""What a serving node reports to the market: its receipts of paid requests (docs/market.md § Credit).

A :class:`Ledger` lives as long as one held window. It is fed by the node's lossless request-end listener
(:class:`~kvasir.ring.events.EndListeners`), never by the observers' event hub, which drops events under load: a
dropped end would be a lost receipt, and receipts are what the market settles. Every window of the ring sends a
receipt for each request that carried a client's authorisation (START's CLIENT_AUTH); the market moves the
client's credit to the windows once every window's holder has. Unpaid requests earn nothing, and the node reports
no demand and claims no credit of its own: the market derives both from settled client traffic.
:meth:`Ledger.report` sends what piled up; a failure keeps it for the next report.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvasir.core.errors import KvasirError, MarketError
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import MAX_RECEIPTS, MAX_REPORT_TOKENS, CoverageEntry, Lease, Receipt, ReceiptBatch
from kvasir.ring.events import RequestEnded

log = logging.getLogger("kvasir.enroll")

#: How a request ends when the ring completed it (an END went round), as RequestEnded names it.
COMPLETED = frozenset({"eog", "max_tokens", "stop"})
#: Receipts kept for the market at most (while it cannot be reached).
MAX_PENDING_RECEIPTS = 4096


class Ledger:
    """Receipts of the node ``node_id`` while it holds one window."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        #: Node id serving each rank (by the latest coverage map), named in the receipts this node signs.
        self.holders: list[str] = []
        self.receipts: list[Receipt] = []
        #: Receipts the market took (it answers how many were new).
        self.sent = 0

    def see_holders(self, coverage: Sequence[CoverageEntry], rank: int) -> None:
        holders = {c.rank: (c.holder or "") if c.serving else "" for c in coverage}
        holders[rank] = self.node_id
        self.holders = [holders.get(r, "") for r in range(max(holders) + 1)]

    def request_ended(self, ended: RequestEnded, rank: int, size: int) -> None:
        """A request ended at this node (rank ``rank`` of a ring of ``size``): keep a receipt if a client paid for
        it and tokens passed here."""
        if ended.client_auth is None or ended.generated <= 0 or len(self.holders) != size:
            return
        if ended.reason not in COMPLETED:
            # Only a request the ring completed (END, its chain heads all checked: issue 24, N9) has a receipt from
            # every window it went through; a failed or cancelled one earns nobody anything.
            return
        tokens = min(ended.generated, MAX_REPORT_TOKENS)
        self.receipts.append(Receipt(ended.request, tokens, tuple(self.holders), client_auth=ended.client_auth))
        del self.receipts[:-MAX_PENDING_RECEIPTS]  # bounded while the market is away

    async def report(self, market: MarketClient, lease: Lease) -> None:
        """Send the receipts that piled up; a failure is logged and they are retried next time."""
        try:
            while self.receipts:
                batch = self.receipts[:MAX_RECEIPTS]
                await market.receipts(ReceiptBatch(lease.model, self.node_id, tuple(batch)))
                del self.receipts[: len(batch)]
                self.sent += len(batch)
        except (MarketError, KvasirError) as exc:
            log.info("node %s: report failed: %s", self.node_id, exc)
