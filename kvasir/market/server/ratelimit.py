"""Token buckets for the market's claims and admissions, per key and per address group (security N6).

:func:`take` is the pure rule (a bucket and the time in, the new bucket or the wait out); :class:`RateLimiter`
keeps one bucket per name, in memory, bounded (the oldest names go first: a flood of names cannot grow it). The
service answers a refusal with 429 and ``retry-after`` (docs/protocol.md § Market API).
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Rate:
    """``burst`` actions at once, then one every ``every_s`` seconds."""

    burst: float
    every_s: float


@attrs.frozen
class Bucket:
    tokens: float
    at: float


def take(bucket: Bucket | None, rate: Rate, now: float) -> tuple[Bucket, float]:
    """``(bucket after one action, 0.0)`` when ``rate`` allows one at ``now``; else ``(bucket, seconds to wait)``
    (the bucket as it stands, nothing taken)."""
    if bucket is None:
        tokens = rate.burst
    else:
        refill = (now - bucket.at) / rate.every_s if rate.every_s > 0 else rate.burst
        tokens = min(rate.burst, bucket.tokens + max(0.0, refill))
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now), 0.0
    return Bucket(tokens, now), (1.0 - tokens) * rate.every_s


@attrs.frozen
class ClaimLimits:
    """The market's limits: claims per key, claims per address group (IPv4 /24, IPv6 /64), admissions per
    address group. None: no limit of that kind."""

    per_key: Rate | None = Rate(burst=6, every_s=10.0)
    per_group: Rate | None = Rate(burst=30, every_s=2.0)
    admissions_per_group: Rate | None = Rate(burst=8, every_s=60.0)

    @classmethod
    def off(cls) -> ClaimLimits:
        return cls(None, None, None)


class RateLimiter:
    """One bucket per name at ``rate``; at most ``max_names`` remembered."""

    def __init__(self, rate: Rate | None, max_names: int = 65_536) -> None:
        self.rate = rate
        self.max_names = max_names
        self.buckets: dict[str, Bucket] = {}

    def wait(self, name: str, now: float) -> float:
        """Seconds until ``name`` may act (0: now); takes nothing."""
        if self.rate is None:
            return 0.0
        return take(self.buckets.get(name), self.rate, now)[1]

    def take(self, name: str, now: float) -> None:
        """Count one action of ``name`` (call after :meth:`wait` said 0)."""
        if self.rate is None:
            return
        bucket, _ = take(self.buckets.pop(name, None), self.rate, now)
        self.buckets[name] = bucket  # re-inserted: the dict's order is least recently used first
        while len(self.buckets) > self.max_names:
            del self.buckets[next(iter(self.buckets))]
