"""Nodes join relay edges the way kvasir/commands/node.py builds it (relay/ringlink.py): v2 grants from the manifest
in a keyed ring, the v1 secret in a keyless one; against a real relay on 127.0.0.1."""

from __future__ import annotations

import time
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity
from kvasir.relay import Relay, RelayConfig, RelayConnectError, Role, open_relay_link
from kvasir.relay.grant import MAX_TOKEN_LIFETIME, EdgeGrant, make_token, read_grant, sign_grant
from kvasir.relay.ringlink import grant_connector, grant_relay_edges, relay_connector
from kvasir.ring.edges import RingEdges, relay_edge_id
from kvasir.ring.manifest import Manifest, RankEntry, StandbyEntry, parse_manifest

SHA = "ab" * 32
SECRET = "cd" * 16

StartRelay = Callable[..., Awaitable[str]]


def keyless(secret: str | None = SECRET) -> Manifest:
    ranks = tuple(RankEntry(k, 2 * k, 2 * k + 2, "127.0.0.1", 7100 + k, link="relay") for k in range(3))
    return Manifest(SHA, 6, ranks, secret=secret, relay="ws://127.0.0.1:1")


def keyed(operator: Identity) -> tuple[Manifest, list[Identity]]:
    ids = [Identity.generate() for _ in range(3)]
    manifest = keyless(None).with_keys([i.public for i in ids])
    return grant_relay_edges(manifest, operator, int(time.time()) + 3600), ids


@pytest.fixture
async def start_relay(nursery: trio.Nursery) -> AsyncIterator[StartRelay]:
    async def start(**config: Any) -> str:
        port = await nursery.start(Relay(RelayConfig(host="127.0.0.1", port=0, **config)).serve)
        return f"ws://127.0.0.1:{port}"

    yield start


async def _pair(url: str, manifest: Manifest, ids: list[Identity | None], rank: int) -> None:
    """Rank ``rank`` (upstream) and its successor (downstream) meet on their edge and pass a message each way."""
    succ = manifest.successor(rank).rank
    up = relay_connector(manifest, rank, ids[rank])
    down = relay_connector(manifest, succ, ids[succ])
    assert up is not None and down is not None
    edge = relay_edge_id(manifest, succ)
    async with up(url, edge, upstream=True) as a, down(url, edge, upstream=False) as b:
        await a.send_message(b"boundary")
        assert await b.receive_message() == b"boundary"
        await b.send_message(b"token")
        assert await a.receive_message() == b"token"


async def test_a_keyed_ring_joins_with_its_operators_grants(start_relay: StartRelay) -> None:
    operator = Identity.generate()
    manifest, ids = keyed(operator)
    url = await start_relay(trusted_keys=frozenset({operator.public}))  # no secret at all
    for rank in range(3):
        await _pair(url, manifest, list(ids), rank)


async def test_each_connect_signs_a_fresh_token(start_relay: StartRelay) -> None:
    """Tokens live ten minutes, so a node that redials an hour later must sign anew rather than reuse one."""
    operator = Identity.generate()
    manifest, ids = keyed(operator)
    now = [float(int(time.time()))]
    url = await start_relay(trusted_keys=frozenset({operator.public}), clock=lambda: now[0])
    edge = relay_edge_id(manifest, 1)
    up = grant_connector(ids[0], manifest.ranks[0].grants, clock=lambda: now[0])
    down = grant_connector(ids[1], manifest.ranks[1].grants, clock=lambda: now[0])
    for _ in range(2):
        async with up(url, edge, upstream=True) as a, down(url, edge, upstream=False) as b:
            await a.send_message(b"x")
            assert await b.receive_message() == b"x"
        now[0] += 3 * MAX_TOKEN_LIFETIME


async def test_a_keyless_ring_still_joins_with_its_secret(start_relay: StartRelay) -> None:
    url = await start_relay(secret=bytes.fromhex(SECRET))
    await _pair(url, keyless(), [None, None, None], 0)


async def test_a_node_of_another_ring_cannot_join(start_relay: StartRelay) -> None:
    operator, stranger = Identity.generate(), Identity.generate()
    url = await start_relay(trusted_keys=frozenset({operator.public}))
    ours, _ = keyed(operator)
    theirs, their_ids = keyed(stranger)  # another ring, granted by an operator this relay does not trust
    connect = relay_connector(theirs, 0, their_ids[0])
    assert connect is not None
    with pytest.raises(RelayConnectError, match="403"):  # its own edge, as it would join it
        async with connect(url, relay_edge_id(theirs, 1), upstream=True):
            pass
    # nor ours: its operator may sign it a grant for our ring's edge, but this relay does not trust that operator
    edge, now = relay_edge_id(ours, 1), int(time.time())
    grant = EdgeGrant(ours.ring_id, edge, Role.UPSTREAM, their_ids[0].public, now + 60, stranger.public)
    token = make_token(their_ids[0], sign_grant(stranger, grant), now + 60)
    with pytest.raises(RelayConnectError, match="403"):
        async with open_relay_link(url, edge, Role.UPSTREAM, token, bearer=True):
            pass


async def test_a_token_minted_by_a_ring_member_is_refused(start_relay: StartRelay) -> None:
    operator = Identity.generate()
    manifest, ids = keyed(operator)
    url = await start_relay(trusted_keys=frozenset({operator.public}))
    member = ids[2]
    edge = relay_edge_id(manifest, 1)  # rank 0 -> rank 1: rank 2 has no business there
    now = int(time.time())
    own = sign_grant(member, EdgeGrant(manifest.ring_id, edge, Role.DOWNSTREAM, member.public, now + 60, member.public))
    # rank 1's real grant is public (it is in the manifest), but only rank 1's key can sign a token under it
    borrowed = next(g for g in manifest.ranks[1].grants if read_grant(g).edge == edge)
    for signed in (own, borrowed):
        with pytest.raises(RelayConnectError, match="403"):
            async with open_relay_link(url, edge, Role.DOWNSTREAM, make_token(member, signed, now + 60), bearer=True):
                pass
    # and rank 1 itself still joins its edge afterwards
    await _pair(url, manifest, list(ids), 0)


def test_grants_name_the_ring_each_ranks_key_and_both_its_edges() -> None:
    operator = Identity.generate()
    manifest, ids = keyed(operator)
    assert manifest.operator == operator.public and manifest.secret is None
    for rank, entry in enumerate(manifest.ranks):
        grants = {(g.edge, g.role) for g in map(read_grant, entry.grants)}
        succ = manifest.successor(rank).rank
        assert grants == {
            (relay_edge_id(manifest, rank), Role.DOWNSTREAM),
            (relay_edge_id(manifest, succ), Role.UPSTREAM),
        }
        for g in map(read_grant, entry.grants):
            assert (g.ring, g.holder, g.issuer) == (manifest.ring_id, ids[rank].public, operator.public)
    assert parse_manifest(tomllib.loads(manifest.to_toml())) == manifest  # the grants survive the TOML
    # another ring of the same model (other keys) has another id, so other edges
    other, _ = keyed(operator)
    assert other.ring_id != manifest.ring_id and relay_edge_id(other, 0) != relay_edge_id(manifest, 0)


def test_a_node_refuses_grants_for_another_key_or_a_keyed_ring_without_grants() -> None:
    manifest, ids = keyed(Identity.generate())
    with pytest.raises(InputError, match="--identity"):
        relay_connector(manifest, 0, ids[1])
    with pytest.raises(InputError, match="--identity"):
        relay_connector(manifest, 0, None)
    bare = manifest.with_keys([i.public for i in ids])
    bare = attrs.evolve(bare, operator=None, ranks=tuple(attrs.evolve(r, grants=()) for r in bare.ranks))
    assert relay_connector(bare, 0, ids[0]) is None
    with pytest.raises(InputError, match="grants"):
        RingEdges.for_node(bare, 0, None)
    with pytest.raises(InputError, match="secret"):
        RingEdges.for_node(keyless(None), 0, None)


def test_manifest_refuses_an_operator_or_grants_without_keys() -> None:
    manifest, _ = keyed(Identity.generate())
    data = tomllib.loads(manifest.to_toml())
    for rank in data["rank"]:
        del rank["key"]
    with pytest.raises(InputError, match="every rank to name its key"):
        parse_manifest(data)
    data = tomllib.loads(manifest.to_toml())
    del data["model"]["operator"]
    with pytest.raises(InputError, match="operator"):
        parse_manifest(data)


async def test_standbys_join_their_own_edges_and_the_relay_refuses_a_second_holder(start_relay: StartRelay) -> None:
    """`ring up --relay --standby`'s grants against a real relay: rank 1's standby (in its own view of the ring)
    meets rank 0 on its own edge in; on rank 2's edge in, which both holders of rank 1's window may dial, the relay
    admits one of them: the second is closed as ``taken`` (the ring's SuccessorTaken) while the first stays linked,
    and takes the end once the first has gone."""
    operator = Identity.generate()
    ids = [Identity.generate() for _ in range(3)]
    standby_ids = [Identity.generate() for _ in range(3)]
    base = keyless(None).with_keys([i.public for i in ids])
    ranks = tuple(
        attrs.evolve(r, standby=(StandbyEntry("127.0.0.1", 7200 + r.rank, standby_ids[r.rank].public),))
        for r in base.ranks
    )
    manifest = grant_relay_edges(attrs.evolve(base, ranks=ranks), operator, int(time.time()) + 3600)
    url = await start_relay(trusted_keys=frozenset({operator.public}))
    view = manifest.as_standby(1, 0)
    standby = relay_connector(view, 1, standby_ids[1])
    rank0, primary, rank2 = (relay_connector(manifest, k, ids[k]) for k in range(3))
    assert standby is not None and primary is not None and rank0 is not None and rank2 is not None
    edges = RingEdges.for_node(view, 1, None, standby)
    assert edges.edge_in == relay_edge_id(manifest, 1, 1) and edges.edge_in.endswith("-e1-s0")
    async with rank0(url, edges.edge_in, upstream=True) as a, standby(url, edges.edge_in, upstream=False) as b:
        await a.send_message(b"replay")
        assert await b.receive_message() == b"replay"

    edge2 = relay_edge_id(manifest, 2)
    assert edges.edges_out[0] == edge2
    async with primary(url, edge2, upstream=True) as live, rank2(url, edge2, upstream=False) as down:
        await live.send_message(b"boundary")
        assert await down.receive_message() == b"boundary"
        async with standby(url, edge2, upstream=True) as second:
            with pytest.raises(trio.EndOfChannel):
                await second.receive_message()
            assert second.taken
        await live.send_message(b"still linked")
        assert await down.receive_message() == b"still linked" and not live.taken
    # The primary's ends are gone: the standby takes the upstream end of rank 2's edge in.
    async with standby(url, edge2, upstream=True) as taker, rank2(url, edge2, upstream=False) as down:
        await taker.send_message(b"taken over")
        assert await down.receive_message() == b"taken over" and not taker.taken
