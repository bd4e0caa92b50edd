"""Credit is moved, never minted (docs/market.md § Credit; security review N7): clients hold funded accounts, a
paid request's authorisation settles once, from the receipts of every window's holder, and moves exactly its price
from the client to the holders; demand is settled traffic. Real SQLite, real HTTP on loopback; holders speak plain
signed HTTP like curl."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from kvasir.core.clientauth import MICRO, ClientAuth, parse_auth, sign_auth
from kvasir.core.errors import InputError
from kvasir.core.identity import Identity
from kvasir.market.server.service import serve_market
from kvasir.market.server.settle import Witnessed, affordable_tokens, settled_tokens, window_prices
from kvasir.market.server.store import MarketStore
from tests.marketutil import Proc, SignAuth, signed_model
from tests.test_market import MANIFEST, SHA, _claim, _model

OPERATOR = Identity.generate()
#: Window rewards at no demand (MANIFEST's weights): micro-credits per token per window.
PRICES = [1 * MICRO, 1 * MICRO, 3 * MICRO]
WINDOWS = [(0, 2), (2, 4), (4, 6)]


@attrs.define
class Market:
    http: httpx.AsyncClient
    store: MarketStore

    async def post(self, path: str, body: Any, who: Identity) -> httpx.Response:
        return await self.http.post(path, json=body, auth=SignAuth(who, self.store.clock))

    async def serve(self, who: Identity, rank: int) -> dict[str, Any]:
        """``who`` claims window ``rank`` and serves it; the lease as a credit-read body."""
        layers = WINDOWS[rank]
        lease = (await self.post("/v1/claims", _claim(who.node_id, layers=layers), who)).json()
        serving = _claim(who.node_id, layers=layers, lease_id=lease["lease_id"], state="serving", endpoint="10.0.0.1:1")
        assert (await self.post("/v1/claims/renew", serving, who)).status_code == 200
        return {"model": SHA, "layers": list(layers), "node_id": who.node_id, "lease_id": lease["lease_id"]}

    async def receipts(self, who: Identity, *receipts: dict[str, Any]) -> dict[str, Any]:
        r = await self.post("/v1/receipts", {"model": SHA, "node_id": who.node_id, "receipts": list(receipts)}, who)
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    async def balance(self, who: Identity) -> int:
        r = await self.http.get("/v1/accounts", params={"key": who.public.to_text()})
        if r.status_code == 404:
            return 0
        balance: int = r.json()["balance"]
        return balance

    async def earned(self) -> dict[str, float]:
        return {n["node_id"]: n["earned"] for n in (await self.http.get("/v1/ledger")).json()["nodes"]}

    def auth(self, client: Identity, **kw: Any) -> str:
        args: dict[str, Any] = {"max_tokens": 100, "max_price": 100 * MICRO, "not_after": int(self.store.clock()) + 600}
        return sign_auth(client, OPERATOR.public, SHA, **{**args, **kw})


@pytest.fixture
async def market(tmp_path: Path) -> AsyncIterator[Market]:
    store = MarketStore(tmp_path / "m.sqlite")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                tmp_path, "127.0.0.1", 0, store=store, identity=OPERATOR, task_status=task_status
            )
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            m = Market(client, store)
            r = await client.put(
                f"/v1/models/{SHA}", json=signed_model(_model(), OPERATOR), auth=SignAuth(OPERATOR, store.clock)
            )
            assert r.status_code == 201, r.text
            r = await client.put(f"/v1/models/{SHA}/manifest", json=MANIFEST, auth=SignAuth(OPERATOR, store.clock))
            assert r.status_code == 200, r.text
            yield m
        nursery.cancel_scope.cancel()
    store.close()


def paid(request: int, tokens: int, holders: list[str], auth: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"request": request, "tokens": tokens, "holders": holders}
    return body if auth is None else {**body, "client_auth": auth}


# ---------------------------------------------------------------------------------------------- N7


async def test_two_free_keys_mint_nothing(market: Market) -> None:
    """Security N7, against the old market: key A held window 0, its sybil B window 1, the last window uncovered.
    A's entry receipts settled alone (no exit witness) and confirmed B's window; B's credit report then took
    20,055 tokens (2.0e7 credits) with no ring, no download and no compute, and one holder's ``POST /v1/demand``
    of 10^6 tokens raised every window's reward ×1,000 for ten minutes.

    Now nothing of it earns: receipts without a client's authorisation settle nothing, an authorisation its own
    signer signed has no account behind it, a funded client's authorisation needs every window's receipt, a credit
    report is a read, and demand reports are gone. The honest path in the same market still pays."""
    a, b, c, client = Identity.generate(), Identity.generate(), Identity.generate(), Identity.generate()
    lease_b = await market.serve(b, 1)
    await market.serve(a, 0)
    ring = [a.node_id, b.node_id, ""]
    # the review's probe: invented entry receipts, then a credit report for what they "confirmed"
    flood = [paid(100 + i, 10**6, ring, None) for i in range(50)]
    assert await market.receipts(a, *flood) == {"accepted": 0, "settled": 0}
    own = market.auth(a, max_tokens=10**6)  # A pays itself: no account
    assert await market.receipts(a, paid(1, 10**6, ring, own)) == {"accepted": 0, "settled": 0}
    r = await market.post("/v1/credits", {**lease_b, "tokens": 20_055}, b)
    assert r.status_code == 200 and (r.json()["tokens"], r.json()["earned"]) == (0, 0.0)
    # a funded client's authorisation (stolen off the wire): two of three windows cannot settle it
    market.store.fund(client.public.to_text(), 1000 * MICRO)
    stolen = market.auth(client)
    for who in (a, b):
        assert await market.receipts(who, paid(2, 100, ring, stolen)) == {"accepted": 1, "settled": 0}
    r = await market.post("/v1/demand", {"model": SHA, "requests": 1, "tokens": 10**6}, a)
    assert r.status_code == 410
    rewards = [w["reward"] for w in (await market.http.get("/v1/coverage")).json()["models"][0]["windows"]]
    assert rewards == [1.0, 1.0, 3.0]
    assert await market.earned() == {} and await market.balance(client) == 1000 * MICRO
    # the honest path: the last window gets a holder, the request's three receipts settle it
    await market.serve(c, 2)
    ring = [a.node_id, b.node_id, c.node_id]
    honest = market.auth(client, max_tokens=20)
    for who in (a, b, c):
        await market.receipts(who, paid(3, 20, ring, honest))
    assert await market.balance(client) == 1000 * MICRO - 20 * sum(PRICES)
    assert await market.earned() == {a.node_id: 20.0, b.node_id: 20.0, c.node_id: 60.0}


async def test_sybils_holding_every_window_only_move_their_own_credit(market: Market) -> None:
    """Two keys of one owner hold every window and pay from the owner's own funded account: they settle, and every
    credit they earn is one their own client lost. One key alone holding every window settles nothing."""
    s1, s2, owner = Identity.generate(), Identity.generate(), Identity.generate()
    market.store.fund(owner.public.to_text(), 500 * MICRO)
    for who, rank in ((s1, 0), (s2, 1), (s1, 2)):
        await market.serve(who, rank)
    ring = [s1.node_id, s2.node_id, s1.node_id]
    for i in range(10):
        auth = market.auth(owner, max_tokens=10)
        for who in (s1, s2):
            await market.receipts(who, paid(i, 10**6, ring, auth))
    total = sum([await market.balance(k) for k in (s1, s2, owner)])
    assert total == 500 * MICRO == market.store.accounts.total()
    spent = 500 * MICRO - await market.balance(owner)
    assert spent >= 10 * 10 * sum(PRICES) - 5 * MICRO  # max_tokens capped each request (demand raised the price)
    assert sum((await market.earned()).values()) * MICRO == pytest.approx(spent)


async def test_a_lone_key_holding_every_window_settles_nothing(tmp_path: Path) -> None:
    """Nobody confirms their own work: one key's receipts for every window never settle."""
    assert settled_tokens(3, [Witnessed(r, "k", 1, 5, ("k", "k", "k")) for r in range(3)], 10) is None
    two = [Witnessed(r, h, 1, 5, ("k", "j", "k")) for r, h in enumerate(("k", "j", "k"))]
    assert settled_tokens(3, two, 10) == 5 and settled_tokens(3, two, 4) == 4
    assert settled_tokens(3, two[:2], 10) is None  # a window missing
    assert settled_tokens(3, [*two[:2], attrs.evolve(two[2], request=2)], 10) is None  # another request
    assert settled_tokens(3, [*two[:2], attrs.evolve(two[2], holders=("k", "x", "k"))], 10) is None
    assert settled_tokens(3, [*two[:2], attrs.evolve(two[2], witness="x")], 10) is None
    assert settled_tokens(3, [*two[:2], attrs.evolve(two[2], tokens=3)], 10) == 3  # the smallest count
    assert settled_tokens(1, [Witnessed(0, "k", 1, 5, ("k",))], 10) is None  # a one-window ring
    assert window_prices([1.0, 1.0, 3.0], 10**9) == PRICES
    assert window_prices([1.0, 1.0, 3.0], 2_500_000) == [500_000, 500_000, 1_500_000]  # scaled to the cap
    assert sum(window_prices([1.0, 1.0, 1.0], 1_000_000)) <= 1_000_000
    assert affordable_tokens(10, 3, 20) == 6 and affordable_tokens(10, 0, 0) == 10 and affordable_tokens(5, 3, 0) == 0


# ---------------------------------------------------------------------------------------------- honest traffic


async def test_a_paid_request_moves_exactly_its_price_once(market: Market) -> None:
    """An honest ring of three holders serves a client's paid request: the client pays tokens × the windows' prices,
    each holder gets tokens × its window's price (the smallest count the windows saw, at most what the client
    authorised), once: the same authorisation again, under another request id or from a later lease, moves
    nothing. Credit is conserved: the balances add up to what was funded."""
    hs = [Identity.generate() for _ in range(3)]
    client = Identity.generate()
    leases = [await market.serve(h, r) for r, h in enumerate(hs)]
    ring = [h.node_id for h in hs]
    market.store.fund(client.public.to_text(), 1000 * MICRO)
    auth = market.auth(client, max_tokens=40)
    # the last rank's count is one smaller (it ended first); the authorisation caps nothing here
    replies = [await market.receipts(h, paid(7, 12 if r < 2 else 11, ring, auth)) for r, h in enumerate(hs)]
    assert replies == [{"accepted": 1, "settled": 0}, {"accepted": 1, "settled": 0}, {"accepted": 1, "settled": 1}]
    assert await market.balance(client) == 1000 * MICRO - 11 * sum(PRICES)
    assert [await market.balance(h) for h in hs] == [11 * p for p in PRICES]
    for h, lease, p in zip(hs, leases, PRICES, strict=True):
        r = (await market.post("/v1/credits", {**lease, "tokens": 10**9}, h)).json()
        assert (r["tokens"], r["layer_tokens"], r["earned"]) == (11, 22, 11 * p / MICRO)
    rows = {n["node_id"]: n for n in (await market.http.get("/v1/ledger")).json()["nodes"]}
    assert rows[hs[1].node_id]["confirmed_by"] == {hs[0].node_id: 11, hs[2].node_id: 11}
    # settled once: a replay (same or another request id) moves nothing
    for h in hs:
        assert await market.receipts(h, paid(7, 12, ring, auth), paid(8, 12, ring, auth)) == {
            "accepted": 0,
            "settled": 0,
        }
    assert await market.balance(client) == 1000 * MICRO - 11 * sum(PRICES)
    assert market.store.accounts.total() == 1000 * MICRO
    # demand is the settled traffic: 11 tokens
    assert (await market.http.get("/v1/demand")).json()["models"][0]["tokens"] == 11


async def test_authorisations_that_cannot_pay_settle_nothing_or_less(market: Market) -> None:
    """The client's limits hold: a price cap below the market's price scales every window's share down; a balance
    short of the price pays what it covers; another market's, another model's, an expired or a forged
    authorisation is not taken; a receipt naming other holders than the senders never completes."""
    hs = [Identity.generate() for _ in range(3)]
    client = Identity.generate()
    for r, h in enumerate(hs):
        await market.serve(h, r)
    ring = [h.node_id for h in hs]
    market.store.fund(client.public.to_text(), 100 * MICRO)

    async def settle(auth: str, request: int, tokens: int, holders: list[str] = ring) -> list[dict[str, Any]]:
        return [await market.receipts(h, paid(request, tokens, holders, auth)) for h in hs]

    capped = market.auth(client, max_price=MICRO)  # 1 credit per token for all windows: a fifth of the price
    await settle(capped, 1, 10)
    assert [await market.balance(h) for h in hs] == [2 * MICRO, 2 * MICRO, 6 * MICRO]
    assert await market.balance(client) == 90 * MICRO
    demand = (await market.http.get("/v1/demand")).json()["models"][0]
    assert (demand["requests"], demand["tokens"]) == (1, 2)  # 10 tokens paid at a fifth of the price count as 2
    # an authorisation capped at nothing settles, moves nothing and raises no reward
    assert sum(r["settled"] for r in await settle(market.auth(client, max_price=0), 2, 1000)) == 1
    assert await market.balance(client) == 90 * MICRO
    assert (await market.http.get("/v1/demand")).json()["models"][0]["tokens"] == 2
    now = int(market.store.clock())
    refused = [
        sign_auth(client, Identity.generate().public, SHA, max_tokens=9, max_price=MICRO, not_after=now + 60),
        sign_auth(client, OPERATOR.public, "cd" * 32, max_tokens=9, max_price=MICRO, not_after=now + 60),
        market.auth(client, not_after=now - 2 * 3600),
        market.auth(client, not_after=now + 7 * 24 * 3600),
        market.auth(Identity.generate()),  # a key without an account
    ]
    body, sig = market.auth(client).rsplit(".", 1)
    refused.append(f"{body}.{sig[:-6]}AAAAAA")
    for i, auth in enumerate(refused):
        assert await settle(auth, 10 + i, 5) == [{"accepted": 0, "settled": 0}] * 3, i
    other = [ring[0], Identity.generate().node_id, ring[2]]
    assert sum(r["settled"] for r in await settle(market.auth(client), 20, 5, other)) == 0
    assert await market.balance(client) == 90 * MICRO
    # 90 credits do not cover 30 tokens at the windows' prices (raised a little by the 10 tokens settled): the
    # request pays for as many whole tokens as they cover
    windows = (await market.http.get("/v1/coverage")).json()["models"][0]["windows"]
    prices = window_prices([w["reward"] for w in windows], 100 * MICRO)
    covered = 90 * MICRO // sum(prices)
    assert 10 < covered < 30
    before = [await market.balance(h) for h in hs]
    await settle(market.auth(client), 21, 30)
    assert await market.balance(client) == 90 * MICRO - covered * sum(prices)
    assert [await market.balance(h) - b for h, b in zip(hs, before, strict=True)] == [covered * p for p in prices]
    assert market.store.accounts.total() == 100 * MICRO


def test_client_authorisations_are_signed_text(tmp_path: Path) -> None:
    client, market = Identity.generate(), Identity.generate()
    text = sign_auth(client, market.public, SHA, max_tokens=8, max_price=5, not_after=123, nonce="abcdefgh")
    auth = parse_auth(text)
    assert auth == ClientAuth(client.public, market.public, SHA, "abcdefgh", 8, 5, 123)
    assert auth.auth_id != parse_auth(sign_auth(client, market.public, SHA, max_tokens=8, max_price=5,
                                                not_after=123)).auth_id  # fmt: skip
    body, sig = text.split(".")[1:]
    tampered = f"ka1.{body[:-2]}AA.{sig}"
    for bad in (tampered, "ka1.x", "kt1." + body + "." + sig, "x" * 2000, "ka1.é.x"):
        with pytest.raises(InputError):
            parse_auth(bad)
    with pytest.raises(InputError, match="pays for"):
        sign_auth(client, market.public, SHA, max_tokens=0, max_price=5, not_after=1)


def test_market_fund_and_authorize_commands(tmp_path: Path) -> None:
    """``kvasir market fund`` writes the market's database (real SQLite); bad input is one line and exit 2;
    ``kvasir market authorize`` prints an authorisation the market parses."""
    db = tmp_path / "m.sqlite"
    MarketStore(db).close()
    client = Identity.generate()
    fund = Proc("market", "fund", "--db", str(db), "--key", client.public.to_text(), "--credits", "12.5")
    assert fund.wait(60) == 0, fund.err
    store = MarketStore(db)
    assert store.account(client.public.to_text())["balance"] == 12_500_000
    with pytest.raises(InputError, match="in all"):  # all balances together stay below 10^18 micro-credits
        store.fund(Identity.generate().public.to_text(), 10**18)
    store.close()
    for bad in (["--credits", "1e400"], ["--credits", "0.0000001"], ["--credits", "-1"], ["--key", "nope"]):
        args = {"--key": client.public.to_text(), "--credits": "1", **dict([bad])}
        p = Proc("market", "fund", "--db", str(db), *(x for kv in args.items() for x in kv))
        assert p.wait(60) == 2 and len(p.err) == 1 and "error" in p.err[0], (bad, p.err)
    key_file = tmp_path / "client.pem"
    pay = Proc("market", "authorize", "--market-key", OPERATOR.public.to_text(), "--model", SHA, "--max-tokens",
               "16", "--max-price", "0.5", "--identity", str(key_file), "--create-identity")  # fmt: skip
    assert pay.wait(60) == 0, pay.err
    auth = parse_auth(pay.out[-1])
    assert (auth.model, auth.max_tokens, auth.max_price, auth.market) == (SHA, 16, 500_000, OPERATOR.public)
