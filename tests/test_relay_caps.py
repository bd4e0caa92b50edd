"""Security N5: the relay's connection caps cannot be used up by strangers. A real relay on 127.0.0.1 (a ``kvasir
relay`` process, or in process where the test reads its counters); attackers connect from other loopback addresses
(127.0.X.Y: other /24 groups than the honest nodes' 127.0.0.1)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio

from kvasir.core.identity import Identity
from kvasir.relay import Relay, RelayConfig, Role, open_relay_link
from kvasir.relay.conns import ConnTable
from kvasir.relay.grant import EdgeGrant, make_token, sign_grant
from tests.marketutil import Proc, procs

RING = "ab" * 32
UP, DOWN = Role.UPSTREAM, Role.DOWNSTREAM
OPERATOR = Identity.generate()

StartRelay = Callable[..., Awaitable[tuple[Relay, str]]]


def token(holder: Identity, edge: str, role: Role) -> str:
    now = int(time.time())
    grant = EdgeGrant(RING, edge, role, holder.public, now + 3600, OPERATOR.public)
    return make_token(holder, sign_grant(OPERATOR, grant), now + 300)


@pytest.fixture
async def start_relay(nursery: trio.Nursery) -> AsyncIterator[StartRelay]:
    async def start(**overrides: Any) -> tuple[Relay, str]:
        relay = Relay(RelayConfig(trusted_keys=frozenset({OPERATOR.public}), host="127.0.0.1", port=0, **overrides))
        port = await nursery.start(relay.serve)
        return relay, f"ws://127.0.0.1:{port}"

    yield start


Strangers = list[trio.socket.SocketType]


@pytest.fixture
async def strangers() -> AsyncIterator[Strangers]:
    """The attackers' sockets, closed at the end of the test whatever happened."""
    held: Strangers = []
    yield held
    for s in held:
        s.close()


async def _idle(held: Strangers, url: str, source: str, n: int) -> Strangers:
    """``n`` more TCP connections from ``source`` that never send a byte (a stranger holding places)."""
    port = int(url.rsplit(":", 1)[1])
    new = []
    for _ in range(n):
        s = trio.socket.socket()
        held.append(s)
        await s.bind((source, 0))
        await s.connect(("127.0.0.1", port))
        new.append(s)
    return new


async def _closed_by_relay(s: trio.socket.SocketType) -> bool:
    with trio.move_on_after(0.5):
        try:
            return await s.recv(1) == b""
        except OSError:
            return True
    return False


async def _honest_pair_forwards(url: str, edge: str) -> None:
    """Two holders with valid grants join an edge from 127.0.0.1 and forward both ways (the honest path)."""
    a, b = Identity.generate(), Identity.generate()
    async with (
        open_relay_link(url, edge, UP, token(a, edge, UP), bearer=True) as up,
        open_relay_link(url, edge, DOWN, token(b, edge, DOWN), bearer=True) as down,
    ):
        await up.send_message(b"boundary")
        assert await down.receive_message() == b"boundary"
        await down.send_message(b"token")
        assert await up.receive_message() == b"token"


async def test_one_address_cannot_use_up_the_global_cap(strangers: Strangers) -> None:
    """N5, against a ``kvasir relay`` process. Before: connections over the per-address cap still counted toward
    the global cap, and each was held through the WebSocket handshake (10 s) before its 429, so idle connections
    from one address made valid joins from elsewhere get 429 (the review: ~1,500 from one address,
    ``{'HTTP/1.1 429': 26}``; here 200 against a cap of 32, and the honest pair got 429). Now: a newcomer over its
    group's cap takes the place of that group's oldest connection not yet admitted, so one /24 holds at most
    ``--max-conns-per-ip`` places, and the honest pair joins and forwards."""
    caps = ("--max-conns-per-ip", "8", "--max-connections", "32")
    with procs() as ps:
        relay = Proc("relay", "--listen", "127.0.0.1:0", "--trust-key", OPERATOR.public.to_text(), *caps)
        ps.append(relay)
        url = relay.wait_line(r"listening on (ws://\S+)").group(1)
        with trio.fail_after(60):
            held = await _idle(strangers, url, "127.0.5.1", 100) + await _idle(strangers, url, "127.0.5.77", 100)
            await _honest_pair_forwards(url, "e1")
            closed = [await _closed_by_relay(s) for s in held[:20]]
            assert all(closed)  # the oldest were closed to make room, not the newest refused


async def test_a_full_relay_evicts_the_oldest_stranger_never_an_admitted_edge(
    start_relay: StartRelay, strangers: Strangers
) -> None:
    """N5, the global cap. Before: a full relay refused the newest connection (429), so strangers from a few /24s
    holding every place kept valid joins out. Now the newcomer takes the place of the oldest connection whose token
    is not checked yet; connections with a checked token are never evicted, and the relay refuses a newcomer (429,
    never counted) only when every place holds one."""
    with trio.fail_after(60):
        relay, url = await start_relay(max_conns_per_ip=8, max_connections=24, wait_timeout=30)
        a, b = Identity.generate(), Identity.generate()
        async with (
            open_relay_link(url, "live", UP, token(a, "live", UP), bearer=True) as up,
            open_relay_link(url, "live", DOWN, token(b, "live", DOWN), bearer=True) as down,
        ):
            for k in range(5):  # 5 /24s x 8 = 40 strangers for the 22 free places
                await _idle(strangers, url, f"127.0.{10 + k}.1", 8)
            await trio.sleep(0.3)
            assert relay.statistics().connections == 24
            await _honest_pair_forwards(url, "e2")  # evicts the oldest strangers
            assert await _closed_by_relay(strangers[0]) and not await _closed_by_relay(strangers[-1])
            await up.send_message(b"still linked")  # the admitted edge was never a candidate
            assert await down.receive_message() == b"still linked"


async def test_a_silent_stranger_is_closed_after_a_short_time(start_relay: StartRelay, strangers: Strangers) -> None:
    """N5: a connection that sends nothing held its place 10 s before the relay gave up on its upgrade; now 3 s
    (the default ``handshake_timeout``), and an honest pair joins meanwhile."""
    with trio.fail_after(30):
        _, url = await start_relay()
        (silent,) = await _idle(strangers, url, "127.0.6.1", 1)
        started = trio.current_time()
        await _honest_pair_forwards(url, "e1")
        with trio.fail_after(8):
            assert await silent.recv(1) == b""
        waited = trio.current_time() - started
        assert 2.0 < waited < 6.0, waited


def test_the_table_evicts_the_oldest_unauthenticated_and_never_counts_a_refusal() -> None:
    table = ConnTable(per_group=2, total=3)
    a1, a2 = table.admit("A"), table.admit("A")
    assert a1 is not None and a2 is not None
    a3 = table.admit("A")  # group full: its oldest unauthenticated makes room
    assert a3 is not None and a1.scope.cancel_called and table.group_count("A") == 2
    b1 = table.admit("B")
    assert b1 is not None and len(table) == 3
    a2.authenticated = a3.authenticated = True
    c1 = table.admit("C")  # all full: the oldest unauthenticated anywhere (b1)
    assert c1 is not None and b1.scope.cancel_called and len(table) == 3
    c1.authenticated = True
    assert table.admit("D") is None and len(table) == 3  # refused, not counted
    assert table.admit("A") is None and table.group_count("A") == 2
    table.release(a2)
    assert table.admit("D") is not None and table.evictions == 2
