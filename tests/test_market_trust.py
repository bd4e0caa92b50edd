"""Attacks on the market (docs/market.md § Trust; security review C2, M1, M2, M4, L6, L7), each refused while the
honest holder keeps its window. Real SQLite, real HTTP on loopback; the attacker speaks plain HTTP like curl."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from kvasir.core.errors import MarketError
from kvasir.core.identity import Identity
from kvasir.market import auth
from kvasir.market.agent.client import MarketClient
from kvasir.market.agent.enroll import EnrollConfig, Enrollment, manifest_from_coverage
from kvasir.market.agent.lease import LeaseKeeper, LeaseTaken
from kvasir.market.records import CoverageEntry, coverage_from_wire
from kvasir.market.server.service import serve_market
from kvasir.market.server.store import MarketStore
from kvasir.market.tickets import MAX_TICKET_S, TicketPolicy, WindowTicket, issue_ticket, parse_ticket, ticket_problem
from kvasir.shard.fetch import SourceError, refuse_unsafe_redirect
from tests.marketutil import SignAuth, signed_model
from tests.test_market import MANIFEST, SHA, _claim, _model

OPERATOR = Identity.generate()
VICTIM = Identity.generate()
ATTACKER = Identity.generate()
WITNESS = Identity.generate()


@attrs.define
class Market:
    http: httpx.AsyncClient
    url: str
    store: MarketStore

    def auth(self, who: Identity) -> SignAuth:
        return SignAuth(who, self.store.clock)

    async def post(self, path: str, body: Any, who: Identity | None) -> httpx.Response:
        return await self.http.post(path, json=body, auth=self.auth(who) if who else httpx.USE_CLIENT_DEFAULT)

    async def window(self, rank: int) -> dict[str, Any]:
        w: dict[str, Any] = (await self.http.get("/v1/coverage")).json()["models"][0]["windows"][rank]
        return w


@pytest.fixture
async def market(tmp_path: Path) -> AsyncIterator[Market]:
    store = MarketStore(tmp_path / "m.sqlite")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                tmp_path, "127.0.0.1", 0, store=store, identity=OPERATOR, task_status=task_status
            )
        )
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            m = Market(client, url, store)
            r = await client.put(f"/v1/models/{SHA}", json=signed_model(_model(), OPERATOR), auth=m.auth(OPERATOR))
            assert r.status_code == 201, r.text
            r = await client.put(f"/v1/models/{SHA}/manifest", json=MANIFEST, auth=m.auth(OPERATOR))
            assert r.status_code == 200, r.text
            yield m
        nursery.cancel_scope.cancel()
    store.close()


async def _serving_victim(market: Market) -> dict[str, Any]:
    lease: dict[str, Any] = (await market.post("/v1/claims", _claim(VICTIM.node_id), VICTIM)).json()
    serving = _claim(VICTIM.node_id, lease_id=lease["lease_id"], state="serving", endpoint="127.0.0.1:7001")
    assert (await market.post("/v1/claims/renew", serving, VICTIM)).status_code == 200
    return lease


# ---------------------------------------------------------------------------------------------- C2 (a), (b)


async def test_a_claim_in_the_holders_name_gets_nothing(market: Market) -> None:
    lease = await _serving_victim(market)
    hijack = _claim(VICTIM.node_id, state="serving", endpoint="127.0.0.1:6666")
    r = await market.post("/v1/claims", hijack, None)  # the review's curl: no credentials at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "unsigned"
    r = await market.post("/v1/claims", hijack, ATTACKER)  # signed, but by another key than the id names
    assert r.status_code == 403 and r.json()["error"]["code"] == "wrong_node"
    assert "lease_id" not in r.text and lease["lease_id"] not in r.text
    r = await market.post("/v1/claims", {**hijack, "node_id": ATTACKER.node_id}, ATTACKER)
    assert r.status_code == 409 and r.json()["error"]["code"] == "window_taken"
    # with the stolen lease id too: renew, credit and release are still the holder's alone
    ref = {"model": SHA, "layers": [2, 4], "node_id": VICTIM.node_id, "lease_id": lease["lease_id"]}
    for path, body in [
        ("/v1/claims/renew", {**hijack, "lease_id": lease["lease_id"]}),
        ("/v1/claims/release", ref),
        ("/v1/credits", {**ref, "tokens": 10**9}),
    ]:
        assert (await market.post(path, body, ATTACKER)).status_code == 403
    w = await market.window(1)
    assert (w["holder"], w["endpoint"], w["state"]) == (VICTIM.node_id, "127.0.0.1:7001", "serving")
    serving = _claim(VICTIM.node_id, lease_id=lease["lease_id"], state="serving", endpoint="127.0.0.1:7001")
    r = await market.post("/v1/claims/renew", serving, VICTIM)
    assert r.status_code == 200 and r.json()["lease_id"] == lease["lease_id"]
    assert (await market.http.get("/v1/ledger")).json() == {"nodes": []}


async def test_replayed_or_stale_requests_are_refused(market: Market) -> None:
    lease = await _serving_victim(market)
    ref = {"model": SHA, "layers": [2, 4], "node_id": VICTIM.node_id, "lease_id": lease["lease_id"]}
    body = httpx.Request("POST", "http://x", json=ref).content
    headers = auth.sign_request(VICTIM, "POST", "/v1/claims/renew", body, market.store.clock())
    # a captured renewal cannot be sent to another route (the target is signed) ...
    r = await market.http.post("/v1/claims/release", content=body, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "bad_signature"
    # ... a captured release cannot be replayed once used, nor sent late
    old = auth.sign_request(VICTIM, "POST", "/v1/claims/release", body, market.store.clock() - 3600)
    r = await market.http.post("/v1/claims/release", content=body, headers=old)
    assert r.status_code == 401 and r.json()["error"]["code"] == "stale_request"
    assert (await market.window(1))["holder"] == VICTIM.node_id
    release = auth.sign_request(VICTIM, "POST", "/v1/claims/release", body, market.store.clock())
    assert (await market.http.post("/v1/claims/release", content=body, headers=release)).status_code == 200
    lease2 = (await market.post("/v1/claims", _claim(VICTIM.node_id), VICTIM)).json()
    assert lease2["lease_id"] != lease["lease_id"]
    body2 = httpx.Request("POST", "http://x", json={**ref, "lease_id": lease2["lease_id"]}).content
    replay = await market.http.post("/v1/claims/release", content=body2, headers=release)  # old headers, new body
    assert replay.status_code == 401
    replay = await market.http.post("/v1/claims/release", content=body, headers=release)  # the exact replay
    assert replay.status_code == 401 and replay.json()["error"]["code"] == "replayed_request"
    assert (await market.window(1))["holder"] == VICTIM.node_id


def test_nonce_cache_is_bounded() -> None:
    cache = auth.NonceCache(window_s=60, max_entries=3)
    signed = [auth.Signed(VICTIM.public, f"{i:032x}", 1000) for i in range(4)]
    for s in signed[:3]:
        cache.check(s, 1000)
    with pytest.raises(MarketError) as full:
        cache.check(signed[3], 1000)
    assert full.value.status == 503 and len(cache) == 3
    cache.check(signed[3], 1000 + 61)  # the old ones left the window: room again
    assert len(cache) == 1


# ---------------------------------------------------------------------------------------------- C2 (c), (d)


async def test_only_the_operator_publishes_and_records_are_immutable(market: Market) -> None:
    evil = {**_model(), "sources": ["http://127.0.0.1:9/evil.gguf"]}
    evil["stages"] = [{**s, "sha256": "ee" * 32} for s in evil["stages"]]
    for who in (None, ATTACKER):
        signer = market.auth(who) if who else httpx.USE_CLIENT_DEFAULT
        r = await market.http.put(f"/v1/models/{SHA}", json=signed_model(evil, ATTACKER), auth=signer)
        assert r.status_code in (401, 403), r.text
        r = await market.http.put(f"/v1/models/{SHA}/manifest", json=MANIFEST, auth=signer)
        assert r.status_code in (401, 403), r.text
    # the operator's own key with a record signed by someone else: refused too
    r = await market.http.put(f"/v1/models/{SHA}", json=signed_model(evil, ATTACKER), auth=market.auth(OPERATOR))
    assert r.status_code == 400
    # a published record never changes, not even by the operator; publishing it again is a no-op
    r = await market.http.put(f"/v1/models/{SHA}", json=signed_model(evil, OPERATOR), auth=market.auth(OPERATOR))
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_immutable"
    r = await market.http.put(f"/v1/models/{SHA}", json=signed_model(_model(), OPERATOR), auth=market.auth(OPERATOR))
    assert r.status_code == 200
    got = (await market.http.get(f"/v1/models/{SHA}")).json()
    assert got["sources"] == _model()["sources"] and got["stages"][0]["sha256"] == "01" * 32


async def test_a_node_pinned_to_one_operator_refuses_another(market: Market, tmp_path: Path) -> None:
    def enrollment(pin: Identity | None) -> Enrollment:
        cfg = EnrollConfig(market.url, 10_000, tmp_path, market_key=pin.public if pin else None)
        return Enrollment(cfg)

    honest = enrollment(OPERATOR)
    assert (await honest.verified_model(SHA)).signed_by(OPERATOR.public)
    assert honest.ticket_issuer == OPERATOR.public  # the operator runs this market: tickets are its own
    pinned_elsewhere = enrollment(ATTACKER)  # the market's key is not delegated by ATTACKER: nothing it says is used
    with pytest.raises(MarketError, match="not delegated by operator"):
        await pinned_elsewhere.verified_model(SHA)
    tofu = enrollment(None)
    await tofu.verified_model(SHA)
    assert tofu.operator_key == OPERATOR.public
    for e in (honest, pinned_elsewhere, tofu):
        await e.market.aclose()


# ---------------------------------------------------------------------------------------------- tickets


async def test_window_tickets(market: Market) -> None:
    lease = await _serving_victim(market)
    now = market.store.clock()
    ticket = lease["ticket"]
    t = parse_ticket(ticket, OPERATOR.public)
    assert (t.model, t.start, t.end, t.holder, t.relay_edge) == (SHA, 2, 4, VICTIM.public, f"{SHA[:12]}-e1")
    assert now < t.not_after <= now + MAX_TICKET_S
    policy = TicketPolicy(OPERATOR.public, SHA, frozenset({(2, 4)}), clock=lambda: now)
    assert policy.problem(VICTIM.public, ticket.encode()) is None
    assert "issued to" in (policy.problem(ATTACKER.public, ticket.encode()) or "")  # a stolen ticket
    assert "no window ticket" in (policy.problem(VICTIM.public, b"") or "")
    late = ticket_problem(
        ticket, VICTIM.public, issuer=OPERATOR.public, model=SHA, windows=policy.windows, now=now + 3600
    )
    assert late is not None and "expired" in late
    wrong = ticket_problem(
        ticket, VICTIM.public, issuer=OPERATOR.public, model=SHA, windows=frozenset({(0, 2)}), now=now
    )
    assert wrong is not None and "not a neighbour" in wrong
    forged = issue_ticket(ATTACKER, WindowTicket(SHA, 2, 4, ATTACKER.public, int(now) + 60, ATTACKER.public))
    assert "not signed by this market" in (policy.problem(ATTACKER.public, forged.encode()) or "")
    tampered = ticket.replace(ticket.split(".")[1], ticket.split(".")[1][:-4] + "AAAA")
    assert policy.problem(VICTIM.public, tampered.encode()) is not None


# ---------------------------------------------------------------------------------------------- M1, L7, M4


def test_a_malformed_map_entry_is_skipped_not_fatal() -> None:
    good = CoverageEntry(SHA, 0, 0, 2, 1.0, 1.0, 100, "00" * 32).to_wire()
    bad = {**good, "layers": [2, 4], "reward": 1e300}
    skipped: list[str] = []
    entries = coverage_from_wire({"models": [{"windows": [good, bad]}, {"windows": "x"}]}, skipped)
    assert [(e.start, e.end) for e in entries] == [(0, 2)] and len(skipped) == 2


async def test_the_lease_keeper_raises_lease_taken_once_another_node_holds_the_window(market: Market) -> None:
    """The keeper renews as fetching, then as serving with its endpoint; when its lease ran out and another node took
    the window, its renewal task ends with LeaseTaken (the session's signal), and there is nothing to release."""
    async with MarketClient(market.url, identity=VICTIM) as client:
        keeper = LeaseKeeper(client, VICTIM.node_id, lease_s=0.6)
        window = next(w for w in await client.coverage() if (w.start, w.end) == (2, 4))
        await keeper.claim(window)
        assert (await market.window(1))["state"] == "fetching"
        keeper.endpoint = "127.0.0.1:7001"
        await keeper.renew()
        shown = await market.window(1)
        assert (shown["state"], shown["endpoint"], shown["holder"]) == ("serving", "127.0.0.1:7001", VICTIM.node_id)
        await trio.sleep(0.7)  # not renewed: the lease runs out, and another node claims the window
        assert (await market.post("/v1/claims", _claim(ATTACKER.node_id), ATTACKER)).status_code == 200
        with trio.fail_after(10), pytest.raises(LeaseTaken, match="held by"):
            await keeper.keep()
        keeper.forget()
        await keeper.release()  # nothing to hand back: the window stays the other node's
        assert (await market.window(1))["holder"] == ATTACKER.node_id


async def test_dead_sources_release_the_window_and_another_is_tried(
    market: Market, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "kvasir.enroll")
    cfg = EnrollConfig(market.url, 10_000, tmp_path, market_key=OPERATOR.public, poll_s=0.05, lease_s=5)
    enrollment = Enrollment(cfg)
    async with trio.open_nursery() as nursery:
        await nursery.start(enrollment.run)
        with trio.fail_after(30):
            while len({r.getMessage() for r in caplog.records if "released window" in r.getMessage()}) < 3:  # noqa: ASYNC110
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    released = {r.getMessage().rsplit(" ", 1)[-1] for r in caplog.records if "released window" in r.getMessage()}
    assert released == {"0:2", "2:4", "4:6"}  # each tried once, handed back, and the node went on
    assert all(w["holder"] is None for w in (await market.http.get("/v1/coverage")).json()["models"][0]["windows"])


async def test_client_reply_size_is_capped(market: Market) -> None:
    async with MarketClient(market.url, max_reply_bytes=200) as client:
        with pytest.raises(MarketError, match="reply"):
            await client.coverage()
    async with MarketClient(market.url) as client:
        assert len(await client.coverage()) == 3


@pytest.mark.parametrize(
    ("location", "ok"),
    [("https://src.example/m.gguf", True), ("http://src.example/m.gguf", False), ("https://10.0.0.1/m", False)],
)
async def test_source_redirects_only_to_https_on_the_same_host(location: str, ok: bool) -> None:
    request = httpx.Request("GET", "https://src.example/m.gguf")
    reply = httpx.Response(302, headers={"location": location}, request=request)
    if ok:
        await refuse_unsafe_redirect(reply)
    else:
        with pytest.raises(SourceError, match="refused a redirect"):
            await refuse_unsafe_redirect(reply)


def test_nodes_dial_and_fetch_inside_only_when_the_market_is_inside(tmp_path: Path) -> None:
    """L6: a public market cannot aim its nodes at their own network (loopback, private, link-local, .local)."""
    public = EnrollConfig("https://market.example.com", 1, tmp_path)
    assert [public.host_ok(h) for h in ("8.8.8.8", "seed.example.org", "[2001:4860::8888]")] == [True] * 3
    inside = ("127.0.0.1", "10.0.0.5", "169.254.169.254", "::1", "fd00::1", "localhost", "nas.local", "router")
    assert not any(public.host_ok(h) for h in inside)
    assert all(EnrollConfig("http://127.0.0.1:8480", 1, tmp_path).host_ok(h) for h in inside)  # a LAN market
    assert all(attrs.evolve(public, allow_private=True).host_ok(h) for h in inside)
    ws = [
        CoverageEntry(SHA, 0, 0, 2, 1, 1, 10, "00" * 32, "a", 5.0, "serving", "10.0.0.1:7000"),
        CoverageEntry(SHA, 1, 2, 4, 1, 1, 10, "00" * 32, "b", 5.0, "serving", "93.184.216.34:7000"),
    ]
    m = manifest_from_coverage(ws, 1, "0.0.0.0", 9000, host_ok=public.host_ok)
    assert [r.address for r in m.ranks] == ["0.0.0.0:0", "0.0.0.0:9000"]  # the inside endpoint is never dialled


def test_node_flag_allow_private(tmp_path: Path) -> None:
    """`kvasir node --allow-private` / `--no-allow-private` set EnrollConfig.allow_private; without either, the
    market's own address decides."""
    from kvasir.cli import build_parser
    from kvasir.commands.node import enroll_config

    def config(market: str, *flags: str) -> EnrollConfig:
        pin = ("--market-key", OPERATOR.public.to_text(), "--allow-plain-http")  # off loopback: see the N1 test
        argv = ["node", "--market", market, "--memory-budget", "1GiB", "--stage-dir", str(tmp_path), *pin, *flags]
        cfg: EnrollConfig = enroll_config(build_parser().parse_args(argv))
        return cfg

    public, lan = "https://market.example.com", "http://10.0.0.2:8480"
    assert config(public).allow_private is None and not config(public).host_ok("10.0.0.5")
    assert config(public, "--allow-private").allow_private is True
    assert config(public, "--allow-private").host_ok("10.0.0.5") and config(public, "--allow-private").host_ok("::1")
    assert config(lan).host_ok("10.0.0.5")
    assert not config(lan, "--no-allow-private").host_ok("10.0.0.5")
    assert config(public, "--market-ca", str(tmp_path / "ca.pem")).market_ca == tmp_path / "ca.pem"


def test_an_outage_longer_than_a_lease_evicts_no_healthy_holder(tmp_path: Path) -> None:
    """Issue 11 (6): after a market restart, a spare polling first took a healthy holder's window. Leases that
    were live when the market stopped get the time they had left; the ledger and leases survive a kill."""
    from kvasir.market.records import ClaimRequest, ManifestRecord, ModelRecord

    now = [1_000_000.0]
    db = tmp_path / "m.sqlite"
    store = MarketStore(db, clock=lambda: now[0])
    store.put_model(ModelRecord.from_wire(signed_model(_model(), OPERATOR)))
    store.put_manifest(ManifestRecord.from_wire(MANIFEST, SHA))
    lease = store.claim(ClaimRequest(SHA, 2, 4, VICTIM.node_id, 30.0))
    now[0] += 20  # the holder renewed 10 s before the market died
    lease = store.renew(ClaimRequest(SHA, 2, 4, VICTIM.node_id, 30.0, lease_id=lease.lease_id))
    store.close()  # as after kill -9: every write was its own committed transaction
    now[0] += 600  # ten minutes away, twenty leases' worth
    again = MarketStore(db, clock=lambda: now[0])
    w = again.coverage()["models"][0]["windows"][1]
    assert w["holder"] == VICTIM.node_id and w["lease_expires"] == now[0] + 30
    with pytest.raises(MarketError, match="held by node"):
        again.claim(ClaimRequest(SHA, 2, 4, ATTACKER.node_id, 30.0))  # the spare waits
    assert (
        again.renew(ClaimRequest(SHA, 2, 4, VICTIM.node_id, 30.0, lease_id=lease.lease_id)).lease_id == lease.lease_id
    )
    now[0] += 31  # a holder that does not come back still loses its window
    assert again.claim(ClaimRequest(SHA, 2, 4, ATTACKER.node_id, 30.0)).node_id == ATTACKER.node_id
    again.close()


def test_a_key_sharing_the_holders_fingerprint_holds_nothing(tmp_path: Path) -> None:
    """Node ids are 64-bit fingerprints; the market also pins the holder's whole key, so a ground collision of the
    id is not enough to renew, release, credit or re-claim."""
    from kvasir.market.records import ClaimRequest, LeaseRef, ManifestRecord, ModelRecord

    store = MarketStore(tmp_path / "m.sqlite")
    store.put_model(ModelRecord.from_wire(signed_model(_model(), OPERATOR)))
    store.put_manifest(ManifestRecord.from_wire(MANIFEST, SHA))
    real, twin = VICTIM.public.to_text(), ATTACKER.public.to_text()
    lease = store.claim(ClaimRequest(SHA, 2, 4, VICTIM.node_id, 30.0), real)
    renew = ClaimRequest(SHA, 2, 4, VICTIM.node_id, 30.0, lease_id=lease.lease_id)
    with pytest.raises(MarketError, match="held by"):
        store.claim(ClaimRequest(SHA, 2, 4, VICTIM.node_id, 30.0), twin)
    with pytest.raises(MarketError, match="another lease"):
        store.renew(renew, twin)
    with pytest.raises(MarketError, match="another lease"):
        store.release(LeaseRef(SHA, 2, 4, VICTIM.node_id, lease.lease_id), twin)
    assert store.renew(renew, real).lease_id == lease.lease_id
    store.close()
