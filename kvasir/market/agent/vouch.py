"""Vouching for the neighbours' links (security N6): a serving node tells the market, every few seconds, which keys
are on its live authenticated links: its predecessor (whose market ticket for exactly the window before its own
the link checked) and its successor (dialled at the map's endpoint with the window holder's key pinned). Those
vouches keep the neighbours' leases from being overdue (:mod:`kvasir.market.server.standing`)."""

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

#: How often a serving node vouches while its neighbours stay linked (the market's confirmations last longer:
#: ``confirm_ttl_s``, 90 s by default); a new neighbour is vouched for at the next look.
VOUCH_S = 10.0
#: How often the node looks whether its neighbours changed.
LOOK_S = 1.0

#: The keys on a node's live links: (predecessor, successor), None where there is no link.
LinkedKeys = tuple[PublicKey | None, PublicKey | None]
Linked = Callable[[], LinkedKeys]


def vouches_for(lease: Lease | None, node_id: str, linked: LinkedKeys) -> list[LinkVouch]:
    """The vouches to send under ``lease`` for the keys on the node's live links (none without a lease)."""
    if lease is None:
        return []
    pred, succ = linked
    out = []
    if pred is not None:
        out.append(LinkVouch(lease.model, lease.start, lease.end, node_id, lease.lease_id, pred.to_text()))
    if succ is not None:
        out.append(LinkVouch(lease.model, lease.start, lease.end, node_id, lease.lease_id, succ.to_text(), "successor"))
    return out


async def vouch_every(
    market: MarketClient, lease: Callable[[], Lease | None], node_id: str, linked: Linked, period: float = VOUCH_S
) -> NoReturn:
    """Vouch for each linked neighbour every ``period`` (and as soon as it changes); refusals are logged, never
    fatal: the lease keeper decides whether the node still holds its window."""
    sent: dict[str, tuple[LinkVouch, float]] = {}
    while True:
        now = trio.current_time()
        for vouch in vouches_for(lease(), node_id, linked()):
            last = sent.get(vouch.side)
            if last is not None and last[0] == vouch and now - last[1] < period:
                continue
            sent[vouch.side] = (vouch, now)
            try:
                await market.vouch(vouch)
            except (MarketError, KvasirError) as exc:
                log.info("node %s: vouching for its %s failed: %s", node_id, vouch.side, exc)
        await trio.sleep(LOOK_S)
