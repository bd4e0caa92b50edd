"""What a self-enrolling node does next (pure): claim a window, wait, or give up the window it holds.

The shape of Petals' block selection: the market's coverage map and the node's own state in, one decision out,
randomness injected. The enrollment loop asks while it holds nothing (claim the best window, or wait for one) and
again at every coverage poll while it holds one (keep it, or release it when the map says it is no longer its).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import attrs

from kvasir.market.agent.choice import choose_window, fits
from kvasir.market.records import CoverageEntry

#: A window of a model: (model sha256, start, end).
WindowKey = tuple[str, int, int]


def window_key(window: CoverageEntry) -> WindowKey:
    return window.model, window.start, window.end


@attrs.frozen
class OwnState:
    """The node as the policy sees it: its id, the window it holds (None: none), and windows it leaves to others
    for now (each failed it lately: no source, a bad record, a stage that would not load)."""

    node_id: str
    holding: WindowKey | None = None
    avoid: frozenset[WindowKey] = frozenset()


@attrs.frozen
class Claim:
    """Claim ``window`` (it is uncovered, fits the budget and pays the most per byte)."""

    window: CoverageEntry


@attrs.frozen
class Wait:
    """Nothing to do now: no window fits (holding nothing), or keep serving the window held."""

    reason: str


@attrs.frozen
class Release:
    """The window held is no longer this node's (gone from the manifest, or another node's lease)."""

    reason: str


Decision = Claim | Wait | Release

#: The reason of a Wait while nothing fits (the enrollment's state shows it).
NOTHING_FITS = "waiting for an uncovered window that fits"


def decide(coverage: Sequence[CoverageEntry], own: OwnState, budget_bytes: int, rng: random.Random) -> Decision:
    """The next step for a node in state ``own`` given the market's ``coverage`` map.

    Holding nothing: :class:`Claim` a window the map shows held by this very node (a claim whose reply was lost
    when the market died, or a lease of this node's previous run: claiming it again renews that lease), else the
    window :func:`~kvasir.market.agent.choice.choose_window` picks among those not avoided (ties broken by ``rng``:
    deterministic for a given state), or :class:`Wait`.

    Holding a window: :class:`Release` when a map that lists the model no longer has the window, or shows another
    node holding it (the lease ran out and was taken); otherwise :class:`Wait` (a window shown uncovered is the
    node's still: its lease keeper claims it again). A map without the model says nothing either way.
    """
    if own.holding is None:
        open_ = [w for w in coverage if window_key(w) not in own.avoid]
        mine = [w for w in open_ if w.holder == own.node_id]
        if mine:  # never a second window while a lease of ours blocks a window another node may need
            return Claim(min(mine, key=lambda w: (w.model, w.rank)))
        choice = choose_window(open_, budget_bytes, rng)
        return Wait(NOTHING_FITS) if choice is None else Claim(choice)
    model, start, end = own.holding
    listed = [w for w in coverage if w.model == model]
    held = next((w for w in listed if (w.start, w.end) == (start, end)), None)
    if listed and held is None:
        return Release(f"window {start}:{end} is gone from the manifest")
    if held is not None and held.holder is not None and held.holder != own.node_id:
        return Release(f"window {start}:{end} is held by node {held.holder}")
    return Wait("serving")


#: How long after a lease's stated end a waiting node looks again (the market's reply takes a moment).
AFTER_EXPIRY_S = 0.05


def next_look(coverage: Sequence[CoverageEntry], own: OwnState, budget_bytes: int, now: float, poll_s: float) -> float:
    """Seconds a node holding nothing waits before it reads the map again: ``poll_s``, or less when the lease of a
    window it could claim (fits, not avoided) ends sooner (``now`` and ``lease_expires`` in market time). So a
    spare claims a dead holder's window as its lease ends, within one lease of the holder's last renewal, not a
    poll later. A lease that looks over already (a clock estimate off) changes nothing: never a tight loop."""
    ends = [
        w.lease_expires
        for w in coverage
        if w.lease_expires is not None
        and w.lease_expires > now
        and fits(w, budget_bytes)
        and window_key(w) not in own.avoid
    ]
    if not ends:
        return poll_s
    return min(poll_s, min(ends) - now + AFTER_EXPIRY_S)
