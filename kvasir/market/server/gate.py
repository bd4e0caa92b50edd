"""Who may claim a window (security N6): claims rate-limited per key and per address group, and on an open market
a price per new key, its proof of work (:mod:`kvasir.market.work`). The service asks; the decisions are here."""

from __future__ import annotations

import math
from typing import Any

from kvasir.core.errors import MarketError
from kvasir.market.server.ratelimit import ClaimLimits, RateLimiter
from kvasir.market.work import MAX_WORK_BITS, work_ok


class RateLimited(MarketError):
    """429: try again in ``retry_after`` seconds (the reply's ``retry-after`` header)."""

    def __init__(self, code: str, message: str, retry_after: float) -> None:
        super().__init__(429, code, message)
        self.retry_after = max(1, math.ceil(retry_after))


class ClaimGate:
    """``market_key``: the market's key text (work is bound to it); ``work_bits``: the work a new key must show
    before its first claim (0: none); ``limits``: the rates (:class:`~kvasir.market.server.ratelimit.ClaimLimits`)."""

    def __init__(self, market_key: str, work_bits: int = 0, limits: ClaimLimits | None = None) -> None:
        if not 0 <= work_bits <= MAX_WORK_BITS:
            raise ValueError(f"work bits must be 0..{MAX_WORK_BITS}")
        limits = limits or ClaimLimits()
        self.market_key = market_key
        self.work_bits = work_bits
        self.keys = RateLimiter(limits.per_key)
        self.groups = RateLimiter(limits.per_group)
        self.admissions = RateLimiter(limits.admissions_per_group)

    def info(self) -> dict[str, Any]:
        """``GET /v1/admission``: what a new key must show."""
        return {"market": self.market_key, "work_bits": self.work_bits}

    def count_claim(self, key: str, group: str, now: float) -> None:
        """Count a claim of ``key`` from address ``group``, or RateLimited (nothing counted) if either is spent."""
        wait = max(self.keys.wait(key, now), self.groups.wait(group, now))
        if wait > 0:
            raise RateLimited("too_many_claims", f"too many claims from this key or address; retry in {wait:.0f} s",
                              wait)  # fmt: skip
        self.keys.take(key, now)
        self.groups.take(group, now)

    def count_admission(self, group: str, now: float) -> None:
        wait = self.admissions.wait(group, now)
        if wait > 0:
            raise RateLimited("too_many_admissions", f"too many new keys from this address; retry in {wait:.0f} s",
                              wait)  # fmt: skip
        self.admissions.take(group, now)

    def check_work(self, key: str, nonce: str) -> None:
        if not work_ok(self.market_key, key, nonce, self.work_bits):
            raise MarketError(422, "bad_work", f"the nonce is not {self.work_bits} bits of work for this key here")

    def require_admission(self, admitted: bool) -> None:
        if self.work_bits > 0 and not admitted:
            raise MarketError(
                403, "admission_required", f"this market asks {self.work_bits} bits of work of a new key before its "
                "first claim (GET /v1/admission, then POST /v1/admission)",
            )  # fmt: skip
