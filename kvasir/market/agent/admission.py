"""A new key's admission to an open market: the proof of work it asks (:mod:`kvasir.market.work`), done once."""

from __future__ import annotations

import logging

import trio

from kvasir.core.errors import InputError
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import AdmissionRequest
from kvasir.market.work import MAX_WORK_BITS, mint_work

log = logging.getLogger("kvasir.enroll")


async def admit(market: MarketClient) -> None:
    """Do the work the market asks of this client's key and show it (``POST /v1/admission``). The work runs in a
    worker thread (about 2**bits hashes); a cancelled caller leaves it to finish unobserved."""
    assert market.identity is not None
    info = await market.admission()
    bits, market_key = info.get("work_bits"), info.get("market")
    if not isinstance(bits, int) or isinstance(bits, bool) or not 0 <= bits <= MAX_WORK_BITS:
        raise InputError(f"market: admission 'work_bits' must be 0..{MAX_WORK_BITS}")
    if not isinstance(market_key, str) or not 0 < len(market_key) <= 512:
        raise InputError("market: admission 'market' must be the market's key")
    own = market.identity.public.to_text()
    log.warning("node %s: the market asks %d bits of work of a new key (about 2^%d hashes)", market.identity.node_id,
                bits, bits)  # fmt: skip
    nonce = await trio.to_thread.run_sync(mint_work, market_key, own, bits, abandon_on_cancel=True)
    await market.admit(AdmissionRequest(market.identity.node_id, nonce))
