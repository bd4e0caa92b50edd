"""Vouching for the predecessor's link (security N6): a serving node tells the market, every few seconds, which key
holds the authenticated link into its window (its market ticket checked for exactly the window before). That vouch
is what keeps the predecessor's lease from being overdue (:mod:`kvasir.market.server.standing`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

import trio

from kvasir.core.errors import KvasirError, MarketError
from kvasir.core.identity import PublicKey
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import Lease, LinkVouch

log = logging.getLogger("kvasir.enroll")

#: How often a serving node vouches while its predecessor stays linked (the market's confirmations last longer:
#: ``confirm_ttl_s``, 90 s by default); a new predecessor is vouched for at the next look.
VOUCH_S = 10.0
#: How often the node looks whether its predecessor changed.
LOOK_S = 1.0


def vouch_for(lease: Lease | None, node_id: str, predecessor: PublicKey | None) -> LinkVouch | None:
    """The vouch to send for ``predecessor`` (the key on the live link into the node's window) under ``lease``, or
    None when there is nothing to vouch for."""
    if lease is None or predecessor is None:
        return None
    return LinkVouch(lease.model, lease.start, lease.end, node_id, lease.lease_id, predecessor.to_text())


async def vouch_every(
    market: MarketClient,
    lease: Callable[[], Lease | None],
    node_id: str,
    predecessor: Callable[[], PublicKey | None],
    period: float = VOUCH_S,
) -> NoReturn:
    """Vouch for the linked predecessor every ``period`` (and as soon as it changes); refusals are logged, never
    fatal: the lease keeper decides whether the node still holds its window."""
    last: tuple[LinkVouch, float] | None = None
    while True:
        vouch = vouch_for(lease(), node_id, predecessor())
        now = trio.current_time()
        if vouch is not None and (last is None or last[0] != vouch or now - last[1] >= period):
            last = (vouch, now)
            try:
                await market.vouch(vouch)
            except (MarketError, KvasirError) as exc:
                log.info("node %s: vouching for its predecessor failed: %s", node_id, exc)
        await trio.sleep(LOOK_S)
