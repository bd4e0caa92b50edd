"""How a node reaches its two neighbours: direct TCP, or a relay edge that both ends dial out to.

Edge ``{ring}-e{k}`` joins rank k-1 (upstream end, role 0x01) to rank k (downstream end, role 0x02); ``ring`` is a
short hash of the manifest's secret, so two rings of the same model never share an edge. Each end signs its own edge
token with the manifest's secret (docs/protocol.md § Relay edges).
"""

from __future__ import annotations

import hashlib
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs

from kvasir.errors import InputError
from kvasir.ring.links import Link, MessageLink
from kvasir.ring.manifest import Manifest

#: Lifetime of the edge tokens a node signs for itself.
TOKEN_LIFETIME_S = 24 * 3600


@attrs.frozen
class RingEdges:
    relay_url: str | None
    secret: bytes
    edge_in: str
    edge_out: str
    predecessor_relayed: bool
    successor_relayed: bool

    @classmethod
    def for_node(cls, manifest: Manifest, rank: int, relay_override: str | None) -> RingEdges:
        url = relay_override or manifest.relay
        ring_id = hashlib.sha256((manifest.secret or manifest.model_sha256).encode()).hexdigest()[:12]
        me, succ = manifest.rank(rank), manifest.successor(rank)
        pred_relayed = url is not None and (relay_override is not None or me.link == "relay")
        succ_relayed = url is not None and (relay_override is not None or succ.link == "relay")
        if (pred_relayed or succ_relayed) and not manifest.secret:
            raise InputError('relayed links need a secret in the manifest ([model] secret = "hex…")')
        try:
            secret = bytes.fromhex(manifest.secret) if manifest.secret else b""
        except ValueError:
            raise InputError("the manifest's secret must be hex") from None
        return cls(url, secret, f"{ring_id}-e{rank}", f"{ring_id}-e{succ.rank}", pred_relayed, succ_relayed)

    @asynccontextmanager
    async def open_relay(self, edge_id: str, *, upstream: bool) -> AsyncIterator[Link]:
        from relay import Role, make_edge_token, open_relay_link

        assert self.relay_url is not None
        role = Role.UPSTREAM if upstream else Role.DOWNSTREAM
        token = make_edge_token(self.secret, edge_id, role, int(time.time()) + TOKEN_LIFETIME_S)
        ctx = ssl.create_default_context() if self.relay_url.startswith("wss://") else None
        async with open_relay_link(self.relay_url, edge_id, role, token, ssl_context=ctx) as rl:
            link = MessageLink(rl.send_message, rl.receive_message, rl.aclose, f"relay:{edge_id}")
            yield link
