"""Whether a lease is turning into service (pure): fresh, confirmed by a neighbour, or overdue (security N6).

A claim is *fresh* for ``serve_deadline_s`` after it was made: time to fetch, load and link. A lease is
*confirmed* while a holder of a distinct key vouched, within ``confirm_ttl_s``, that its link from this holder is
up (``POST /v1/vouch``: the holder of the next window, which checked this holder's ticket for exactly this window).
Any other lease is *overdue*: it no longer keeps the window from others, and the key it belonged to, once another
key's claim takes the window, may not claim windows of that model for ``idle_cooldown_s``. A model of one window
has no neighbour to vouch: its leases count as confirmed (docs/market.md § Leases must become service).
"""

from __future__ import annotations

from typing import Literal

import attrs

Standing = Literal["fresh", "confirmed", "overdue"]


@attrs.frozen
class LeaseRules:
    """The market's rules for turning claims into service (``kvasir market --serve-deadline S``; 0: off, every
    lease keeps its window until it expires, as before)."""

    serve_deadline_s: float = 60.0
    confirm_ttl_s: float = 90.0
    idle_cooldown_s: float = 600.0

    @property
    def enforced(self) -> bool:
        return self.serve_deadline_s > 0


def standing(claimed_at: float, confirmed_at: float | None, now: float, windows: int, rules: LeaseRules) -> Standing:
    """Where a live lease claimed at ``claimed_at`` and last vouched for at ``confirmed_at`` (None: never) stands at
    ``now``, on a model of ``windows`` windows."""
    if not rules.enforced or windows <= 1:
        return "confirmed"
    if confirmed_at is not None and now - confirmed_at <= rules.confirm_ttl_s:
        return "confirmed"
    if now - claimed_at < rules.serve_deadline_s:
        return "fresh"
    return "overdue"


def tenure_start(
    prior: tuple[str, float, float, float | None] | None, node_id: str, now: float, rules: LeaseRules
) -> float:
    """When a new claim of ``node_id`` started its tenure, given the window's ``prior`` row (node id, claimed at,
    expires at, confirmed at) if any: a claim by the same key of a window it held unconfirmed until less than a
    deadline ago continues that tenure (letting a lease lapse, or releasing it, does not restart the clock)."""
    if prior is None:
        return now
    prior_node, claimed_at, expires_at, confirmed_at = prior
    if prior_node == node_id and confirmed_at is None and now - expires_at < rules.serve_deadline_s:
        return claimed_at
    return now
