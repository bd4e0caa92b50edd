"""What a serving node reports to the market: demand, witness receipts and credit (docs/market.md § Credit).

A :class:`Ledger` lives as long as one held window. It is fed by the node's lossless request-end listener
(:class:`~kvasir.ring.events.EndListeners`), never by the observers' event hub, which drops events under load: a
dropped end would be a lost receipt, and receipts are what the market credits. :meth:`Ledger.report` sends what
piled up; a failure keeps it for the next report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvasir.core.errors import KvasirError, MarketError
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import (
    MAX_RECEIPTS,
    MAX_REPORT_REQUESTS,
    MAX_REPORT_TOKENS,
    CoverageEntry,
    CreditReport,
    DemandReport,
    Lease,
    Receipt,
    ReceiptBatch,
)
from kvasir.ring.events import RequestEnded

log = logging.getLogger("kvasir.enroll")

#: How a request ends when the ring completed it (an END went round), as RequestEnded names it.
COMPLETED = frozenset({"eog", "max_tokens", "stop"})
#: Receipts kept for the market at most (while it cannot be reached), and how often to re-report unconfirmed work.
MAX_PENDING_RECEIPTS = 4096
CREDIT_RETRY_S = 5.0


def exit_rank(entry_rank: object, size: int) -> int | None:
    """The rank that witnesses a request besides its entry (pure): the last rank, which samples every token, or
    rank 0 (which embeds every token) for a request that entered at the last rank; None in a one-window ring."""
    if not isinstance(entry_rank, int) or size < 2 or not 0 <= entry_rank < size:
        return None
    return size - 1 if entry_rank != size - 1 else 0


class Ledger:
    """Demand, receipts and credit of the node ``node_id`` while it holds one window."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        #: Node id serving each rank (by the latest coverage map), named in the receipts this node signs.
        self.holders: list[str] = []
        self.receipts: list[Receipt] = []
        #: Requests that entered here and the tokens they generated, not yet reported.
        self.requests = 0
        self.tokens = 0
        self._credit_lease: str | None = None
        self._credit_base = 0  # the node's token count when the current lease began
        self._reported_tokens = 0
        self._credit_sent = 0  # cumulative tokens last reported under the current lease
        self._credited = 0  # what the market credited for it (receipts confirm with a lag)
        self._credit_retry_at = 0.0

    def see_holders(self, coverage: Sequence[CoverageEntry], rank: int) -> None:
        holders = {c.rank: (c.holder or "") if c.serving else "" for c in coverage}
        holders[rank] = self.node_id
        self.holders = [holders.get(r, "") for r in range(max(holders) + 1)]

    def request_ended(self, ended: RequestEnded, rank: int, size: int) -> None:
        """A request ended at this node (rank ``rank`` of ``size``): count it as demand if it entered here, and keep
        a receipt if this node witnesses it (its entry, or its exit witness naming the entry node)."""
        entry_rank = ended.entry_rank
        if entry_rank is None or (entry_rank != rank and exit_rank(entry_rank, size) != rank):
            return
        if ended.reason not in COMPLETED:
            # Only a request the ring completed (END, its chain heads all checked: issue 24, N9) has a receipt from
            # every window it went through; a failed or cancelled one earns nobody anything.
            return
        generated = min(ended.generated, MAX_REPORT_TOKENS)
        entry: str | None = None
        if entry_rank == rank:
            self.requests += 1
            self.tokens += generated
        else:
            entry = self.holders[entry_rank] if entry_rank < len(self.holders) else ""
            if not entry:
                return  # nobody known at the entry's rank: no receipt to pair with
        if generated > 0:
            self.receipts.append(Receipt(ended.request, generated, tuple(self.holders), entry))
            del self.receipts[:-MAX_PENDING_RECEIPTS]  # bounded while the market is away

    async def report(self, market: MarketClient, lease: Lease, tokens: int) -> None:
        """Report demand, send receipts and credit ``tokens`` (the node's count of tokens served) since the
        lease began; a failure is logged and everything is retried next time."""
        if lease.lease_id != self._credit_lease:  # credit reports are cumulative per lease
            self._credit_lease, self._credit_base = lease.lease_id, self._reported_tokens
            self._credit_sent = self._credited = 0
        requests, demand = min(self.requests, MAX_REPORT_REQUESTS), min(self.tokens, MAX_REPORT_TOKENS)
        try:
            if requests or demand:
                await market.demand(DemandReport(lease.model, requests, demand))
                self.requests -= requests
                self.tokens -= demand
            while self.receipts:
                batch = self.receipts[:MAX_RECEIPTS]
                await market.receipts(ReceiptBatch(lease.model, self.node_id, tuple(batch)))
                del self.receipts[: len(batch)]
            served = tokens - self._credit_base
            now = time.monotonic()
            # Report new work at once; work not yet confirmed (receipts lag) again every CREDIT_RETRY_S.
            if served > self._credit_sent or (served > self._credited and now >= self._credit_retry_at):
                report = CreditReport(lease.model, lease.start, lease.end, self.node_id, lease.lease_id, served)
                reply = await market.credit(report)
                self._credit_sent, self._reported_tokens = served, tokens
                self._credited = int(reply.get("tokens") or 0)
                self._credit_retry_at = now + CREDIT_RETRY_S
        except (MarketError, KvasirError) as exc:
            log.info("node %s: report failed: %s", self.node_id, exc)
