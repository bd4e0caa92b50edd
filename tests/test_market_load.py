"""A small, fast version of bench/market_load.py: 50 simulated enrolling nodes (each its own key, the real client,
real HTTP on loopback, real SQLite) race for 10 windows while holders renew, poll and crash. Never two holders of
one window, every claim answered, the database agrees with what the nodes were told; and the same checks catch a
market without the claim's compare-and-set."""

from __future__ import annotations

from pathlib import Path

import trio

from kvasir.core.identity import Identity
from kvasir.market.records import ClaimRequest, Lease
from kvasir.market.server.backend import MarketBackend
from kvasir.market.server.gate import ClaimGate
from kvasir.market.server.ratelimit import ClaimLimits
from kvasir.market.server.service import serve_market
from kvasir.market.server.store import MarketStore
from tests.harness.marketload import (
    Grant,
    LoadConfig,
    Tally,
    double_holders,
    drive,
    publish,
    store_disagreements,
)

OPERATOR = Identity.generate()
# Everyone starts within half a second on a map of 10 windows: spares race for the same free windows.
SMALL = LoadConfig(nodes=50, models=2, windows=5, duration_s=6.0, ramp_s=0.5, lease_s=2.0, poll_s=0.25,
                   spare_poll_s=0.5, drop_p=0.2, connections=16)  # fmt: skip
WINDOWS = SMALL.models * SMALL.windows


def unlimited(market: Identity) -> ClaimGate:
    """Fifty simulated machines share one loopback address here: no per-address claim limit (security N6)."""
    return ClaimGate(market.public.to_text(), limits=ClaimLimits.off())


async def _load(db: Path, store: MarketStore, cfg: LoadConfig) -> Tally:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                db, "127.0.0.1", 0, store=store, identity=OPERATOR, gate=unlimited, task_status=task_status
            )
        )
        url = f"http://127.0.0.1:{port}"
        await publish(url, OPERATOR, cfg.windows, cfg.models)
        tally = await drive(url, cfg)
        nursery.cancel_scope.cancel()
    return tally


async def test_fifty_nodes_never_share_a_window(tmp_path: Path) -> None:
    db = tmp_path / "m.sqlite"
    store = MarketStore(db)
    assert isinstance(store, MarketBackend)
    try:
        tally = await _load(db, store, SMALL)
        now = store.clock()
    finally:
        store.close()
    assert tally.errors == []  # every claim, renewal and poll got an answer (200, or a 409 refusal)
    assert double_holders(tally.grants) == []
    assert store_disagreements(db, tally.grants, now) == []
    assert tally.claims_won >= WINDOWS and len(tally.claim_s) == tally.claims_won + tally.claims_taken
    assert tally.claims_taken > 0, "no two spares raced for one window: the load tested nothing"
    assert tally.drops > 0 and len({(g.model, g.window) for g in tally.grants}) == WINDOWS
    holders: dict[tuple[str, int], set[str]] = {}
    for g in tally.grants:
        holders.setdefault((g.model, g.window), set()).add(g.node)
    handed_over = [w for w, nodes in holders.items() if len(nodes) > 1]
    assert handed_over, "no window changed hands after a holder went silent"
    assert tally.renew_s and tally.poll_s and tally.map_s


class _NoCompareAndSet(MarketStore):
    """A broken engine: a claim always wins (it forgets the window's live holder first)."""

    def claim(self, req: ClaimRequest, holder_key: str | None = None) -> Lease:
        with self._write() as db:
            db.execute(
                'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ?', (req.model, req.start, req.end)
            )
        return super().claim(req, holder_key)


async def test_the_checks_catch_a_market_without_compare_and_set(tmp_path: Path) -> None:
    db = tmp_path / "m.sqlite"
    store = _NoCompareAndSet(db)
    try:
        tally = await _load(db, store, SMALL)
    finally:
        store.close()
    assert tally.claims_taken == 0  # nothing is ever refused
    assert double_holders(tally.grants), "two nodes held one window and the check did not see it"


def test_double_holders_is_exact() -> None:
    a = Grant("m", 0, "a", "l1", 100.0, 110.0)
    others = [Grant("m", 0, "b", "l2", 110.0, 120.0), Grant("m", 1, "c", "l3", 105.0, 115.0)]
    assert double_holders([a, *others, Grant("n", 0, "e", "l5", 105.0, 115.0)]) == []
    late = Grant("m", 0, "b", "l2", 109.9, 120.0)
    assert double_holders([late, a]) == [(a, late)]
    inside = Grant("m", 0, "c", "l3", 101.0, 102.0)  # granted and gone while a still held the window
    assert double_holders([a, inside, Grant("m", 0, "d", "l4", 110.0, 111.0)]) == [(a, inside)]
