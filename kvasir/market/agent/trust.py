"""Whom a self-enrolling node believes: the market operator's key (pinned, or trusted on first use and logged, on
a loopback market only) and the market key the operator delegated to, which signs window tickets and every reply of
the market (kvasir.market.replies). The node acts on no reply that key did not sign, and loads nothing a model
record names unless the record carries the trusted operator's signature.
"""

from __future__ import annotations

import logging
from typing import Any

from kvasir.core.errors import InputError, MarketError
from kvasir.core.identity import PublicKey
from kvasir.market import auth
from kvasir.market.agent.client import MarketClient
from kvasir.market.agent.lease import LeaseLost
from kvasir.market.records import ModelRecord

log = logging.getLogger("kvasir.enroll")


class Trust:
    def __init__(self, market: MarketClient, node_id: str, operator_key: PublicKey | None) -> None:
        self.market = market
        self.node_id = node_id
        #: The operator key records must be signed by (None until learned, when not pinned).
        self.operator_key = operator_key
        #: The market's ticket key, when the operator delegated to it (neighbours' tickets are checked with it).
        self.ticket_issuer: PublicKey | None = None
        self._warned_operator: PublicKey | None = None

    async def learn(self) -> None:
        """Learn the operator's key (pinned, or trusted on first use: only on a loopback market, see
        :func:`~kvasir.market.agent.config.market_trust_problem`) and the market key it delegated to. From then on
        the client acts only on replies that key signed (security N1); a market key the operator did not delegate
        to is a MarketError ``untrusted_market``, and nothing that market says is used."""
        if self.operator_key is not None and self.ticket_issuer is not None:
            return
        await self.market.operator(key_in_reply=self._delegated)  # a 200 reply is checked by _delegated's key

    def _delegated(self, info: Any) -> PublicKey:
        """The market key ``/v1/operator`` names, if the trusted operator delegated to it (which makes it the key
        that reply, and every later one, must be signed by)."""
        if not isinstance(info, dict):
            raise MarketError(0, "bad_reply", "market: /v1/operator is not an object")
        try:
            named = PublicKey.from_text(info.get("operator", ""))
            market = PublicKey.from_text(info.get("market", ""))
        except InputError as exc:
            raise MarketError(0, "bad_reply", f"market: /v1/operator: {exc}") from None
        if self.operator_key is None:
            self.operator_key = named
            log.warning(
                "node %s: trusting market operator %s (fingerprint %s) on first use; pin it with --market-key %s",
                self.node_id,
                named.to_text(),
                named.fingerprint,
                named.to_text(),
            )
        elif named != self.operator_key and named != self._warned_operator:
            self._warned_operator = named  # once per key, not every poll
            log.warning(
                "node %s: the market names operator %s, not the pinned %s: its records will be refused",
                self.node_id,
                named.fingerprint,
                self.operator_key.fingerprint,
            )
        if not auth.signature_ok(self.operator_key, auth.delegation_message(market), info.get("delegation")):
            raise MarketError(
                0,
                "untrusted_market",
                f"market: its key {market.fingerprint} is not delegated by operator {self.operator_key.fingerprint}"
                " (--market-key): nothing it says is acted on",
            )
        self.ticket_issuer = self.market.reply_key = market
        return market

    async def verified_model(self, sha256: str) -> ModelRecord:
        """The market's record of a model, if the trusted operator signed it (LeaseLost otherwise)."""
        await self.learn()
        model = await self.market.model(sha256)
        key = self.operator_key
        assert key is not None
        if model.sha256 != sha256 or not model.signed_by(key):
            raise LeaseLost(f"the record of model {sha256[:12]}… is not signed by operator {key.fingerprint}")
        return model
