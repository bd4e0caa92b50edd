"""Tokens the relay has already admitted, remembered until they expire, so each v2 token opens one connection only.

A token carries no nonce and lives up to 600 s; whoever sees one (an on-path observer of a ``ws://`` relay, a log)
could otherwise replay it to take its holder's role again and again (security review 2, N13). The memo is bounded:
entries leave when their token expires (a min-heap by expiry), and a full memo refuses new tokens rather than grow.
"""

from __future__ import annotations

import heapq

#: Tokens remembered at most: 200,000 admissions within one token lifetime (600 s) is 333 a second, far beyond a
#: relay's honest rate; about 20 MB at the worst.
MAX_SPENT_TOKENS = 200_000


class SpentTokens:
    """Token ids (:attr:`kvasir.relay.grant.CheckedToken.token_id`) seen, each until its expiry."""

    def __init__(self, limit: int = MAX_SPENT_TOKENS) -> None:
        self.limit = limit
        self._expiry: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def spend(self, token_id: bytes, expires_at: int, now: int) -> bool | None:
        """Record the token as used: True the first time, False if it was already used, None if the memo is full
        (then it is not recorded; the caller refuses the connection)."""
        while self._heap and self._heap[0][0] <= now:  # an expired token is refused as expired anyway
            _, old = heapq.heappop(self._heap)
            del self._expiry[old]
        if token_id in self._expiry:
            return False
        if len(self._expiry) >= self.limit:
            return None
        self._expiry[token_id] = expires_at
        heapq.heappush(self._heap, (expires_at, token_id))
        return True
