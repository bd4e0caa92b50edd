"""Leases must become service (issue 24, security N6): squatting, vouching, claim rate limits and proof-of-work
admission, on a real market (HTTP on loopback, real SQLite) whose clock the tests move, and the pure rules.

The review's N6: three free keys claimed every window of a model (``fetching``, ``lease_s`` 3600) and held them for
an hour without serving; honest claims got 409 ``window_taken``. Now a claim that no neighbour of a distinct key
vouches for within the serve deadline yields to the next claim of another key.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from kvasir.core.errors import MarketError
from kvasir.core.identity import Identity
from kvasir.market.agent.choice import choose_window
from kvasir.market.agent.client import MarketClient
from kvasir.market.agent.lease import LeaseKeeper
from kvasir.market.agent.vouch import vouches_for
from kvasir.market.records import CoverageEntry, Lease
from kvasir.market.server.gate import ClaimGate
from kvasir.market.server.ratelimit import Bucket, ClaimLimits, Rate, RateLimiter, take
from kvasir.market.server.service import serve_market
from kvasir.market.server.standing import LeaseRules, standing, tenure_start
from kvasir.market.server.store import MarketStore
from kvasir.market.work import leading_zero_bits, mint_work, work_ok
from tests.marketutil import SignAuth, signed_model

SHA = "ab" * 32
OPERATOR = Identity.generate()
WINDOWS = ((0, 2), (2, 4), (4, 6))
MODEL = {
    "sha256": SHA,
    "name": "tiny",
    "layers": 6,
    "file_bytes": 10_000,
    "header_bytes": 1000,
    "sources": ["http://127.0.0.1:1/m.gguf"],
    "layer_bytes": [1000] * 6,
    "outside_bytes": 3000,
    "stages": [{"layers": list(w), "sha256": f"0{i + 1}" * 32, "bytes": 3000} for i, w in enumerate(WINDOWS)],
}
MANIFEST = {"origin": "explicit", "windows": [{"layers": list(w)} for w in WINDOWS]}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@attrs.define
class Market:
    http: httpx.AsyncClient
    clock: Clock
    url: str
    key: Identity

    async def post(self, path: str, body: dict[str, Any], who: Identity, **kw: Any) -> httpx.Response:
        return await self.http.post(path, json=body, auth=SignAuth(who, self.clock), **kw)

    async def claim(self, who: Identity, w: tuple[int, int], lease_s: float = 3600, **kw: Any) -> httpx.Response:
        body = {"model": SHA, "layers": list(w), "node_id": who.node_id, "lease_s": lease_s, **kw}
        return await self.post("/v1/claims", body, who)

    async def serve(self, who: Identity, lease: dict[str, Any], port: int) -> httpx.Response:
        body = {"model": SHA, "layers": lease["layers"], "node_id": who.node_id, "lease_s": 3600,
                "lease_id": lease["lease_id"], "state": "serving", "endpoint": f"127.0.0.1:{port}"}  # fmt: skip
        return await self.post("/v1/claims/renew", body, who)

    async def vouch(
        self, who: Identity, lease: dict[str, Any], neighbour: Identity, side: str = "predecessor"
    ) -> httpx.Response:
        body = {"model": SHA, "layers": lease["layers"], "node_id": who.node_id, "lease_id": lease["lease_id"],
                "key": neighbour.public.to_text(), "side": side}  # fmt: skip
        return await self.post("/v1/vouch", body, who)

    async def windows(self) -> list[dict[str, Any]]:
        r = await self.http.get("/v1/coverage")
        out: list[dict[str, Any]] = r.json()["models"][0]["windows"]
        return out


def _gate(bits: int = 0, limits: ClaimLimits | None = None) -> Callable[[Identity], ClaimGate]:
    return lambda market: ClaimGate(market.public.to_text(), bits, limits)


async def _market(
    tmp_path: Path, gate: Callable[[Identity], ClaimGate] | None = None, rules: LeaseRules | None = None
) -> AsyncIterator[Market]:
    clock = Clock()
    store = MarketStore(tmp_path / "m.sqlite", clock=clock, rules=rules)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                tmp_path, "127.0.0.1", 0, store=store, identity=OPERATOR, gate=gate, task_status=task_status
            )
        )
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            market = Market(client, clock, url, OPERATOR)
            r = await market.http.put(f"/v1/models/{SHA}", json=signed_model(MODEL, OPERATOR),
                                      auth=SignAuth(OPERATOR, clock))  # fmt: skip
            assert r.status_code == 201, r.text
            r = await market.http.put(f"/v1/models/{SHA}/manifest", json=MANIFEST, auth=SignAuth(OPERATOR, clock))
            assert r.status_code == 200, r.text
            yield market
        nursery.cancel_scope.cancel()
    store.close()


@pytest.fixture
async def market(tmp_path: Path) -> AsyncIterator[Market]:
    async for m in _market(tmp_path):
        yield m


def _code(r: httpx.Response) -> str:
    return str(r.json()["error"]["code"])


# ---------------------------------------------------------------------------------------------- N6, end to end


async def test_squatters_lose_every_window_to_honest_nodes_that_serve(market: Market) -> None:
    """Reproduces N6 (it used to hold: three squatters kept every window for 3,600 s; every honest claim got 409
    ``window_taken`` for the whole hour). Now: refused only while the squatters are fresh; 60 s later every window
    is claimable, honest keys take them, serve, vouch for each other and keep them; the squatters are out."""
    squatters = [Identity.generate() for _ in WINDOWS]
    honest = [Identity.generate() for _ in WINDOWS]
    for s, w in zip(squatters, WINDOWS, strict=True):
        assert (await market.claim(s, w)).status_code == 200
    shown = await market.windows()
    assert [w["holder"] for w in shown] == [s.node_id for s in squatters]
    assert not any(w["claimable"] or w["confirmed"] for w in shown)

    market.clock.now += 30  # within the deadline the squatters are fresh: honest claims wait, as before
    for h, w in zip(honest, WINDOWS, strict=True):
        r = await market.claim(h, w, lease_s=30)
        assert r.status_code == 409 and _code(r) == "window_taken", r.text
        assert "other claims take it at 1000060" in r.json()["error"]["message"]

    market.clock.now += 31  # 61 s after the claims: nobody vouched for the squatters
    shown = await market.windows()
    assert all(w["claimable"] and not w["confirmed"] for w in shown), shown
    assert choose_window([CoverageEntry.from_wire(w) for w in shown], 10_000, random.Random(0)) is not None
    leases = []
    for h, w in zip(honest, WINDOWS, strict=True):
        r = await market.claim(h, w, lease_s=30)
        assert r.status_code == 200, r.text
        leases.append(r.json())
    for s, w in zip(squatters, WINDOWS, strict=True):  # the squatters' keys are out: no renewal, no claim back
        r = await market.claim(s, w)
        assert r.status_code == 403 and _code(r) == "idle_cooldown", r.text

    # The honest nodes serve and vouch for their predecessors' links (window k vouches for window k-1).
    for port, (h, lease) in enumerate(zip(honest, leases, strict=True)):
        assert (await market.serve(h, lease, 7000 + port)).status_code == 200
    for k, (h, lease) in enumerate(zip(honest, leases, strict=True)):
        r = await market.vouch(h, lease, honest[k - 1])
        assert r.status_code == 200, r.text
        assert r.json()["confirmed"] == list(WINDOWS[k - 1])
    shown = await market.windows()
    assert [w["holder"] for w in shown] == [h.node_id for h in honest]
    assert all(w["confirmed"] and not w["claimable"] for w in shown)

    market.clock.now += 61  # confirmed (vouched 61 s ago, within the 90 s it lasts): a newcomer cannot take them
    late = Identity.generate()
    for w in WINDOWS:
        r = await market.claim(late, w)
        assert r.status_code == 409 and _code(r) == "window_taken", r.text
        assert "other claims take it" not in r.json()["error"]["message"]
    market.clock.now += 30  # a node that stops vouching (its neighbour gone) is open to others after the 90 s
    shown = await market.windows()
    assert all(w["claimable"] for w in shown)
    assert (await market.claim(late, WINDOWS[0])).status_code == 200


async def test_with_the_deadline_off_squatters_hold_every_window_as_before(tmp_path: Path) -> None:
    """The old behaviour, kept behind ``--serve-deadline 0``: N6 as the review saw it (an hour, 409 throughout)."""
    async for market in _market(tmp_path, rules=LeaseRules(serve_deadline_s=0)):
        for w in WINDOWS:
            assert (await market.claim(Identity.generate(), w)).status_code == 200
        market.clock.now += 3599
        honest = Identity.generate()
        for w in WINDOWS:
            r = await market.claim(honest, w, lease_s=30)
            assert r.status_code == 409 and _code(r) == "window_taken", r.text
        assert not any(w["claimable"] for w in await market.windows())


async def test_vouches_need_a_serving_predecessor_of_a_distinct_key(market: Market) -> None:
    """Only the holder of the next window vouches, only for the key that holds the window before it, both serving,
    never for itself. Two colluding keys still confirm each other (the documented sybil case)."""
    a, b, c = (Identity.generate() for _ in range(3))
    la = (await market.claim(a, WINDOWS[0])).json()
    lb = (await market.claim(b, WINDOWS[1])).json()
    r = await market.vouch(b, lb, a)
    assert r.status_code == 409 and _code(r) == "not_serving", r.text  # b itself does not serve yet
    await market.serve(b, lb, 7001)
    r = await market.vouch(b, lb, a)
    assert r.status_code == 409 and _code(r) == "not_serving", r.text  # a does not serve yet
    await market.serve(a, la, 7000)
    r = await market.vouch(b, lb, c)
    assert r.status_code == 409 and _code(r) == "not_holder", r.text  # c holds nothing before b's window
    r = await market.vouch(a, la, b)
    assert r.status_code == 409 and _code(r) == "not_holder", r.text  # b is a's successor, not its predecessor
    r = await market.vouch(a, la, b, "successor")  # a dialled b: that confirms b
    assert r.status_code == 200 and r.json()["confirmed"] == list(WINDOWS[1]), r.text
    r = await market.vouch(a, la, b, "sideways")
    assert r.status_code == 400, r.text
    r = await market.vouch(c, lb, a)  # c signs for b's lease
    assert r.status_code in (403, 409), r.text
    r = await market.vouch(b, lb, a)
    assert r.status_code == 200, r.text
    # One key on two neighbouring windows cannot vouch for itself.
    solo = Identity.generate()
    market.clock.now += 200  # every lease so far has lapsed (3,600 s leases, but now unconfirmed and overdue)
    l0 = (await market.claim(solo, WINDOWS[0], lease_s=600)).json()
    l1 = (await market.claim(solo, WINDOWS[1], lease_s=600)).json()
    await market.serve(solo, l0, 7000)
    await market.serve(solo, l1, 7001)
    r = await market.vouch(solo, l1, solo)
    assert r.status_code == 409 and _code(r) == "own_key", r.text


async def test_release_and_claim_again_does_not_restart_the_deadline(market: Market) -> None:
    """A squatter that releases (or lets its lease lapse) and claims again at once keeps its first claim's clock."""
    s = Identity.generate()
    lease = (await market.claim(s, WINDOWS[0], lease_s=50)).json()
    market.clock.now += 40
    ref = {"model": SHA, "layers": [0, 2], "node_id": s.node_id, "lease_id": lease["lease_id"]}
    assert (await market.post("/v1/claims/release", ref, s)).status_code == 200
    assert (await market.claim(s, WINDOWS[0], lease_s=50)).status_code == 200
    market.clock.now += 21  # 61 s after the first claim
    assert (await market.windows())[0]["claimable"]
    assert (await market.claim(Identity.generate(), WINDOWS[0])).status_code == 200


# ---------------------------------------------------------------------------------------------- rate limits


async def test_claims_are_rate_limited_per_key_and_per_address_group(tmp_path: Path) -> None:
    """429 ``too_many_claims`` with ``retry-after``; per key, and per IPv4 /24 (127.0.0.x vs 127.1.0.x here)."""
    limits = ClaimLimits(per_key=Rate(2, 10.0), per_group=Rate(4, 5.0), admissions_per_group=None)
    async for market in _market(tmp_path, _gate(0, limits)):
        a, b, c = (Identity.generate() for _ in range(3))
        assert [(await market.claim(a, WINDOWS[0])).status_code for _ in range(2)] == [200, 200]
        r = await market.claim(a, WINDOWS[0])
        assert r.status_code == 429 and _code(r) == "too_many_claims", r.text
        assert r.headers["retry-after"] == "10"
        assert r.headers["x-kvasir-market-time"]
        assert (await market.claim(b, WINDOWS[1])).status_code == 200
        r = await market.claim(b, WINDOWS[1])
        assert r.status_code == 200, r.text  # the group's fourth claim
        r = await market.claim(c, WINDOWS[2])
        assert r.status_code == 429 and r.headers["retry-after"] == "5", r.text  # the /24 is spent, c's key is not
        # Another /24 is not limited by this one's claims.
        transport = httpx.AsyncHTTPTransport(local_address="127.1.0.1")
        async with httpx.AsyncClient(base_url=market.url, transport=transport, timeout=10) as other:
            elsewhere = attrs.evolve(market, http=other)
            assert (await elsewhere.claim(c, WINDOWS[2])).status_code == 200
        market.clock.now += 10  # refilled
        assert (await market.claim(a, WINDOWS[0])).status_code == 200


def test_token_bucket() -> None:
    rate = Rate(burst=2, every_s=10.0)
    b1, w1 = take(None, rate, 0.0)
    b2, w2 = take(b1, rate, 0.0)
    b3, w3 = take(b2, rate, 0.0)
    assert (w1, w2) == (0.0, 0.0) and w3 == 10.0 and b3.tokens == 0.0
    assert take(b3, rate, 5.0)[1] == 5.0
    assert take(b3, rate, 10.0) == (Bucket(0.0, 10.0), 0.0)
    assert take(Bucket(0.0, 0.0), rate, 1e6)[0].tokens == 1.0  # capped at the burst (less the one taken)
    limiter = RateLimiter(Rate(1, 60.0), max_names=3)
    for name in "abcd":
        assert limiter.wait(name, 0.0) == 0.0
        limiter.take(name, 0.0)
    assert list(limiter.buckets) == ["b", "c", "d"]  # bounded: the oldest name is forgotten
    assert limiter.wait("d", 1.0) == 59.0 and limiter.wait("a", 1.0) == 0.0
    assert RateLimiter(None).wait("x", 0.0) == 0.0


# ---------------------------------------------------------------------------------------------- admission


def test_work_mint_and_verify() -> None:
    market, node = OPERATOR.public.to_text(), Identity.generate().public.to_text()
    nonce = mint_work(market, node, 12)
    assert work_ok(market, node, nonce, 12) and mint_work(market, node, 12) == nonce  # deterministic
    assert all(not work_ok(market, node, str(i), 12) for i in range(int(nonce)))  # the first one
    other = Identity.generate().public.to_text()
    assert sum(work_ok(other, node, str(i), 12) for i in range(200)) <= 2  # ~200/4096 expected: work is bound
    assert work_ok(market, node, "anything", 0)
    assert not work_ok(market, node, "", 1) and not work_ok(market, node, "a b", 1)
    assert leading_zero_bits(b"\x00\x0f" + b"\xff" * 30) == 12 and leading_zero_bits(b"\x80") == 0
    with pytest.raises(ValueError):
        mint_work(market, node, 33)


async def test_an_open_market_asks_work_of_new_keys(tmp_path: Path) -> None:
    """With ``work_bits`` 10: a new key's claim gets 403 ``admission_required``; bad work 422 ``bad_work``; the
    real agent's lease keeper does the work and claims; admission is per key and once."""
    async for market in _market(tmp_path, _gate(10)):
        info = (await market.http.get("/v1/admission")).json()
        assert info == {"market": OPERATOR.public.to_text(), "work_bits": 10}
        a = Identity.generate()
        r = await market.claim(a, WINDOWS[0])
        assert r.status_code == 403 and _code(r) == "admission_required", r.text
        bad = next(str(i) for i in range(10_000) if not work_ok(info["market"], a.public.to_text(), str(i), 10))
        r = await market.post("/v1/admission", {"node_id": a.node_id, "nonce": bad}, a)
        assert r.status_code == 422 and _code(r) == "bad_work", r.text
        # Work minted for another key does not admit this one.
        b = Identity.generate()
        nonce_b = mint_work(info["market"], b.public.to_text(), 10)
        if not work_ok(info["market"], a.public.to_text(), nonce_b, 10):
            r = await market.post("/v1/admission", {"node_id": a.node_id, "nonce": nonce_b}, a)
            assert r.status_code == 422, r.text
        # The real client and lease keeper: 403, work, admission, claim.
        async with MarketClient(market.url, identity=a) as client:
            keeper = LeaseKeeper(client, a.node_id, 30.0)
            entry = CoverageEntry.from_wire((await market.windows())[0])
            lease = await keeper.claim(entry)
            assert lease.node_id == a.node_id
        assert (await market.claim(a, WINDOWS[0])).status_code == 200  # admitted once, for good
        r = await market.claim(b, WINDOWS[1])
        assert r.status_code == 403, r.text


async def test_admissions_are_rate_limited_per_address_group(tmp_path: Path) -> None:
    limits = ClaimLimits(per_key=None, per_group=None, admissions_per_group=Rate(2, 60.0))
    async for market in _market(tmp_path, _gate(1, limits)):
        replies = []
        for _ in range(3):
            k = Identity.generate()
            nonce = mint_work(OPERATOR.public.to_text(), k.public.to_text(), 1)
            replies.append(await market.post("/v1/admission", {"node_id": k.node_id, "nonce": nonce}, k))
        assert [r.status_code for r in replies] == [200, 200, 429]
        assert _code(replies[2]) == "too_many_admissions" and replies[2].headers["retry-after"] == "60"


# ---------------------------------------------------------------------------------------------- pure rules


def test_standing_and_tenure() -> None:
    rules = LeaseRules(serve_deadline_s=60, confirm_ttl_s=90)
    assert standing(0, None, 59, 3, rules) == "fresh"
    assert standing(0, None, 60, 3, rules) == "overdue"
    assert standing(0, 50, 140, 3, rules) == "confirmed" and standing(0, 50, 141, 3, rules) == "overdue"
    assert standing(0, None, 1e6, 1, rules) == "confirmed"  # one window: nobody can vouch
    assert standing(0, None, 1e6, 3, LeaseRules(serve_deadline_s=0)) == "confirmed"  # off
    assert tenure_start(None, "a", 100, rules) == 100
    assert tenure_start(("a", 10, 90, None), "a", 100, rules) == 10  # released 10 s ago: same tenure
    assert tenure_start(("a", 10, 30, None), "a", 100, rules) == 100  # free for 70 s: a new one
    assert tenure_start(("a", 10, 90, 80), "a", 100, rules) == 100  # it served: a new one
    assert tenure_start(("b", 10, 90, None), "a", 100, rules) == 100


def test_choice_prefers_uncovered_windows_to_claimable_ones() -> None:
    def entry(rank: int, holder: str | None, claimable: bool) -> CoverageEntry:
        return CoverageEntry(SHA, rank, 2 * rank, 2 * rank + 2, 1.0, 1.0 + rank, 1000, SHA, holder,
                             claimable=claimable)  # fmt: skip

    ws = [entry(0, None, False), entry(1, "x", True), entry(2, "y", False)]
    assert choose_window(ws, 10_000, random.Random(0)) == ws[0]  # though window 1 pays more
    ws[0] = entry(0, "z", False)
    assert choose_window(ws, 10_000, random.Random(0)) == ws[1]
    ws[1] = entry(1, "x", False)
    assert choose_window(ws, 10_000, random.Random(0)) is None


def test_a_node_vouches_only_for_linked_neighbours() -> None:
    lease = Lease(SHA, 2, 4, "n", "L", 1.0)
    pred, succ = Identity.generate().public, Identity.generate().public
    assert vouches_for(None, "n", (pred, succ)) == [] and vouches_for(lease, "n", (None, None)) == []
    (v,) = vouches_for(lease, "n", (None, succ))
    assert (v.start, v.end, v.lease_id, v.key, v.side) == (2, 4, "L", succ.to_text(), "successor")
    assert [v.side for v in vouches_for(lease, "n", (pred, succ))] == ["predecessor", "successor"]


def test_market_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        ClaimGate("k", 40)
    with pytest.raises(MarketError) as exc:
        ClaimGate("k", 4).require_admission(False)
    assert exc.value.status == 403
    ClaimGate("k", 0).require_admission(False)


# ---------------------------------------------------------------------------------------------- real ring


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="timing-dependent: its nodes sometimes never enroll (seen after an in-process market test; it passes alone "
    "and with the nodes at -v; cause not found yet); tests/test_market_attack.py's squat phase covers N6 on a real "
    "ring in the suite",
)
def test_squatted_windows_go_to_honest_nodes_that_serve_the_model(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """N6 with a real ``kvasir market`` (``--serve-deadline 5 --work-bits 8``) and three real empty nodes: three
    squatter keys, each admitted with its work, hold every window (``fetching``, 3,600 s leases, never serving).
    Before, the nodes waited the hour out. Now they do the admission work by themselves, take the windows once the
    deadline passes, fetch, link, vouch for each other and answer exactly the whole model's tokens; the squatters
    cannot come back, and the ring stays confirmed past several deadlines."""
    import time

    from tests.marketutil import Proc, coverage, procs, wait_for
    from tests.ringutil import ring_generate, whole_model_tokens
    from tests.test_market_ring import BUDGETS, PROMPT, _enrolled, _node, _seed_and_publish

    model = tiny_model("llama", "q8_0")
    want = whole_model_tokens(model, PROMPT, 12)
    with procs() as ps:
        operator = ("--identity", str(tmp_path / "operator.pem"), "--create-identity")
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "market.sqlite"), *operator,
                      "--serve-deadline", "5", "--work-bits", "8")  # fmt: skip
        ps.append(market)
        url = market.wait_line(r"listening on (http://\S+)").group(1)
        key = market.wait_line(r"operator (ed25519:\S+)").group(1)
        _seed_and_publish(ps, model, url, *operator)
        cov = coverage(url)
        squatters = [Identity.generate() for _ in cov["windows"]]
        market_key = httpx.get(f"{url}/v1/admission", timeout=10).json()["market"]
        for s, w in zip(squatters, cov["windows"], strict=True):
            work = {"node_id": s.node_id, "nonce": mint_work(market_key, s.public.to_text(), 8)}
            assert httpx.post(f"{url}/v1/admission", json=work, auth=SignAuth(s), timeout=10).status_code == 200
            body = {"model": cov["model"], "layers": w["layers"], "node_id": s.node_id, "lease_s": 3600}
            r = httpx.post(f"{url}/v1/claims", json=body, auth=SignAuth(s), timeout=10)
            assert r.status_code == 200, r.text
        t0 = time.monotonic()
        nodes = {name: _node(url, name, tmp_path, budget, "--market-key", key) for name, budget in BUDGETS.items()}
        ps.extend(nodes.values())
        status = {name: _enrolled(p) for name, p in nodes.items()}
        honest = {s["node_id"] for s in status.values()}

        def confirmed() -> bool:
            c = coverage(url)
            return bool(c["live"]) and all(w["confirmed"] and w["holder"] in honest for w in c["windows"])

        wait_for(confirmed, 120, "honest holders on every window, each vouched for")
        print(f"squatted model served by honest nodes {time.monotonic() - t0:.2f} s after they started")
        got = wait_for(lambda: ring_generate(tmp_path / "big.sock", PROMPT, 12), 60, "a ring reply")
        assert got["tokens"] == want
        for s, w in zip(squatters, cov["windows"], strict=True):
            body = {"model": cov["model"], "layers": w["layers"], "node_id": s.node_id, "lease_s": 3600}
            r = httpx.post(f"{url}/v1/claims", json=body, auth=SignAuth(s), timeout=10)
            assert r.status_code == 403 and r.json()["error"]["code"] == "idle_cooldown", r.text
        time.sleep(12)  # more than two deadlines: the vouches keep every lease confirmed
        assert confirmed()
        assert {w["holder"] for w in coverage(url)["windows"]} == honest


def test_the_market_command_refuses_bad_settings(tmp_path: Path) -> None:
    """One clear line and exit 2, before anything is created."""
    import subprocess
    import sys

    for flag, value, said in (("--work-bits", "40", "--work-bits must be 0..32"),
                              ("--serve-deadline", "nan", "--serve-deadline must be 0..86400")):  # fmt: skip
        r = subprocess.run(
            [sys.executable, "-m", "kvasir", "market", flag, value, "--db", str(tmp_path / "m.sqlite")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "m.sqlite").exists()


def test_market_status_marks_claimable_windows() -> None:
    import io

    from rich.console import Console

    from kvasir.commands.market import print_status

    def text(claimable: object) -> str:
        w = {"rank": 0, "layers": [0, 2], "bytes": 10, "reward": 1.0, "holder": "h", "lease_expires": None,
             "state": "fetching", "endpoint": None, "claimable": claimable}  # fmt: skip
        st = {
            "coverage": {"now": 0.0, "models": [{"name": "m", "model": SHA, "covered": 1, "windows_total": 1,
                                                 "live": False, "windows": [w]}]},
            "demand": {"horizon_s": 600, "models": []},
            "ledger": {"nodes": []},
        }  # fmt: skip
        out = io.StringIO()
        print_status(st, Console(file=out, width=200, color_system=None))
        return out.getvalue()

    assert "fetching (claimable)" in text(True)
    assert "claimable" not in text(False) and "claimable" not in text("yes")  # only a real true
