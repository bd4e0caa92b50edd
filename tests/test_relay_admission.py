"""Relay admission with v2 edge tokens (relay/grant.py) against a real relay on 127.0.0.1: refused at the upgrade."""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio

from kvasir.core.identity import Identity
from kvasir.relay import CloseCode, Relay, RelayConfig, RelayConnectError, RelayLinkClosed, Role, open_relay_link
from kvasir.relay.grant import EdgeGrant, make_token, sign_grant
from kvasir.relay.ringlink import grant_connector
from kvasir.util.addrgroup import address_group as _address_group

RING = hashlib.sha256(b"ring manifest").hexdigest()
UP, DOWN = Role.UPSTREAM, Role.DOWNSTREAM
OPERATOR = Identity.generate()

StartRelay = Callable[..., Awaitable[tuple[Relay, str]]]


def token(holder: Identity, edge: str, role: Role, operator: Identity = OPERATOR, lifetime: int = 300) -> str:
    now = int(time.time())
    grant = EdgeGrant(RING, edge, role, holder.public, now + 3600, operator.public)
    return make_token(holder, sign_grant(operator, grant), now + lifetime)


@pytest.fixture
async def start_relay(nursery: trio.Nursery) -> AsyncIterator[StartRelay]:
    async def start(**overrides: Any) -> tuple[Relay, str]:
        relay = Relay(RelayConfig(trusted_keys=frozenset({OPERATOR.public}), host="127.0.0.1", port=0, **overrides))
        port = await nursery.start(relay.serve)
        return relay, f"ws://127.0.0.1:{port}"

    yield start


async def test_two_holders_pair_and_forward(start_relay: StartRelay) -> None:
    relay, url = await start_relay()
    a, b = Identity.generate(), Identity.generate()
    async with (
        open_relay_link(url, "e1", UP, token(a, "e1", UP), bearer=True) as up,
        open_relay_link(url, "e1", DOWN, token(b, "e1", DOWN), bearer=True) as down,
    ):
        await up.send_message(b"boundary")
        assert await down.receive_message() == b"boundary"
        await down.send_message(b"token")
        assert await up.receive_message() == b"token"
    assert relay.statistics().rejections == 0


@pytest.mark.parametrize("case", ["no-token", "minted-by-member", "foreign-edge", "expired", "too-long"])
async def test_bad_tokens_are_refused_before_the_websocket_opens(start_relay: StartRelay, case: str) -> None:
    relay, url = await start_relay()
    member = Identity.generate()
    tokens = {
        "no-token": None,
        "minted-by-member": token(member, "e1", UP, operator=member),
        "foreign-edge": token(member, "e2", UP),
        "expired": token(member, "e1", UP, lifetime=-1),
        "too-long": token(member, "e1", UP, lifetime=24 * 3600),
    }
    chosen = tokens[case]
    with pytest.raises(RelayConnectError):  # an HTTP refusal: no WebSocket, so no message was ever read
        async with open_relay_link(url, "e1", UP, chosen or "", bearer=chosen is not None):
            pass
    assert relay.statistics().rejections == 1
    assert relay.statistics().messages_forwarded == 0


async def test_a_role_is_held_by_its_key_and_yields_only_to_the_same_key(start_relay: StartRelay) -> None:
    _, url = await start_relay(wait_timeout=5)
    holder, other = Identity.generate(), Identity.generate()
    async with open_relay_link(url, "e1", UP, token(holder, "e1", UP), bearer=True) as first:
        # Another key with its own valid grant for the same role cannot squat the live slot.
        async with open_relay_link(url, "e1", UP, token(other, "e1", UP), bearer=True) as squatter:
            with pytest.raises(RelayLinkClosed) as info:
                await squatter.receive_message()
            assert info.value.code == CloseCode.ROLE_TAKEN
        # The same key again (a restarted node), with a later token, replaces its stale connection.
        async with open_relay_link(url, "e1", UP, token(holder, "e1", UP, lifetime=301), bearer=True) as again:
            with pytest.raises(RelayLinkClosed) as info:
                await first.receive_message()
            assert info.value.code == CloseCode.ROLE_TAKEN
            async with open_relay_link(url, "e1", DOWN, token(other, "e1", DOWN), bearer=True) as down:
                await again.send_message(b"x")
                assert await down.receive_message() == b"x"


async def test_connection_caps_refuse_at_the_upgrade(start_relay: StartRelay) -> None:
    relay, url = await start_relay(max_connections=2)
    holders = [Identity.generate() for _ in range(3)]
    async with (
        open_relay_link(url, "e1", UP, token(holders[0], "e1", UP), bearer=True),
        open_relay_link(url, "e2", UP, token(holders[1], "e2", UP), bearer=True),
    ):
        with pytest.raises(RelayConnectError):
            async with open_relay_link(url, "e3", UP, token(holders[2], "e3", UP), bearer=True):
                pass
    assert relay.statistics().rejections_by_code.get(int(CloseCode.TOO_MANY_CONNECTIONS)) == 1


def test_ipv6_addresses_are_capped_per_64() -> None:
    assert _address_group("2001:db8:1:2:aaaa::1") == _address_group("2001:db8:1:2:ffff::9")
    assert _address_group("2001:db8:1:2::1") != _address_group("2001:db8:1:3::1")
    assert _address_group("::ffff:10.0.0.1") == _address_group("10.0.0.1") == "10.0.0.1"
    assert _address_group("192.0.2.1") != _address_group("192.0.2.2")


# Outside security review 2, findings N13 and N14: each test runs the attack, then shows the honest holder served.


async def _refused_at_upgrade(url: str, edge: str, role: Role, tok: str) -> str:
    with pytest.raises(RelayConnectError) as info:
        async with open_relay_link(url, edge, role, tok, bearer=True):
            pass
    return str(info.value)


async def test_a_captured_token_cannot_displace_its_holder(start_relay: StartRelay) -> None:
    """N13: a token replayed by whoever saw it is refused (each opens one connection); the holder keeps its edge,
    and a later token of the same key (the node itself, after a half-open link) still takes over."""
    relay, url = await start_relay(wait_timeout=5)
    holder, peer = Identity.generate(), Identity.generate()
    captured = token(holder, "e1", UP)
    async with (
        open_relay_link(url, "e1", UP, captured, bearer=True) as live,
        open_relay_link(url, "e1", DOWN, token(peer, "e1", DOWN), bearer=True) as down,
    ):
        for _ in range(5):  # before: each replay closed the live holder with 4006 "replaced by a newer connection"
            assert "403" in await _refused_at_upgrade(url, "e1", UP, captured)
        await live.send_message(b"still mine")
        assert await down.receive_message() == b"still mine"
        assert relay.statistics().rejections_by_code[int(CloseCode.TOKEN_REUSED)] == 5
        # The same key with a fresh token that is not later than the live one's: refused after the upgrade.
        async with open_relay_link(url, "e1", UP, token(holder, "e1", UP, lifetime=299), bearer=True) as older:
            with pytest.raises(RelayLinkClosed) as info:
                await older.receive_message()
            assert info.value.code == CloseCode.ROLE_TAKEN
        await live.send_message(b"and still")
        assert await down.receive_message() == b"and still"
    # Nor once the holder has left: a token is good for one connection, not for its ten minutes.
    assert "403" in await _refused_at_upgrade(url, "e1", UP, captured)


async def test_a_node_that_lost_its_link_rejoins_at_once(start_relay: StartRelay) -> None:
    """N13, the honest side: a node's connector makes a newer token at every connect, so two connects within one
    second both get in, and the second replaces the first (which the relay may still think alive)."""
    _, url = await start_relay(wait_timeout=5)
    holder, peer = Identity.generate(), Identity.generate()
    now = int(time.time())
    signed = sign_grant(OPERATOR, EdgeGrant(RING, "e1", UP, holder.public, now + 3600, OPERATOR.public))
    connect = grant_connector(holder, [signed], clock=lambda: now)  # a frozen clock: every connect in one second
    async with (
        connect(url, "e1", upstream=True) as first,
        connect(url, "e1", upstream=True) as second,
        open_relay_link(url, "e1", DOWN, token(peer, "e1", DOWN), bearer=True) as down,
    ):
        with pytest.raises(trio.EndOfChannel, match="4006"):
            await first.receive_message()
        await second.send_message(b"back")
        assert await down.receive_message() == b"back"


async def test_another_operator_cannot_reach_an_edge_of_this_ring(nursery: trio.Nursery) -> None:
    """N14: two operators a relay trusts share nothing: the second one's grant for the first one's ring and edge
    opens an edge of its own, so it neither receives the first ring's messages nor locks its holders out."""
    other = Identity.generate()
    relay = Relay(RelayConfig(trusted_keys=frozenset({OPERATOR.public, other.public}), host="127.0.0.1", port=0))
    url = f"ws://127.0.0.1:{await nursery.start(relay.serve)}"
    holder, peer, thief = Identity.generate(), Identity.generate(), Identity.generate()
    async with (
        open_relay_link(url, "e1", UP, token(holder, "e1", UP), bearer=True) as up,
        open_relay_link(url, "e1", DOWN, token(thief, "e1", DOWN, operator=other), bearer=True) as spy,
    ):
        await up.send_message(b"boundary")
        with trio.move_on_after(0.5):  # before: the other operator's key was paired with our holder
            got = await spy.receive_message()
            raise AssertionError(f"another operator's key received {got!r}")
        async with open_relay_link(url, "e1", DOWN, token(peer, "e1", DOWN), bearer=True) as down:
            assert await down.receive_message() == b"boundary"
            await down.send_message(b"token")
            assert await up.receive_message() == b"token"
    assert relay.statistics().rejections_by_code.get(int(CloseCode.ROLE_TAKEN)) is None
