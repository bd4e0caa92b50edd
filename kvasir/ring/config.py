"""What a ring node is started with (:class:`NodeConfig`), and the credentials its links run with."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity
from kvasir.core.schedule import PREFILL_CHUNK
from kvasir.core.speculate import DraftPolicy, DraftSources
from kvasir.ring.compute import RingStageInfo
from kvasir.ring.edges import RelayConnect
from kvasir.ring.manifest import Manifest
from kvasir.ring.secure import Credentials, PeerPolicy
from kvasir.ring.status import MarketWindow
from kvasir.wire import BoundaryDType, Hello

log = logging.getLogger("kvasir.node")

#: What a node shows of the market it enrolled through (None: started from a manifest).
MarketView = Callable[[], Sequence[MarketWindow] | None]


@attrs.frozen
class NodeConfig:
    manifest: Manifest
    rank: int
    node_id: str = attrs.field(factory=lambda: secrets.token_hex(6))
    #: This node's key pair. Required when the manifest names the ranks' keys: links then run protocol v2
    #: (authenticated by those keys, encrypted); the node id is then the key's fingerprint.
    identity: Identity | None = None
    #: Market rings: who else may neighbour this node (a market ticket check), asked at each handshake; with it the
    #: links run protocol v2 even before every rank's key is known.
    peer_policy: Callable[[], PeerPolicy | None] | None = None
    #: Market rings: this node's current window ticket, presented when it dials its successor.
    ticket: Callable[[], bytes] | None = None
    #: Prompt tokens per prefill boundary: smaller chunks let stages overlap sooner. Keep it equal to the reference's
    #: (``kvasir generate``) for bit-identical results: llama.cpp's numbers depend on the batching.
    prefill_chunk: int = PREFILL_CHUNK
    #: How long a frame waits for a missing successor link before its request fails (at least ``failover_wait``).
    link_wait: float = 30.0
    #: How long a node whose neighbour's link broke keeps the requests in flight for that window to come back (the
    #: same node relinking, ``ring up`` restarting it, a standby, a market claimant): it then replays them into it.
    #: Past this the requests fail with LINK_LOST on every node.
    failover_wait: float = 15.0
    #: A request with no progress for this long is failed at its entry node.
    stall_timeout: float = 120.0
    keepalive_interval: float = 1.0
    #: A link that brings nothing (not even a keepalive) for this long is dropped; None: 3 keepalive intervals.
    idle_timeout: float | None = None
    #: Send both links through this relay (``ws://`` or ``wss://``), whatever the manifest says.
    relay: str | None = None
    #: Opens relay edges (``relay.ringlink.relay_connector``); needed only when a link is relayed.
    relay_connect: RelayConnect | None = None
    #: Boundary encoding this node sends when its successor accepts it (f32 is bit-exact; f16/bf16 halve the bytes).
    boundary_dtype: BoundaryDType = BoundaryDType.F32
    #: A standby (``Manifest.as_standby``): dormant, linked to nothing until a predecessor fails over to it.
    standby: bool = False
    #: Speculative decoding for requests entering here that do not say: up to K prompt-lookup drafts per step
    #: (0: plain one-token steps). The request's START carries its K; the last rank drafts (docs/speculation.md).
    speculate: int = 0
    #: How the last rank drafts: eagerly on a latency-bound ring ("auto"), or always one way (docs/speculation.md).
    draft_policy: DraftPolicy = "auto"
    #: Where the last rank's drafts come from (``--draft-model``, the benchmark's ``--draft-oracle``): a request's
    #: source from its prompt and sequence id. None: prompt lookup.
    draft_sources: DraftSources | None = None
    #: Batched decode (kvasir.ring.batching): up to this many requests' decode steps in one llama_decode. 1 (the
    #: default) keeps one sequence per decode, bit-exact against ``generate``; more trades exactness for throughput.
    batch: int = 1
    #: Under ``kvasir ring up``: the file its supervisor writes its view of the ring's processes in; the node's
    #: status (control socket) carries it (docs/architecture.md § Failover).
    supervisor_state: Path | None = None


def node_credentials(config: NodeConfig) -> Credentials | None:
    """The node's TLS credentials for a keyed (v2) ring, None for a keyless one; InputError if they do not fit."""
    m = config.manifest
    if config.peer_policy is not None:  # a market ring: tickets stand where a manifest names keys
        if config.identity is None:
            raise InputError("a market ring's node needs its identity")
        return Credentials.of(config.identity)
    if not m.secured:
        if config.identity is not None:
            log.warning("the manifest names no node keys: links are unauthenticated and in clear (protocol v1)")
        return None
    if config.identity is None:
        raise InputError("this ring's manifest names its nodes' keys: start the node with its identity (--identity)")
    expected = m.rank(config.rank).key
    if expected != config.identity.public:
        raise InputError(
            f"this node's key {config.identity.public.fingerprint} is not rank {config.rank}'s key in the manifest"
            f" ({expected.fingerprint if expected else 'none'})"
        )
    return Credentials.of(config.identity)


def check_stage(config: NodeConfig, info: RingStageInfo) -> None:
    """InputError unless the stage holds this rank's window of the ring's model."""
    m = config.manifest
    if m.size < 2:
        raise InputError("a ring needs at least 2 ranks (one stage: use `kvasir generate`)")
    me = m.rank(config.rank)
    if (info.start, info.end) != (me.start, me.end):
        raise InputError(
            f"rank {config.rank} must hold layers {me.start}:{me.end}, its stage holds {info.start}:{info.end}"
        )
    if info.model_sha256 and info.model_sha256 != m.model_sha256:
        raise InputError(
            f"stage file is cut from model {info.model_sha256[:12]}…, the ring serves {m.model_sha256[:12]}…"
        )


def node_hello(config: NodeConfig, info: RingStageInfo) -> Hello:
    """What the node says of itself in each link's handshake."""
    m = config.manifest
    me = m.rank(config.rank)
    return Hello(
        node_id=config.node_id,
        model_id=m.model_sha256,
        rank=config.rank,
        ring_size=m.size,
        window_start=me.start,
        window_end=me.end,
        n_layers=m.n_layers,
        n_embd=info.n_embd,
        dtypes=frozenset(BoundaryDType),
    )
