"""Demand: how many paid tokens each model settled lately, which raises the rewards of its windows. Only settlement
(kvasir.market.server.credit) adds to it: no holder's report counts (security N7)."""

from __future__ import annotations

import sqlite3
from contextlib import suppress
from typing import Any

from kvasir.core.errors import MarketError
from kvasir.market.records import MAX_REWARD
from kvasir.market.server import catalog
from kvasir.market.server.sqlite import Database, StorePart

#: Demand older than this no longer raises rewards.
DEMAND_HORIZON_S = 600.0
#: Recent tokens that double a model's rewards.
DEMAND_SCALE_TOKENS = 1000.0
#: Demand is summed per bucket of this many seconds: one row per model and bucket, whoever reports.
DEMAND_BUCKET_S = 60
#: Tokens one bucket counts at most (a sum that never nears 2^63, whatever the reports).
BUCKET_MAX_TOKENS = 10**9
BUCKET_MAX_REQUESTS = 10**7
#: The most demand can raise rewards.
MAX_MULTIPLIER = 1000.0


def demand_multiplier(recent_tokens: int) -> float:
    """How much recent demand raises a model's rewards (pure): 1 at no demand, +1 per DEMAND_SCALE_TOKENS, at most
    MAX_MULTIPLIER."""
    return min(1.0 + recent_tokens / DEMAND_SCALE_TOKENS, MAX_MULTIPLIER)


def reward_of(weight: float, multiplier: float) -> float:
    return min(weight * multiplier, MAX_REWARD)


def bucket(ts: float) -> int:
    return int(ts // DEMAND_BUCKET_S)


def recent_tokens(db: sqlite3.Connection, model: str, now: float) -> int:
    """Tokens ``model`` served within the demand horizon before ``now``."""
    row = db.execute(
        "SELECT COALESCE(SUM(tokens), 0) FROM demand_buckets WHERE model = ? AND bucket >= ?",
        (model, bucket(now - DEMAND_HORIZON_S)),
    ).fetchone()
    return int(row[0])


def add_settled(db: sqlite3.Connection, model: str, tokens: int, now: float) -> None:
    """One settled request of ``tokens`` paid tokens, into the current bucket (sums clamped); drop old buckets."""
    db.execute(
        "INSERT INTO demand_buckets (model, bucket, requests, tokens) VALUES (?, ?, 1, ?)"
        " ON CONFLICT (model, bucket) DO UPDATE SET requests = MIN(requests + 1, ?),"
        " tokens = MIN(tokens + excluded.tokens, ?)",
        (model, bucket(now), tokens, BUCKET_MAX_REQUESTS, BUCKET_MAX_TOKENS),
    )
    db.execute("DELETE FROM demand_buckets WHERE bucket < ?", (bucket(now - DEMAND_HORIZON_S),))


class DemandBook(StorePart):
    """The demand summary (``GET /v1/demand``)."""

    def __init__(self, base: Database, models: catalog.Catalog) -> None:
        super().__init__(base)
        self.catalog = models

    def demand(self) -> dict[str, Any]:
        """Recent demand per model, with each window's reward (window lists stop at MAX_COVERAGE_WINDOWS in all)."""
        now = self.clock()
        out = []
        shown = 0
        for m in self.catalog.models():
            row = self.db.execute(
                "SELECT COALESCE(SUM(requests), 0), COALESCE(SUM(tokens), 0) FROM demand_buckets"
                " WHERE model = ? AND bucket >= ?",
                (m.sha256, bucket(now - DEMAND_HORIZON_S)),
            ).fetchone()
            mult = demand_multiplier(int(row[1]))
            rewards = []
            with suppress(MarketError):  # a model without a manifest yet
                windows = self.catalog.manifest(m.sha256).windows
                if shown + len(windows) <= catalog.MAX_COVERAGE_WINDOWS:
                    shown += len(windows)
                    rewards = [{"layers": [w.start, w.end], "reward": reward_of(w.weight, mult)} for w in windows]
            out.append(
                {
                    "model": m.sha256,
                    "name": m.name,
                    "requests": int(row[0]),
                    "tokens": int(row[1]),
                    "multiplier": mult,
                    "windows": rewards,
                }
            )
        return {"horizon_s": DEMAND_HORIZON_S, "models": out}
