"""Two honest markets serving one model through one relay (outside security review 2, N14): their rings' relay
edges have the same ids, but each market's grants name a ring id of its own (the market key is in it) and the
relay keys edges by issuer too, so both rings pair and forward at once. Real markets, real relay, on loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio

from kvasir.core.identity import Identity
from kvasir.market.server.service import serve_market
from kvasir.market.server.store import MarketStore
from kvasir.relay import Relay, RelayConfig, Role, open_relay_link
from kvasir.relay.grant import make_token, read_grant
from tests.marketutil import SignAuth, signed_model
from tests.test_market import MANIFEST, SHA, _model

HOLDERS = [Identity.generate(), Identity.generate()]  # windows 0:2 and 2:4 on both markets


@asynccontextmanager
async def market(nursery: trio.Nursery, db: Path, key: Identity) -> AsyncIterator[list[list[str]]]:
    """A market with the test model, both windows claimed by HOLDERS; yields each holder's signed grants."""
    store = MarketStore(db)
    try:
        port = await nursery.start(
            lambda task_status: serve_market(db, "127.0.0.1", 0, store=store, identity=key, task_status=task_status)
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            put = await http.put(f"/v1/models/{SHA}", json=signed_model(_model(), key), auth=SignAuth(key))
            assert put.status_code == 201, put.text
            r = await http.put(f"/v1/models/{SHA}/manifest", json=MANIFEST, auth=SignAuth(key))
            assert r.status_code == 200, r.text
            grants = []
            for who, layers in zip(HOLDERS, ([0, 2], [2, 4]), strict=True):
                claim = {"model": SHA, "layers": layers, "node_id": who.node_id, "lease_s": 60}
                r = await http.post("/v1/claims", json=claim, auth=SignAuth(who))
                assert r.status_code == 200, r.text
                grants.append(r.json()["grants"])
            yield grants
    finally:
        store.close()


async def test_two_markets_share_a_relay_without_colliding(nursery: trio.Nursery, tmp_path: Path) -> None:
    keys = [Identity.generate(), Identity.generate()]
    async with (
        market(nursery, tmp_path / "a.sqlite", keys[0]) as a,
        market(nursery, tmp_path / "b.sqlite", keys[1]) as b,
    ):
        # The edge into window 1: holder 0 upstream, holder 1 downstream, in each market's ring.
        edges = [
            [
                next(read_grant(g) for g in grants[k] if read_grant(g).role == role)
                for k, role in ((0, Role.UPSTREAM), (1, Role.DOWNSTREAM))
            ]
            for grants in (a, b)
        ]
        assert edges[0][0].edge == edges[1][0].edge  # the same edge id on one relay
        assert edges[0][0].ring != edges[1][0].ring  # before: both sha256("kvasir-market-ring/v1\n" + model)
        relay = Relay(RelayConfig(trusted_keys=frozenset(k.public for k in keys), host="127.0.0.1", port=0))
        url = f"ws://127.0.0.1:{await nursery.start(relay.serve)}"
        now = int(time.time())

        def tok(grants: list[list[str]], k: int, role: Role) -> str:
            signed = next(g for g in grants[k] if read_grant(g).role == role)
            return make_token(HOLDERS[k], signed, now + 300)

        edge = edges[0][0].edge
        async with (
            open_relay_link(url, edge, Role.UPSTREAM, tok(a, 0, Role.UPSTREAM), bearer=True) as a_up,
            open_relay_link(url, edge, Role.DOWNSTREAM, tok(a, 1, Role.DOWNSTREAM), bearer=True) as a_down,
            open_relay_link(url, edge, Role.UPSTREAM, tok(b, 0, Role.UPSTREAM), bearer=True) as b_up,
            open_relay_link(url, edge, Role.DOWNSTREAM, tok(b, 1, Role.DOWNSTREAM), bearer=True) as b_down,
        ):
            await a_up.send_message(b"ring a")
            await b_up.send_message(b"ring b")
            assert await a_down.receive_message() == b"ring a"
            assert await b_down.receive_message() == b"ring b"
        assert relay.statistics().rejections == 0
