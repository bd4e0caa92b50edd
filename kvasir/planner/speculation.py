"""The latency law of a ring, with speculation: what acceptance buys in tokens/s (docs/planner.md § Speculation).

A ring of N windows pays every window's compute and N hops for each trip a token (or a verify batch) makes round
it. Plain decoding emits one token per trip; speculation emits ``g``, the tokens accepted per trip (the accepted
drafts and the one sampled after them):

    tokens/s = g / (Σ compute + N·hop)

For drafts accepted independently with probability α each and K drafts per trip, the expected tokens per trip are

    g = 1 + α + α² + … + α^K = (1 − α^(K+1)) / (1 − α)

(the first sampled token always counts; draft i counts only if drafts 1…i were all right). The law prices a trip at
the plain one's: it leaves out the extra verify rows. Kvasir computes a verify batch row by row (bit-exactness,
docs/speculation.md § Why row by row) and pipelines the rows through the windows: the last rank stops at the first
rejected draft, so a trip grows by the g − 1 accepted rows through the slowest window, and no trip is shorter than
the K + 1 rows every window before the last computes; :func:`trip_ms` counts both, and the planner picks K where
drafting still pays (:func:`best_k`). All pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvasir.core.errors import InputError
from kvasir.core.speculate import K_LIMIT


def accepted_per_trip(alpha: float, k: int) -> float:
    """Expected tokens per ring trip, ``g``, for i.i.d. acceptance ``alpha`` and ``k`` drafts per trip."""
    if not 0.0 <= alpha <= 1.0:
        raise InputError(f"acceptance must be in [0, 1], got {alpha}")
    if k < 0:
        raise InputError(f"drafts per trip must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def law_tokens_per_s(g: float, compute_ms: float, link_ms: float) -> float:
    """The law: ``g`` tokens per trip of ``compute_ms`` (Σ over windows) plus ``link_ms`` (Σ over hops)."""
    trip = compute_ms + link_ms
    return 1e3 * g / trip if trip > 0 else float("inf")


def trip_ms(window_ms: Sequence[float], link_ms: float, k: int, g: float) -> float:
    """One trip with ``k`` drafts of which ``g`` − 1 are accepted: the plain trip plus those rows through the slowest
    window (pipelined: the other windows' rows overlap them), and never less than the ``k`` + 1 rows the slowest
    window computes for every trip (rows behind a rejected draft included)."""
    row = max(window_ms, default=0.0)
    return max(sum(window_ms) + link_ms + (g - 1.0) * row, (k + 1) * row)


def best_k(alpha: float, window_ms: Sequence[float], link_ms: float, k_max: int = K_LIMIT) -> int:
    """The drafts per trip that maximise expected tokens/s with the rows counted (0 when drafting never pays)."""

    def rate(k: int) -> float:
        g = accepted_per_trip(alpha, k)
        return g / trip_ms(window_ms, link_ms, k, g)

    return max(range(k_max + 1), key=rate)


@attrs.frozen
class SpeculationEstimate:
    """What a ring would decode at acceptance ``alpha`` with ``k`` drafts per trip."""

    alpha: float
    k: int
    #: Expected tokens per trip.
    g: float
    plain_tokens_per_s: float
    #: The law, rows not counted: g × plain.
    law_tokens_per_s: float
    #: Rows counted (:func:`trip_ms`).
    tokens_per_s: float

    def to_json(self) -> dict[str, Any]:
        return {key: round(v, 4) if isinstance(v, float) else v for key, v in attrs.asdict(self).items()}


def estimate_speculation(
    alpha: float, window_ms: Sequence[float], link_ms: float, k: int | None = None
) -> SpeculationEstimate:
    """The estimate for a ring of windows costing ``window_ms`` each per row and hops summing to ``link_ms``; ``k``
    None: :func:`best_k`."""
    if k is None:
        k = best_k(alpha, window_ms, link_ms)
    if not 0 <= k <= K_LIMIT:
        raise InputError(f"drafts per trip must be in [0, {K_LIMIT}], got {k}")
    g = accepted_per_trip(alpha, k)
    compute = sum(window_ms)
    trip = trip_ms(window_ms, link_ms, k, g)
    return SpeculationEstimate(
        alpha=alpha,
        k=k,
        g=g,
        plain_tokens_per_s=law_tokens_per_s(1.0, compute, link_ms),
        law_tokens_per_s=law_tokens_per_s(g, compute, link_ms),
        tokens_per_s=1e3 * g / trip if trip > 0 else float("inf"),
    )
