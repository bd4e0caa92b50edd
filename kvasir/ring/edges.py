"""How a node reaches its two neighbours: direct TCP, or a relay edge that both ends dial out to.

Edge ``{ring}-e{k}`` joins rank k-1 (upstream end, role 0x01) to rank k (downstream end, role 0x02); ``ring`` is a
short hash of the manifest's secret, so two rings of the same model never share an edge. The relay itself is reached
through a :class:`RelayConnect` the node's owner passes in (docs/protocol.md § Relay edges).
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import attrs

from kvasir.errors import InputError, RingError
from kvasir.ring.manifest import Manifest


class RelayChannel(Protocol):
    """One relay edge: whole messages each way. ``receive_message`` raises ``trio.EndOfChannel`` once the edge is
    closed, ``send_message`` ``trio.BrokenResourceError``; nothing else about the relay leaks into the ring."""

    async def send_message(self, message: bytes) -> None: ...

    async def receive_message(self) -> bytes: ...

    async def aclose(self) -> None: ...


class RelayConnect(Protocol):
    """Opens one relay edge; the relay package provides it (``relay.ringlink.connect_ring_edge``)."""

    def __call__(
        self, url: str, secret: bytes, edge_id: str, *, upstream: bool
    ) -> AbstractAsyncContextManager[RelayChannel]: ...


@attrs.frozen
class RingEdges:
    relay_url: str | None
    secret: bytes
    edge_in: str
    edge_out: str
    predecessor_relayed: bool
    successor_relayed: bool
    connect: RelayConnect | None = None

    @classmethod
    def for_node(
        cls, manifest: Manifest, rank: int, relay_override: str | None, connect: RelayConnect | None = None
    ) -> RingEdges:
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
        return cls(url, secret, f"{ring_id}-e{rank}", f"{ring_id}-e{succ.rank}", pred_relayed, succ_relayed, connect)

    def open_relay(self, edge_id: str, *, upstream: bool) -> AbstractAsyncContextManager[RelayChannel]:
        if self.connect is None or self.relay_url is None:
            raise RingError("this node has relayed links but was given no relay connector (NodeConfig.relay_connect)")
        return self.connect(self.relay_url, self.secret, edge_id, upstream=upstream)
