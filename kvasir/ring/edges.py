"""How a node reaches its two neighbours: direct TCP, or a relay edge that both ends dial out to.

Edge ``{ring}-e{k}`` joins rank k-1 (upstream end, role 0x01) to rank k (downstream end, role 0x02); edge
``{ring}-e{k}-s{i}`` joins rank k-1 to rank k's standby i (a holder of a window has an edge in of its own, so the
predecessor fails over to a standby by dialing that edge, as it dials a standby's address over TCP). ``ring`` is a
short prefix of the manifest's ring id in a keyed ring (whose operator-signed edge grants name the full id, so the
relay keeps rings apart by grant), else of a hash of the manifest's v1 secret, so two rings of the same model never
share an edge. The relay itself is reached through a :class:`RelayConnect` the node's owner builds with whatever
admits it (its key and grants, or a keyless ring's secret; docs/protocol.md § Relay edges).
"""

from __future__ import annotations

import hashlib
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import attrs

from kvasir.core.errors import InputError, RingError
from kvasir.ring.manifest import Manifest


class RelayChannel(Protocol):
    """One relay edge: whole messages each way. ``receive_message`` raises ``trio.EndOfChannel`` once the edge is
    closed, ``send_message`` ``trio.BrokenResourceError``; nothing else about the relay leaks into the ring."""

    async def send_message(self, message: bytes) -> None: ...

    async def receive_message(self) -> bytes: ...

    async def aclose(self) -> None: ...

    @property
    def taken(self) -> bool:
        """The relay closed this end because another key holds its role on the edge (another holder of the window
        is linked there: the relay's refusal, as a successor's link-level ERROR is over TCP)."""
        ...


class RelayConnect(Protocol):
    """Opens one relay edge as its upstream or downstream end. The node's owner builds it with the node's
    credentials (``relay.ringlink.relay_connector``), so the ring never handles tokens or secrets."""

    def __call__(self, url: str, edge_id: str, *, upstream: bool) -> AbstractAsyncContextManager[RelayChannel]: ...


def uses_edge_grants(manifest: Manifest) -> bool:
    """Relay admission by operator-signed grants (v2): a keyed ring without a ring secret. A market ring is keyed
    as its holders appear but keeps its secret for the relay, and its edge ids must not change as keys arrive."""
    return manifest.secured and not manifest.secret


def relay_edge_id(manifest: Manifest, rank: int, holder: int = 0) -> str:
    """The relay edge into ``rank``'s holder ``holder`` (0 the primary, i + 1 its standby i) from its predecessor."""
    if uses_edge_grants(manifest):  # v2 admission: the operator's grants name the ring id
        prefix = manifest.ring_id[:12]
    else:
        prefix = hashlib.sha256((manifest.secret or manifest.model_sha256).encode()).hexdigest()[:12]
    return f"{prefix}-e{rank}" if holder == 0 else f"{prefix}-e{rank}-s{holder - 1}"


def holder_index(manifest: Manifest, rank: int) -> int:
    """Which holder of ``rank``'s window (0 the primary, i + 1 standby i of the manifest as written) this manifest's
    entry for ``rank`` is: a standby's view (``Manifest.as_standby``) names the standby there."""
    base = manifest.base or manifest
    me = manifest.rank(rank)
    for i, holder in enumerate(base.rank(rank).holders()):
        if holder.address == me.address and holder.key == me.key:
            return i
    raise InputError(f"rank {rank}'s entry is none of the holders of its window in the manifest")


@attrs.frozen
class RingEdges:
    relay_url: str | None
    edge_in: str
    #: The edge to each holder of the successor's window, in ``RankEntry.holders()`` order (the primary's first).
    edges_out: tuple[str, ...]
    predecessor_relayed: bool
    successor_relayed: bool
    connect: RelayConnect | None = None

    @classmethod
    def for_node(
        cls, manifest: Manifest, rank: int, relay_override: str | None, connect: RelayConnect | None = None
    ) -> RingEdges:
        url = relay_override or manifest.relay
        me, succ = manifest.rank(rank), manifest.successor(rank)
        pred_relayed = url is not None and (relay_override is not None or me.link == "relay")
        succ_relayed = url is not None and (relay_override is not None or succ.link == "relay")
        if (pred_relayed or succ_relayed) and connect is None:  # a given connector knows how it is admitted
            if uses_edge_grants(manifest) and not me.grants:
                raise InputError(
                    f"rank {rank}'s relayed links need the operator's edge grants in the manifest "
                    "([[rank]] grants; `kvasir ring up --relay` signs them)"
                )
            if not uses_edge_grants(manifest) and not manifest.secret:
                raise InputError(
                    'relayed links of a keyless ring need a secret in the manifest ([model] secret = "hex…")'
                )
        base = manifest.base or manifest  # edge ids are the ring's as written, the same in a standby's view
        edge_in = relay_edge_id(base, rank, holder_index(manifest, rank))
        edges_out = tuple(relay_edge_id(base, succ.rank, i) for i in range(len(succ.holders())))
        return cls(url, edge_in, edges_out, pred_relayed, succ_relayed, connect)

    @property
    def edge_out(self) -> str:
        """The edge to the successor's primary."""
        return self.edges_out[0]

    def open_relay(self, edge_id: str, *, upstream: bool) -> AbstractAsyncContextManager[RelayChannel]:
        if self.connect is None or self.relay_url is None:
            raise RingError("this node has relayed links but was given no relay connector (NodeConfig.relay_connect)")
        return self.connect(self.relay_url, edge_id, upstream=upstream)
