"""Settlement rules (pure): when a paid request's receipts settle it, and how its price splits over the windows
(docs/market.md § Credit). The store (kvasir.market.server.credit) applies them in one transaction."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvasir.core.clientauth import MICRO


@attrs.frozen
class Witnessed:
    """One window's receipt of a paid request: the rank, the holder that sent it, and what it says."""

    rank: int
    witness: str
    request: int
    tokens: int
    holders: tuple[str, ...]


def settled_tokens(size: int, receipts: Sequence[Witnessed], max_tokens: int) -> int | None:
    """The tokens a paid request settles for in a ring of ``size`` windows, or None while it cannot settle.

    Every window needs a receipt from its own holder; all receipts must name the same request and the same holders
    (each the witness of its rank), and those holders must be at least two distinct keys: nobody confirms work
    alone. Then the smallest token count any window saw, and never more than the client authorised."""
    by_rank = {r.rank: r for r in receipts}
    if size < 2 or sorted(by_rank) != list(range(size)):
        return None
    first = by_rank[0]
    if any(r.request != first.request or r.holders != first.holders for r in by_rank.values()):
        return None
    if len(first.holders) != size or any(first.holders[k] != by_rank[k].witness for k in range(size)):
        return None
    if len(set(first.holders)) < 2:
        return None
    return min(min(r.tokens for r in by_rank.values()), max_tokens)


def window_prices(rewards: Sequence[float], max_price: int) -> list[int]:
    """Micro-credits per token each window earns (pure): its reward (credits per token) in micro-credits, rounded
    down; when they add up to more than the client's cap ``max_price``, each is scaled down to fit (rounded down,
    so the sum never passes the cap)."""
    prices = [max(0, int(r * MICRO)) for r in rewards]
    total = sum(prices)
    if total > max_price:
        prices = [p * max_price // total for p in prices]
    return prices


def affordable_tokens(tokens: int, price: int, balance: int) -> int:
    """Of ``tokens`` at ``price`` micro-credits each, how many a balance pays for (pure)."""
    if price <= 0:
        return tokens
    return max(0, min(tokens, balance // price))
