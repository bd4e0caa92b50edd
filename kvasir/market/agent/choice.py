"""Which window a node claims (pure): the best reward per byte among uncovered windows that fit its budget, or,
when none is uncovered, among windows whose holder is overdue (``claimable``: it neither serves nor was vouched
for in time, security N6), so a squatted window goes to a node that will serve it.

Rewards come from the market's coverage map (weight × demand multiplier, credits per token served). Dividing by
the window's stage bytes prefers windows that pay the most for the memory and download they cost. Ties (e.g. a
planner's manifest whose weights follow bytes) are broken by a random draw the caller seeds, so nodes that start
together spread over the windows instead of racing for the same one.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvasir.market.records import CoverageEntry

#: Rewards per byte within this relative distance count as a tie.
TIE_TOLERANCE = 1e-9


def fits(window: CoverageEntry, budget_bytes: int) -> bool:
    return window.bytes <= budget_bytes


def choose_window(
    windows: Sequence[CoverageEntry], budget_bytes: int, draw: random.Random, *, exclude: frozenset[str] = frozenset()
) -> CoverageEntry | None:
    """The window to claim, or None when no uncovered (or else claimable) window fits ``budget_bytes``.

    ``exclude`` names models (sha256) to leave out. Deterministic for a given ``draw`` state.
    """
    ok = [w for w in windows if fits(w, budget_bytes) and w.model not in exclude]
    open_ = [w for w in ok if not w.covered] or [w for w in ok if w.claimable]
    if not open_:
        return None
    best = max(w.reward / w.bytes for w in open_)
    top = [w for w in open_ if w.reward / w.bytes >= best * (1 - TIE_TOLERANCE)]
    top.sort(key=lambda w: (w.model, w.rank))
    return top[0] if len(top) == 1 else draw.choice(top)
