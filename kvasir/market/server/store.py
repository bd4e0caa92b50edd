"""The market's state in SQLite (WAL): models, rank manifests, leases, demand and the contribution ledger.

The SQLite engine behind :class:`kvasir.market.server.backend.MarketBackend` (the contracts are there). Every
method is synchronous and runs one transaction (``BEGIN IMMEDIATE`` for writes, so a claim's read and write
are one atomic compare-and-set: two nodes never hold one window). The service calls them from worker threads
through a limiter of one, so the single connection is never used concurrently. Time is market time
(:mod:`~kvasir.market.server.clock`: immune to steps of the host's clock), or ``clock`` where tests move it.

:class:`MarketStore` is the engine's face; each concern is a part on the one shared database
(:mod:`~kvasir.market.server.sqlite`): the catalog of models and manifests (:mod:`~kvasir.market.server.catalog`),
leases and the coverage map (:mod:`~kvasir.market.server.leases`), admitted keys
(:mod:`~kvasir.market.server.admission`), demand (:mod:`~kvasir.market.server.demand`),
client and holder accounts (:mod:`~kvasir.market.server.accounts`), receipts, settlement and the ledger
(:mod:`~kvasir.market.server.credit`), and fraud withdrawals and bans
(:mod:`~kvasir.market.server.withdrawals`).
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from kvasir.market.records import (
    ClaimRequest,
    CreditReport,
    FraudRecord,
    Lease,
    LeaseRef,
    LinkVouch,
    ManifestRecord,
    ModelRecord,
    ReceiptBatch,
)
from kvasir.market.server.accounts import AccountBook
from kvasir.market.server.admission import Admissions
from kvasir.market.server.catalog import Catalog
from kvasir.market.server.credit import CreditBook
from kvasir.market.server.demand import BUCKET_MAX_TOKENS, DemandBook, demand_multiplier
from kvasir.market.server.leases import LeaseBook
from kvasir.market.server.sqlite import Database
from kvasir.market.server.standing import LeaseRules
from kvasir.market.server.withdrawals import Withdrawals

__all__ = ["BUCKET_MAX_TOKENS", "MarketStore", "demand_multiplier"]


class MarketStore:
    #: One connection: the service never runs two calls at once.
    concurrency = 1

    def __init__(
        self,
        path: Path | str,
        *,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] = time.time,
        rules: LeaseRules | None = None,
    ) -> None:
        self.base = Database(path, clock=clock, wall=wall)
        #: Market time (kvasir.market.server.clock): the host's ``wall`` clock read at start, then monotonic.
        self.clock = self.base.clock
        #: The connection (tests read the tables directly).
        self.db: sqlite3.Connection = self.base.db
        self.catalog = Catalog(self.base)
        self.leases = LeaseBook(self.base, self.catalog, rules)
        self.admissions = Admissions(self.base)
        self.demand_book = DemandBook(self.base, self.catalog)
        self.credits = CreditBook(self.base, self.catalog, self.leases)
        self.accounts = AccountBook(self.base)
        self.withdrawals = Withdrawals(self.base, self.catalog)

    def close(self) -> None:
        self.base.close()

    def _write(self) -> AbstractContextManager[sqlite3.Connection]:
        return self.base.write()

    # Operator state.

    def get_meta(self, key: str) -> str | None:
        return self.base.get_meta(key)

    def set_meta(self, key: str, value: str) -> None:
        self.base.set_meta(key, value)

    def put_model(self, model: ModelRecord) -> bool:
        return self.catalog.put_model(model)

    def models(self) -> list[ModelRecord]:
        return self.catalog.models()

    def model(self, sha256: str) -> ModelRecord:
        return self.catalog.model(sha256)

    def put_manifest(self, manifest: ManifestRecord) -> None:
        self.catalog.put_manifest(manifest)

    def manifest(self, model: str) -> ManifestRecord:
        return self.catalog.manifest(model)

    def window_of(self, model: str, start: int, end: int) -> tuple[ManifestRecord, int]:
        return self.catalog.window(model, start, end)

    # Leases.

    def coverage(self, model: str | None = None) -> dict[str, Any]:
        return self.leases.coverage(model)

    def claim(self, req: ClaimRequest, holder_key: str | None = None) -> Lease:
        return self.leases.claim(req, holder_key)

    def renew(self, req: ClaimRequest, holder_key: str | None = None) -> Lease:
        return self.leases.renew(req, holder_key)

    def release(self, ref: LeaseRef, holder_key: str | None = None) -> None:
        self.leases.release(ref, holder_key)

    def holds_lease(self, node_id: str, model: str) -> bool:
        return self.leases.holds_lease(node_id, model)

    def vouch(self, vouch: LinkVouch, holder_key: str | None = None) -> dict[str, Any]:
        return self.leases.vouch(vouch, holder_key)

    def admitted(self, holder_key: str) -> bool:
        return self.admissions.admitted(holder_key)

    def admit(self, holder_key: str, bits: int) -> None:
        self.admissions.admit(holder_key, bits)

    def holder_key(self, model: str, start: int, end: int) -> str | None:
        return self.leases.holder_key(model, start, end)

    # Accounts, demand and the ledger.

    def fund(self, key: str, micro: int) -> dict[str, Any]:
        return self.accounts.fund(key, micro)

    def account(self, key: str) -> dict[str, Any]:
        return self.accounts.account(key)

    def demand(self) -> dict[str, Any]:
        return self.demand_book.demand()

    def add_receipts(self, batch: ReceiptBatch, holder_key: str | None, market_key: str) -> dict[str, Any]:
        return self.credits.add_receipts(batch, holder_key, market_key)

    def credit(self, report: CreditReport, holder_key: str | None = None) -> dict[str, Any]:
        return self.credits.credit(report, holder_key)

    def ledger(self) -> dict[str, Any]:
        return self.credits.ledger()

    # Fraud.

    def withdraw(self, fraud: FraudRecord) -> dict[str, Any]:
        return self.withdrawals.withdraw(fraud)

    def frauds(self) -> dict[str, Any]:
        return self.withdrawals.frauds()
