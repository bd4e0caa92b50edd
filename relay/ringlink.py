"""Ring links through the relay: the :class:`kvasir.ring.edges.RelayConnect` a node's owner builds and passes to
:class:`kvasir.ring.node.NodeConfig` as ``relay_connect``, and the operator's side (signing a ring's edge grants).

The ring layer does not import the relay (it sits below it), and never sees a token or secret: the owner builds the
connector with the node's credentials. A keyed ring (every rank names its key) joins with v2 tokens: the operator's
grant from the manifest plus the node's own signature over a 9-minute expiry, made afresh at every (re)connect
(each token is good for one connection). A
keyless ring joins with v1 HMAC tokens keyed by the manifest's secret (private networks and the market path only).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import attrs
import trio

from kvasir.core.errors import InputError, RingError
from kvasir.core.identity import Identity
from kvasir.relay.client import RelayLink, open_relay_link
from kvasir.relay.codes import CloseCode
from kvasir.relay.errors import EdgeTokenError, RelayLinkClosed
from kvasir.relay.grant import MAX_TOKEN_LIFETIME, EdgeGrant, make_token, read_grant, sign_grant
from kvasir.relay.token import Role, make_edge_token
from kvasir.ring.edges import RelayConnect, relay_edge_id, uses_edge_grants
from kvasir.ring.manifest import Manifest, RankEntry

#: Lifetime of the v1 edge tokens a node of a keyless ring signs for itself.
TOKEN_LIFETIME_S = 24 * 3600
#: Lifetime of a v2 token: the relay's most, less room for :class:`TokenExpiries` to step past it and for skew.
V2_TOKEN_LIFETIME_S = MAX_TOKEN_LIFETIME - 60


class TokenExpiries:
    """The expiries of one node's v2 tokens: ``now + V2_TOKEN_LIFETIME_S``, but always later than the last one.

    The relay admits each token once and lets a same-key connection replace a live one only with a later expiry
    (security N13), so every (re)connect, even two in one second, needs a token of its own, newer than the last.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.last = 0

    def next(self) -> int:
        self.last = max(int(self.clock()) + V2_TOKEN_LIFETIME_S, self.last + 1)
        return self.last


class EdgeChannel:
    """A relay edge as the ring sees it (kvasir.ring.edges.RelayChannel): relay closes become trio's errors."""

    def __init__(self, link: RelayLink) -> None:
        self._link = link
        self._taken = False

    @property
    def taken(self) -> bool:
        return self._taken

    def _closed(self, exc: RelayLinkClosed) -> None:
        if exc.code == CloseCode.ROLE_TAKEN:
            self._taken = True

    async def send_message(self, message: bytes) -> None:
        try:
            await self._link.send_message(message)
        except RelayLinkClosed as exc:
            self._closed(exc)
            raise trio.BrokenResourceError(str(exc)) from exc

    async def receive_message(self) -> bytes:
        try:
            return await self._link.receive_message()
        except RelayLinkClosed as exc:
            self._closed(exc)
            raise trio.EndOfChannel(str(exc)) from exc

    async def aclose(self) -> None:
        await self._link.aclose()


@asynccontextmanager
async def _open_edge(url: str, edge: str, role: Role, token: str, *, bearer: bool) -> AsyncIterator[EdgeChannel]:
    ctx = ssl.create_default_context() if url.startswith("wss://") else None
    async with open_relay_link(url, edge, role, token, bearer=bearer, ssl_context=ctx) as rl:  # errors: RingError
        yield EdgeChannel(rl)


def _role(upstream: bool) -> Role:
    return Role.UPSTREAM if upstream else Role.DOWNSTREAM


def secret_connector(secret: bytes) -> RelayConnect:
    """v1 (keyless rings): each connection carries an HMAC token keyed by the ring secret, in the URL query."""

    def connect(url: str, edge_id: str, *, upstream: bool) -> AbstractAsyncContextManager[EdgeChannel]:
        role = _role(upstream)
        token = make_edge_token(secret, edge_id, role, int(time.time()) + TOKEN_LIFETIME_S)
        return _open_edge(url, edge_id, role, token, bearer=False)

    return connect


def grant_connector(identity: Identity, grants: Iterable[str], clock: Callable[[], float] = time.time) -> RelayConnect:
    """v2 (keyed rings): join with the operator's grant for the edge and role, under a fresh token signed by
    ``identity`` (:class:`TokenExpiries`: about ten minutes, newer at every connect), in the Authorization header."""
    expiries = TokenExpiries(clock)
    by_edge: dict[tuple[str, Role], str] = {}
    for signed in grants:
        grant = read_grant(signed)
        if grant.holder != identity.public:
            raise InputError(f"an edge grant for {grant.edge} names key {grant.holder.fingerprint}, not this node's")
        by_edge[grant.edge, grant.role] = signed

    def connect(url: str, edge_id: str, *, upstream: bool) -> AbstractAsyncContextManager[EdgeChannel]:
        role = _role(upstream)
        signed = by_edge.get((edge_id, role))
        if signed is None:
            raise InputError(f"no edge grant for {edge_id} as {role.name.lower()} in the manifest")
        token = make_token(identity, signed, expiries.next())
        return _open_edge(url, edge_id, role, token, bearer=True)

    return connect


def market_grant_connector(
    identity: Identity, grants: Callable[[], Sequence[str]], clock: Callable[[], float] = time.time
) -> RelayConnect:
    """Market rings: join the edge that the market's current grant for the role names (the market, which signs the
    grants and renews them with the lease, also names the edges), under a fresh token signed by ``identity``."""
    expiries = TokenExpiries(clock)

    def connect(url: str, edge_id: str, *, upstream: bool) -> AbstractAsyncContextManager[EdgeChannel]:
        role = _role(upstream)
        for signed in grants():
            try:
                grant = read_grant(signed)
            except EdgeTokenError:
                continue
            if grant.role == role and grant.holder == identity.public:
                token = make_token(identity, signed, expiries.next())
                return _open_edge(url, grant.edge, role, token, bearer=True)
        raise RingError(f"the market has given this node no relay edge grant as {role.name.lower()} yet")

    return connect


def relay_connector(manifest: Manifest, rank: int, identity: Identity | None) -> RelayConnect | None:
    """What admits rank ``rank`` to its relay edges: v2 grants in a keyed ring, else the v1 secret; None when the
    manifest has neither (then a relayed link fails with a clear error in ``RingEdges.for_node``)."""
    entry = manifest.rank(rank)
    if uses_edge_grants(manifest):
        if not entry.grants:
            return None
        if identity is None or identity.public != entry.key:
            raise InputError(f"rank {rank}'s relay grants are for key {entry.key}: run with that --identity")
        try:
            return grant_connector(identity, entry.grants)
        except EdgeTokenError as exc:
            raise InputError(f"rank {rank}: bad edge grant in the manifest: {exc}") from None
    if not manifest.secret:
        return None
    try:
        return secret_connector(bytes.fromhex(manifest.secret))
    except ValueError:
        raise InputError("the manifest's secret must be hex") from None


def grant_relay_edges(manifest: Manifest, operator: Identity, not_after: int) -> Manifest:
    """``manifest`` (keyed) with ``operator`` as its operator and each holder of each window (the rank, and each of
    its standbys under its own key) holding grants for its relay edges, valid until Unix time ``not_after`` (pure):
    downstream on its own edge in, upstream on the edge to each holder of the successor's window."""
    if not manifest.secured:
        raise InputError("edge grants need a keyed ring: every rank names its key")
    ring = manifest.ring_id

    def grants_of(holder: RankEntry, index: int) -> tuple[str, ...]:
        if holder.key is None:
            raise InputError(f"rank {holder.rank}'s standby {index - 1} names no key: it cannot hold edge grants")
        succ = manifest.successor(holder.rank)
        edges = [(relay_edge_id(manifest, holder.rank, index), Role.DOWNSTREAM)]
        edges += [(relay_edge_id(manifest, succ.rank, j), Role.UPSTREAM) for j in range(len(succ.holders()))]
        grants = (EdgeGrant(ring, edge, role, holder.key, not_after, operator.public) for edge, role in edges)
        return tuple(sign_grant(operator, grant) for grant in grants)

    ranks = []
    for entry in manifest.ranks:
        holders = entry.holders()
        standby = tuple(
            attrs.evolve(s, grants=grants_of(h, i + 1))
            for i, (s, h) in enumerate(zip(entry.standby, holders[1:], strict=True))
        )
        ranks.append(attrs.evolve(entry, grants=grants_of(entry, 0), standby=standby))
    return attrs.evolve(manifest, operator=operator.public, ranks=tuple(ranks))
