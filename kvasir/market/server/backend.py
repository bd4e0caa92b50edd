"""The seam between the market's routes and its state: what :class:`~kvasir.market.server.service.MarketService`
needs from a store, and nothing it does not.

One engine is built: :class:`kvasir.market.server.store.MarketStore` (SQLite in WAL mode, one connection). Another
(PostgreSQL, docs/scaling.md) would implement the same methods with the same contracts; the service never imports
an engine. Every method is synchronous and is one transaction; the service runs them in worker threads, at most
``concurrency`` at once.

Contracts an engine must keep (tests/test_market*.py check them through the SQLite store):

- ``claim`` is one atomic compare-and-set: a window with a live lease of another node (or of another key with the
  same fingerprint) is refused with MarketError 409 ``window_taken`` unless that lease is overdue (neither fresh nor
  vouched for, :mod:`~kvasir.market.server.standing`): then the claim takes it and the overdue key is refused on the
  model (403 ``idle_cooldown``) for a while; two callers never both get a lease on one window, whatever the
  interleaving.
- ``vouch`` confirms the lease of the window before the voucher's when both serve and their keys differ (409
  ``not_holder``, ``not_serving``, ``own_key``, ``no_neighbour`` otherwise).
- ``renew``, ``release`` and ``credit`` act only on the caller's own live lease (409 ``lease_expired`` or
  ``foreign_lease`` otherwise).
- A published model record is immutable (409 ``model_immutable``); a manifest replaces the last one and drops
  leases on windows it no longer has.
- Demand, receipts, credit and every reply are bounded (docs/market.md § Trust).
- ``withdraw`` is idempotent per proof id: it zeroes the suspect's credit on the window, revokes its lease there
  and refuses its claims on the model (403 ``banned``) until the ban ends; ``claim`` checks the ban.
- After a downtime, leases that were live when the store last wrote get back the time they had left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class MarketBackend(Protocol):
    """A market store engine. ``holder_key``: the signing key's text; ``node_id`` in a request is its fingerprint."""

    @property
    def clock(self) -> Callable[[], float]:
        """Unix seconds; the service checks request times and ticket expiries against it."""
        ...

    @property
    def concurrency(self) -> int:
        """How many calls may run at once (1 for a single SQLite connection; a pool's size for a server engine)."""
        ...

    def close(self) -> None: ...

    # Operator state.
    def get_meta(self, key: str) -> str | None: ...
    def set_meta(self, key: str, value: str) -> None: ...
    def put_model(self, model: ModelRecord) -> bool: ...
    def models(self) -> list[ModelRecord]: ...
    def model(self, sha256: str) -> ModelRecord: ...
    def put_manifest(self, manifest: ManifestRecord) -> None: ...
    def manifest(self, model: str) -> ManifestRecord: ...
    def window_of(self, model: str, start: int, end: int) -> tuple[ManifestRecord, int]: ...

    # Leases.
    def coverage(self, model: str | None = None) -> dict[str, Any]: ...
    def claim(self, req: ClaimRequest, holder_key: str | None = None) -> Lease: ...
    def renew(self, req: ClaimRequest, holder_key: str | None = None) -> Lease: ...
    def release(self, ref: LeaseRef, holder_key: str | None = None) -> None: ...
    def vouch(self, vouch: LinkVouch, holder_key: str | None = None) -> dict[str, Any]: ...

    # Admission (kvasir.market.work): keys that paid their proof of work.
    def admitted(self, holder_key: str) -> bool: ...
    def admit(self, holder_key: str, bits: int) -> None: ...

    # Accounts (micro-credits, keyed by public key text), demand and the ledger (docs/market.md § Credit).
    def fund(self, key: str, micro: int) -> dict[str, Any]: ...
    def account(self, key: str) -> dict[str, Any]: ...
    def demand(self) -> dict[str, Any]: ...
    def add_receipts(self, batch: ReceiptBatch, holder_key: str | None, market_key: str) -> dict[str, Any]: ...
    def credit(self, report: CreditReport, holder_key: str | None = None) -> dict[str, Any]: ...
    def ledger(self) -> dict[str, Any]: ...

    # Fraud proofs (docs/market.md § Fraud): the service checks the proof; the store acts on it.
    def holds_lease(self, node_id: str, model: str) -> bool: ...
    def withdraw(self, fraud: FraudRecord) -> dict[str, Any]: ...
    def frauds(self) -> dict[str, Any]: ...
