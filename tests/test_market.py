"""The market: records, the pure choice rule, and the HTTP API (claims compare-and-set, leases, ledger, errors).

Writes are signed (kvasir.market.auth): the ``market`` fixture publishes as the operator, nodes sign with their own
keys (``keys`` fixture: node name -> Identity, its node id the key's fingerprint). Attacks on the trust rules are
in tests/test_market_trust.py.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvasir.core.clientauth import MICRO, sign_auth
from kvasir.core.errors import InputError
from kvasir.core.identity import Identity
from kvasir.market.agent.choice import choose_window
from kvasir.market.agent.enroll import manifest_from_coverage
from kvasir.market.records import ClaimRequest, CoverageEntry, ModelRecord
from kvasir.market.server.service import serve_market
from kvasir.market.server.store import MarketStore, demand_multiplier
from tests.marketutil import SignAuth, signed_model

SHA = "ab" * 32
OTHER = "cd" * 32


def _model(sha: str = SHA) -> dict[str, Any]:
    return {
        "sha256": sha,
        "name": "tiny",
        "layers": 6,
        "file_bytes": 10_000,
        "header_bytes": 1000,
        "sources": ["http://127.0.0.1:1/m.gguf"],
        "layer_bytes": [1000] * 6,
        "outside_bytes": 3000,
        "stages": [
            {"layers": [0, 2], "sha256": "01" * 32, "bytes": 4000},
            {"layers": [2, 4], "sha256": "02" * 32, "bytes": 2500},
            {"layers": [4, 6], "sha256": "03" * 32, "bytes": 5000},
        ],
    }


MANIFEST = {"origin": "explicit", "windows": [{"layers": [0, 2]}, {"layers": [2, 4]}, {"layers": [4, 6], "weight": 3}]}


def _claim(node: str, layers: tuple[int, int] = (2, 4), **kw: Any) -> dict[str, Any]:
    return {"model": SHA, "layers": list(layers), "node_id": node, "lease_s": 5, **kw}


OPERATOR = Identity.generate()
KEYS = {name: Identity.generate() for name in ("n1", "n2", "n3", *(f"node{i}" for i in range(16)))}


def nid(name: str) -> str:
    """The node id of test node ``name``: its key's fingerprint."""
    return KEYS[name].node_id


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def sign(clock: Clock) -> Any:
    """``sign("n1")``: httpx auth that signs as test node n1 (or ``sign(OPERATOR)``) at the test clock."""
    return lambda who: SignAuth(KEYS[who] if isinstance(who, str) else who, clock)


@pytest.fixture
async def market(tmp_path: Path, clock: Clock, sign: Any) -> AsyncIterator[httpx.AsyncClient]:
    store = MarketStore(tmp_path / "m.sqlite", clock=clock)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                tmp_path, "127.0.0.1", 0, store=store, identity=OPERATOR, task_status=task_status
            )
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            model = signed_model(_model(), OPERATOR)
            assert (await client.put(f"/v1/models/{SHA}", json=model, auth=sign(OPERATOR))).status_code == 201
            r = await client.put(f"/v1/models/{SHA}/manifest", json=MANIFEST, auth=sign(OPERATOR))
            assert r.status_code == 200
            yield client
        nursery.cancel_scope.cancel()
    store.close()


def fund(tmp_path: Path, clock: Clock, who: Identity, credits: int) -> None:
    """The operator funds ``who``'s account, as ``kvasir market fund`` does: on the market's own database."""
    store = MarketStore(tmp_path / "m.sqlite", clock=clock)
    try:
        store.fund(who.public.to_text(), credits * MICRO)
    finally:
        store.close()


def _entry(rank: int, nbytes: int, reward: float, holder: str | None = None, model: str = SHA) -> CoverageEntry:
    return CoverageEntry(model, rank, rank * 2, rank * 2 + 2, reward, reward, nbytes, "00" * 32, holder)


# ---------------------------------------------------------------------------------------------- pure parts


def test_choice_best_reward_per_byte_that_fits() -> None:
    ws = [_entry(0, 4000, 1.0), _entry(1, 2500, 1.0), _entry(2, 5000, 3.0)]
    draw = random.Random(0)
    assert choose_window(ws, 10_000, draw) == ws[2]  # 3/5000 beats 1/2500
    assert choose_window(ws, 4500, draw) == ws[1]  # the best that fits
    assert choose_window(ws, 2000, draw) is None
    taken = [_entry(0, 4000, 1.0), _entry(1, 2500, 1.0, holder="x"), _entry(2, 5000, 3.0, holder="y")]
    assert choose_window(taken, 10_000, draw) == taken[0]


def test_choice_ties_follow_the_seeded_draw() -> None:
    ws = [_entry(k, 1000, 1.0) for k in range(4)]
    picks = {choose_window(ws, 10_000, random.Random(seed)).rank for seed in range(40)}  # type: ignore[union-attr]
    assert picks == {0, 1, 2, 3}
    a = [choose_window(ws, 10_000, random.Random(7)) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_demand_multiplier() -> None:
    assert demand_multiplier(0) == 1.0 and demand_multiplier(1000) == 2.0


def test_manifest_from_coverage_fills_known_addresses() -> None:
    ws = [
        CoverageEntry(SHA, 0, 0, 2, 1, 1, 10, "00" * 32, "a", 5.0, "serving", "10.0.0.1:7000"),
        CoverageEntry(SHA, 1, 2, 4, 1, 1, 10, "00" * 32, "b", 5.0, "fetching", None),
        CoverageEntry(SHA, 2, 4, 6, 1, 1, 10, "00" * 32),
    ]
    m = manifest_from_coverage(ws, 2, "127.0.0.1", 9000)
    assert [r.address for r in m.ranks] == ["10.0.0.1:7000", "0.0.0.0:0", "127.0.0.1:9000"]
    assert m.successor(2).address == "10.0.0.1:7000" and m.n_layers == 6


@pytest.mark.parametrize(
    "body",
    [
        {},
        {**_model(), "sha256": "XYZ"},
        {**_model(), "layers": 0},
        {**_model(), "sources": []},
        {**_model(), "sources": ["ftp://x"]},
        {**_model(), "layer_bytes": [1, 2]},
        {**_model(), "header_bytes": 10**9},
        {**_model(), "stages": [{"layers": [0, 9], "sha256": "01" * 32, "bytes": 1}]},
    ],
)
def test_model_record_rejects_bad_input(body: dict[str, Any]) -> None:
    with pytest.raises(InputError):
        ModelRecord.from_wire(body)


@pytest.mark.parametrize(
    "body",
    [
        _claim("n1", lease_s=0),
        _claim("n1", lease_s=10**6),
        _claim("bad id!"),
        {**_claim("n1"), "layers": [3, 3]},
        {**_claim("n1"), "layers": "0:2"},
        _claim("n1", state="serving"),
        _claim("n1", state="serving", endpoint="nohost"),
        _claim("n1", state="dancing"),
    ],
)
def test_claim_rejects_bad_input(body: dict[str, Any]) -> None:
    with pytest.raises(InputError):
        ClaimRequest.from_wire(body)


# ---------------------------------------------------------------------------------------------- the API


async def test_concurrent_claims_one_winner(market: httpx.AsyncClient, sign: Any) -> None:
    replies: list[httpx.Response] = []

    async def one(i: int) -> None:
        replies.append(await market.post("/v1/claims", json=_claim(nid(f"node{i}")), auth=sign(f"node{i}")))

    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(one, i)
    ok = [r for r in replies if r.status_code == 200]
    assert len(ok) == 1
    assert {r.status_code for r in replies if r is not ok[0]} == {409}
    assert {r.json()["error"]["code"] for r in replies if r.status_code == 409} == {"window_taken"}
    cov = (await market.get("/v1/coverage")).json()["models"][0]
    assert cov["windows"][1]["holder"] == ok[0].json()["node_id"] and cov["covered"] == 1 and not cov["live"]


async def test_lease_lifecycle(market: httpx.AsyncClient, clock: Clock, sign: Any, tmp_path: Path) -> None:
    n1, n2 = nid("n1"), nid("n2")
    lease = (await market.post("/v1/claims", json=_claim(n1), auth=sign("n1"))).json()
    lid = lease["lease_id"]
    serving = _claim(n1, lease_id=lid, state="serving", endpoint="127.0.0.1:7001")
    r = await market.post("/v1/claims/renew", json=serving, auth=sign("n1"))
    assert r.status_code == 200 and r.json()["expires_at"] == clock.now + 5
    # a foreign lease cannot renew, credit or release
    foreign = {**serving, "node_id": n2, "lease_id": "nope"}
    for path in ("/v1/claims/renew", "/v1/claims/release"):
        r = await market.post(path, json=foreign, auth=sign("n2"))
        assert r.status_code == 409 and r.json()["error"]["code"] == "foreign_lease"
    credit = {"model": SHA, "layers": [2, 4], "node_id": n2, "lease_id": "nope", "tokens": 5}
    assert (await market.post("/v1/credits", json=credit, auth=sign("n2"))).status_code == 409
    # the holder earns what a paid request moves from its client, once every window's holder sent its receipt
    credit = {**credit, "node_id": n1, "lease_id": lid}
    r = await market.post("/v1/credits", json=credit, auth=sign("n1"))
    assert r.json() == {"node_id": n1, "tokens": 0, "layer_tokens": 0, "earned": 0.0}  # its own word counts nothing
    client = Identity.generate()
    fund(tmp_path, clock, client, 100)
    paid = sign_auth(client, OPERATOR.public, SHA, max_tokens=10, max_price=10 * MICRO, not_after=int(clock.now) + 60)
    ring = [nid("n3"), n1, n2]
    assert (await market.post("/v1/claims", json=_claim(n2, layers=(4, 6)), auth=sign("n2"))).status_code == 200
    assert (await market.post("/v1/claims", json=_claim(ring[0], layers=(0, 2)), auth=sign("n3"))).status_code == 200
    receipt = {"request": 1, "tokens": 5, "holders": ring, "client_auth": paid}
    for who in ("n1", "n3"):
        r = await market.post("/v1/receipts", json={"model": SHA, "node_id": nid(who), "receipts": [receipt]},
                              auth=sign(who))  # fmt: skip
        assert r.json() == {"accepted": 1, "settled": 0}
    r = await market.post("/v1/credits", json=credit, auth=sign("n1"))
    assert r.json()["tokens"] == 0  # two of three windows: not settled
    r = await market.post("/v1/receipts", json={"model": SHA, "node_id": n2, "receipts": [receipt]}, auth=sign("n2"))
    assert r.json() == {"accepted": 1, "settled": 1}
    r = await market.post("/v1/credits", json=credit, auth=sign("n1"))
    assert r.json() == {"node_id": n1, "tokens": 5, "layer_tokens": 10, "earned": 5.0}  # 5 tokens × reward 1
    account = (await market.get("/v1/accounts", params={"key": client.public.to_text()})).json()
    assert (account["balance"], account["paid"]) == (75 * MICRO, 25 * MICRO)  # 5 tokens × (1 + 1 + 3)
    # expiry: the window turns uncovered, the old lease cannot renew, another node can claim
    clock.now += 6
    cov = (await market.get("/v1/coverage")).json()["models"][0]["windows"][1]
    assert cov["holder"] is None
    r = await market.post("/v1/claims/renew", json=serving, auth=sign("n1"))
    assert r.status_code == 409 and r.json()["error"]["code"] == "lease_expired"
    assert (await market.post("/v1/credits", json=credit, auth=sign("n1"))).status_code == 409
    lease2 = (await market.post("/v1/claims", json=_claim(n2), auth=sign("n2"))).json()
    r = await market.post("/v1/claims/renew", json=serving, auth=sign("n1"))
    assert r.status_code == 409 and r.json()["error"]["code"] == "foreign_lease"
    # release frees it at once
    ref = {"model": SHA, "layers": [2, 4], "node_id": n2, "lease_id": lease2["lease_id"]}
    assert (await market.post("/v1/claims/release", json=ref, auth=sign("n2"))).status_code == 200
    assert (await market.get("/v1/coverage")).json()["models"][0]["windows"][1]["holder"] is None
    ledger = {n["node_id"]: n for n in (await market.get("/v1/ledger")).json()["nodes"]}
    assert ledger[n1] == {"node_id": n1, "tokens": 5, "layer_tokens": 10, "earned": 5.0, "last": ledger[n1]["last"],
                          "confirmed_by": {n2: 5, nid("n3"): 5}}  # fmt: skip
    assert ledger[n2]["earned"] == 15.0 and ledger[nid("n3")]["earned"] == 5.0


async def test_demand_raises_rewards(market: httpx.AsyncClient, clock: Clock, sign: Any, tmp_path: Path) -> None:
    """Demand is settled client traffic (security N7: one holder's report used to multiply every reward by 1,000):
    a report is refused, and 500 paid tokens raise rewards by half."""
    before = (await market.get("/v1/coverage")).json()["models"][0]["windows"]
    assert [w["reward"] for w in before] == [1.0, 1.0, 3.0]
    assert (await market.post("/v1/claims", json=_claim(nid("n1")), auth=sign("n1"))).status_code == 200
    r = await market.post("/v1/demand", json={"model": SHA, "requests": 4, "tokens": 10**6}, auth=sign("n1"))
    assert r.status_code == 410 and r.json()["error"]["code"] == "gone"
    assert (await market.get("/v1/demand")).json()["models"][0]["multiplier"] == 1.0
    client = Identity.generate()
    fund(tmp_path, clock, client, 10_000)
    ring = [nid("n3"), nid("n1"), nid("n2")]
    for who, layers in (("n3", (0, 2)), ("n2", (4, 6))):
        assert (
            await market.post("/v1/claims", json=_claim(nid(who), layers=layers), auth=sign(who))
        ).status_code == 200
    paid = sign_auth(client, OPERATOR.public, SHA, max_tokens=500, max_price=5 * MICRO, not_after=int(clock.now) + 60)
    for who in ("n3", "n1", "n2"):
        body = {"model": SHA, "node_id": nid(who), "receipts": [{"request": 9, "tokens": 500, "holders": ring,
                                                                 "client_auth": paid}]}  # fmt: skip
        assert (await market.post("/v1/receipts", json=body, auth=sign(who))).status_code == 200
    d = (await market.get("/v1/demand")).json()["models"][0]
    assert (d["requests"], d["tokens"], d["multiplier"]) == (1, 500, 1.5)
    after = (await market.get("/v1/coverage")).json()["models"][0]["windows"]
    assert [w["reward"] for w in after] == [1.5, 1.5, 4.5]
    clock.now += 3600  # old demand no longer counts
    assert (await market.get("/v1/demand")).json()["models"][0]["multiplier"] == 1.0


async def test_bad_requests_store_nothing(market: httpx.AsyncClient, sign: Any) -> None:
    async def err(r: httpx.Response, status: int, code: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code

    n1, op = sign("n1"), sign(OPERATOR)
    await err(await market.post("/v1/claims", content=b"{not json", auth=n1), 400, "bad_request")
    await err(await market.post("/v1/claims", json=[1, 2], auth=n1), 400, "bad_request")
    await err(await market.post("/v1/claims", json=_claim(nid("n1"), layers=(1, 3)), auth=n1), 404, "unknown_window")
    claim_other = {**_claim(nid("n1")), "model": OTHER}
    await err(await market.post("/v1/claims", json=claim_other, auth=n1), 404, "unknown_model")
    await err(await market.get("/v1/claims"), 405, "method_not_allowed")
    await err(await market.get("/v1/nowhere"), 404, "not_found")
    await err(await market.put(f"/v1/models/{OTHER}", json=_model(), auth=op), 400, "bad_request")
    bad_manifest = {"windows": [{"layers": [0, 3]}, {"layers": [3, 6]}]}
    await err(await market.put(f"/v1/models/{SHA}/manifest", json=bad_manifest, auth=op), 400, "bad_request")
    gap = {"windows": [{"layers": [0, 2]}, {"layers": [4, 6]}]}
    await err(await market.put(f"/v1/models/{SHA}/manifest", json=gap, auth=op), 400, "bad_request")
    await err(await market.get(f"/v1/models/{OTHER}/manifest"), 404, "no_manifest")
    await err(await market.post("/v1/demand", json={"model": SHA, "tokens": -1}, auth=n1), 410, "gone")
    deep = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError: a 400, never a 500
    await err(await market.post("/v1/claims", content=deep, auth=n1), 400, "bad_request")
    port = market.base_url.port
    assert port is not None
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"POST /v1/claims HTTP/1.1\r\nhost: x\r\ncontent-length: 9999999\r\n\r\n")
        reply = await stream.receive_some(4096)
    assert reply.startswith(b"HTTP/1.1 413")
    cov = (await market.get("/v1/coverage")).json()["models"][0]
    assert cov["covered"] == 0 and [w["layers"] for w in cov["windows"]] == [[0, 2], [2, 4], [4, 6]]
    assert (await market.get("/v1/ledger")).json() == {"nodes": []}
    assert (await market.get("/v1/demand")).json()["models"][0]["requests"] == 0


async def test_restart_loses_nothing(tmp_path: Path, clock: Clock) -> None:
    db = tmp_path / "m.sqlite"
    store = MarketStore(db, clock=clock)
    store.put_model(ModelRecord.from_wire(signed_model(_model(), OPERATOR)))
    from kvasir.market.records import ManifestRecord

    store.put_manifest(ManifestRecord.from_wire(MANIFEST, SHA))
    lease = store.claim(ClaimRequest(SHA, 0, 2, nid("n1"), 30.0))
    store.close()
    again = MarketStore(db, clock=clock)
    cov = again.coverage()["models"][0]["windows"]
    assert cov[0]["holder"] == nid("n1") and cov[0]["lease_expires"] == lease.expires_at
    assert again.model(SHA).signed_by(OPERATOR.public)  # the record keeps its signature
    again.close()


def test_relay_runs_the_market(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvasir.core.identity import IDENTITY_FILE, load_identity
    from tests.marketutil import Proc

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the market's machine identity lives here
    relay = Proc(
        "relay", "--trust-key", "ed25519:" + "A" * 43, "--listen", "127.0.0.1:0", "--market", "127.0.0.1:0",
        "--db", str(tmp_path / "m.sqlite"),
    )  # fmt: skip
    try:
        url = relay.wait_line(r"market on (http://\S+)").group(1)
        relay.wait_line(r"listening on ws://")
        operator = load_identity(tmp_path / "data" / "kvasir" / IDENTITY_FILE)  # the default operator: the machine
        r = httpx.put(f"{url}/v1/models/{SHA}", json=_model(), timeout=10, auth=SignAuth(operator))
        assert r.status_code == 400  # an unsigned record is refused even from the operator
        model = signed_model(_model(), operator)
        r = httpx.put(f"{url}/v1/models/{SHA}", json=model, timeout=10, auth=SignAuth(operator))
        assert r.status_code == 201
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["models"][0]["sha256"] == SHA
    finally:
        relay.stop()
    assert (tmp_path / "m.sqlite").exists()
