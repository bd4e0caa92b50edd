"""Who a node accepts as its predecessor (issue 24 N2, N4, N10): each attack of the outside review against a keyed
FakeStage ring, and in the same test the real predecessor linking and the ring answering.

N2 and N10 run on memory streams (fast); N4 on loopback TCP, with the attacker's connections from four /24 networks
of 127/8 (Linux routes all of it to loopback).
"""

from __future__ import annotations

import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio

from kvasir.core.identity import Identity
from kvasir.market.tickets import WindowTicket, issue_ticket, predecessor_ticket_policy
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.opener import MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_ADDRESS, _Pending, evictee
from kvasir.ring.secure import Credentials, LinkAuthError, dial_secure
from kvasir.testing.fakestage import FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.util.addrgroup import network_group
from kvasir.wire import Boundary, BoundaryDType, Error, FrameReader, Hello
from tests.streams import wait_for
from tests.test_trusted_links import PROMPT, WINDOWS, generate

MARKET = Identity.generate()


def _ticket(holder: Identity, window: tuple[int, int], model: str) -> bytes:
    t = WindowTicket(model, window[0], window[1], holder.public, int(time.time()) + 300, MARKET.public)
    return issue_ticket(MARKET, t).encode()


def _hello(node: Node, who: Identity, rank: int, window: tuple[int, int]) -> Hello:
    return Hello(
        node_id=who.node_id,
        model_id=node.manifest.model_sha256,
        rank=rank,
        ring_size=len(WINDOWS),
        window_start=window[0],
        window_end=window[1],
        n_layers=WINDOWS[-1][1],
        n_embd=node.links.hello.n_embd,
        dtypes=frozenset(BoundaryDType),
    )


@asynccontextmanager
async def market_ring(
    manifest: Manifest, stages: list[FakeStage], ids: list[Identity], net: MemoryNetwork | None
) -> AsyncIterator[Callable[[int], Awaitable[Node]]]:
    """Starts ranks on demand (``await start(r)``): market-ring nodes whose predecessor policy is the agent's."""
    model = manifest.model_sha256
    async with AsyncExitStack() as stack:

        async def start(r: int) -> Node:
            config = NodeConfig(
                manifest,
                r,
                identity=ids[r],
                idle_timeout=5.0,
                peer_policy=lambda: predecessor_ticket_policy(MARKET.public, model, manifest, r),
                ticket=lambda: _ticket(ids[r], WINDOWS[r], model),
            )
            return await stack.enter_async_context(open_node(config, stages[r], transport=net, rng=random.Random(r)))

        yield start


async def _closed_within(stream: trio.abc.Stream, seconds: float) -> bool:
    """Whether the node closes ``stream`` within ``seconds`` (it sends nothing before that)."""
    with trio.move_on_after(seconds):
        try:
            while await stream.receive_some():
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        return True
    return False


# ---------------------------------------------------------------------------------------------- N2


async def test_a_ticket_admits_only_the_predecessor_window_and_the_hello_must_claim_it() -> None:
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net)
    ids = [Identity.generate() for _ in WINDOWS]
    manifest = manifest.with_keys([i.public for i in ids])
    model = manifest.model_sha256
    evil = Identity.generate()
    with trio.fail_after(30):
        async with market_ring(manifest, stages, ids, net) as start:
            n1, n2 = await start(1), await start(2)
            await wait_for(lambda: n2.links.predecessor is not None, "rank 1 to link to rank 2", 10)
            # B9: the holder of the NEXT window (rank 2's, 4:6) poses as rank 0 while rank 1's predecessor slot is
            # free. It used to pass AUTH ("near") and link as rank 1's predecessor; now AUTH refuses it.
            with pytest.raises(LinkAuthError):
                await dial_secure(
                    await net.connect("mem", manifest.rank(1).port),
                    Credentials.of(evil),
                    ids[1].public,
                    _ticket(evil, WINDOWS[2], model),
                )
            assert n1.links.predecessor is None
            # Rank 2's successor window (rank 0's, 0:2, near by the ring's wrap) admits nobody at rank 2 either.
            with pytest.raises(LinkAuthError):
                await dial_secure(
                    await net.connect("mem", manifest.rank(2).port),
                    Credentials.of(evil),
                    ids[2].public,
                    _ticket(evil, WINDOWS[0], model),
                )
            # A ticket for rank 2's predecessor window (2:4) with a HELLO that claims another window (3:4, which
            # joins rank 2 in ring order all the same): refused at the HELLO, before rank 2 says who it is.
            tls = await dial_secure(
                await net.connect("mem", manifest.rank(2).port),
                Credentials.of(evil),
                ids[2].public,
                _ticket(evil, WINDOWS[1], model),
            )
            await tls.send_all(_hello(n2, evil, 1, (3, 4)).to_wire())
            reply = await FrameReader(tls).receive()
            assert isinstance(reply, Error) and "ticket is for window 2:4" in reply.message, reply
            # The same ticket with its own window passes admission: only the slot (rank 1 holds it) refuses it.
            tls = await dial_secure(
                await net.connect("mem", manifest.rank(2).port),
                Credentials.of(evil),
                ids[2].public,
                _ticket(evil, WINDOWS[1], model),
            )
            await tls.send_all(_hello(n2, evil, 1, WINDOWS[1]).to_wire())
            reader = FrameReader(tls)
            assert isinstance(await reader.receive(), Hello)
            reply = await reader.receive()
            assert isinstance(reply, Error) and "already has a linked predecessor" in reply.message
            assert n2.links.predecessor_key == ids[1].public
            # The honest path: rank 0 comes up, links as rank 1's predecessor, and the ring answers.
            n0 = await start(0)
            await wait_for(lambda: n0.ready and n1.ready and n2.ready, "the ring to link", 20)
            assert n1.links.predecessor_key == ids[0].public
            assert await generate(n0, PROMPT, 8) == expected_tokens(PROMPT, 8)


# ---------------------------------------------------------------------------------------------- N10


async def test_before_its_hello_an_authenticated_peer_is_bounded_and_counted() -> None:
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net)
    ids = [Identity.generate() for _ in WINDOWS]
    manifest = manifest.with_keys([i.public for i in ids])
    model = manifest.model_sha256
    port = manifest.rank(1).port
    with trio.fail_after(30):
        async with market_ring(manifest, stages, ids, net) as start:
            nodes = [await start(r) for r in range(len(WINDOWS))]
            await wait_for(lambda: all(n.ready for n in nodes), "the ring to link", 20)
            # B7: the predecessor's own key, a 60 MiB BOUNDARY header as its first frame inside TLS: refused at
            # the header (it used to be read whole: +60 MiB per connection).
            tls = await dial_secure(await net.connect("mem", port), Credentials.of(ids[0]), ids[1].public)
            bomb = Boundary(1, 0, 1, 16, BoundaryDType.F32, bytes(64)).to_wire()[:24]
            await tls.send_all(bomb[:20] + (60 << 20).to_bytes(4, "little"))  # the header's body length
            assert await _closed_within(tls, 3)
            # One connection per key before its HELLO: the second of one key closes the first.
            first = await dial_secure(await net.connect("mem", port), Credentials.of(ids[0]), ids[1].public)
            second = await dial_secure(await net.connect("mem", port), Credentials.of(ids[0]), ids[1].public)
            assert await _closed_within(first, 1)
            await second.aclose()
            # Authenticated connections that send no HELLO hold pending slots (they used to hold none): window 0:2's
            # ticket holders from one address, one more than the group's slots, and the oldest is closed.
            holders = [Identity.generate() for _ in range(MAX_PENDING_PER_ADDRESS + 1)]
            held = [
                await dial_secure(
                    await net.connect("mem", port), Credentials.of(h), ids[1].public, _ticket(h, WINDOWS[0], model)
                )
                for h in holders
            ]
            assert await _closed_within(held[0], 1)
            assert not await _closed_within(held[-1], 0.2)
            # The honest path: the real predecessor relinks after a drop and the ring answers.
            link = nodes[1].links.predecessor
            assert link is not None
            await link.aclose()
            await wait_for(lambda: nodes[1].links.predecessor not in (None, link), "rank 0 to relink", 10)
            assert nodes[1].links.predecessor_key == ids[0].public
            assert await generate(nodes[0], PROMPT, 8) == expected_tokens(PROMPT, 8)
            for s in held:
                await s.aclose()


# ---------------------------------------------------------------------------------------------- N4


def test_a_full_table_evicts_its_oldest_and_ipv4_groups_by_slash_24() -> None:
    assert network_group("192.0.2.1") == network_group("192.0.2.200") != network_group("192.0.3.1")
    assert network_group("::ffff:192.0.2.9") == "192.0.2.0/24"
    assert network_group("2001:db8:1:2::1") == network_group("2001:db8:1:2:ffff::9")
    pending = [_Pending(f"10.0.{k % 4}.0/24", reserved=False) for k in range(MAX_PENDING_HANDSHAKES)]
    assert evictee(pending, "10.0.9.0/24", reserved=False) is pending[0]  # the oldest, not the newcomer
    assert evictee(pending, "10.0.2.0/24", reserved=False) is pending[2]  # its group's oldest
    assert evictee(pending, "10.0.9.0/24", reserved=True) is None  # the predecessor's address: slots of its own
    assert evictee(pending[:3], "10.0.9.0/24", reserved=False) is None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _hold_slot(source: str, port: int) -> None:
    """One attacker slot: connect from ``source``, say nothing, reconnect the moment the node closes it."""
    while True:
        sock = trio.socket.socket()
        try:
            await sock.bind((source, 0))
            await sock.connect(("127.0.0.1", port))
            while await sock.recv(4096):
                pass
        except OSError:
            await trio.sleep(0.01)
        finally:
            sock.close()


async def test_held_handshake_slots_do_not_lock_the_predecessor_out() -> None:
    """A11: 16 silent connections from four networks (reconnected as soon as dropped) used to keep the real
    predecessor out after a link drop for as long as the attack lasted."""
    manifest, stages = fake_ring(WINDOWS, MemoryNetwork())
    ranks = tuple(RankEntry(r.rank, r.start, r.end, "127.0.0.1", _free_port()) for r in manifest.ranks)
    ids = [Identity.generate() for _ in WINDOWS]
    manifest = Manifest(manifest.model_sha256, manifest.n_layers, ranks, model_name="fake").with_keys(
        [i.public for i in ids]
    )
    port = manifest.rank(1).port
    with trio.fail_after(40):
        async with market_ring(manifest, stages, ids, None) as start:
            nodes = [await start(r) for r in range(len(WINDOWS))]
            await wait_for(lambda: all(n.ready for n in nodes), "the ring to link", 20)
            async with trio.open_nursery() as attack:
                for k in range(MAX_PENDING_HANDSHAKES):
                    attack.start_soon(_hold_slot, f"127.0.{1 + k % 4}.1", port)
                await trio.sleep(1.0)  # the table is full
                link = nodes[1].links.predecessor
                assert link is not None
                await link.aclose()  # the drop (a restart, a network change)
                await wait_for(lambda: nodes[1].links.predecessor not in (None, link), "rank 0 to relink", 8)
                assert nodes[1].links.predecessor_key == ids[0].public
                assert await generate(nodes[0], PROMPT, 8) == expected_tokens(PROMPT, 8)
                attack.cancel_scope.cancel()
