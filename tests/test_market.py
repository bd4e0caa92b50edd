"""The market: records, the pure choice rule, and the HTTP API (claims compare-and-set, leases, ledger, errors)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvasir.errors import InputError
from kvasir.market.choice import choose_window
from kvasir.market.enroll import manifest_from_coverage
from kvasir.market.records import ClaimRequest, CoverageEntry, ModelRecord
from kvasir.market.service import serve_market
from kvasir.market.store import MarketStore, demand_multiplier

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


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def market(tmp_path: Path, clock: Clock) -> AsyncIterator[httpx.AsyncClient]:
    store = MarketStore(tmp_path / "m.sqlite", clock=clock)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(tmp_path, "127.0.0.1", 0, store=store, task_status=task_status)
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert (await client.put(f"/v1/models/{SHA}", json=_model())).status_code == 201
            assert (await client.put(f"/v1/models/{SHA}/manifest", json=MANIFEST)).status_code == 200
            yield client
        nursery.cancel_scope.cancel()
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


async def test_concurrent_claims_one_winner(market: httpx.AsyncClient) -> None:
    replies: list[httpx.Response] = []

    async def one(i: int) -> None:
        replies.append(await market.post("/v1/claims", json=_claim(f"node{i}")))

    async with trio.open_nursery() as nursery:
        for i in range(16):
            nursery.start_soon(one, i)
    ok = [r for r in replies if r.status_code == 200]
    assert len(ok) == 1
    assert {r.status_code for r in replies if r is not ok[0]} == {409}
    assert {r.json()["error"]["code"] for r in replies if r.status_code == 409} == {"window_taken"}
    cov = (await market.get("/v1/coverage")).json()["models"][0]
    assert cov["windows"][1]["holder"] == ok[0].json()["node_id"] and cov["covered"] == 1 and not cov["live"]


async def test_lease_lifecycle(market: httpx.AsyncClient, clock: Clock) -> None:
    lease = (await market.post("/v1/claims", json=_claim("n1"))).json()
    lid = lease["lease_id"]
    serving = _claim("n1", lease_id=lid, state="serving", endpoint="127.0.0.1:7001")
    r = await market.post("/v1/claims/renew", json=serving)
    assert r.status_code == 200 and r.json()["expires_at"] == clock.now + 5
    # a foreign lease cannot renew, credit or release
    foreign = {**serving, "node_id": "n2", "lease_id": "nope"}
    for path in ("/v1/claims/renew", "/v1/claims/release"):
        r = await market.post(path, json=foreign)
        assert r.status_code == 409 and r.json()["error"]["code"] == "foreign_lease"
    credit = {"model": SHA, "layers": [2, 4], "node_id": "n2", "lease_id": "nope", "tokens": 5}
    assert (await market.post("/v1/credits", json=credit)).status_code == 409
    # the holder is credited tokens × layers and tokens × reward
    credit = {**credit, "node_id": "n1", "lease_id": lid}
    r = await market.post("/v1/credits", json=credit)
    assert r.json() == {"node_id": "n1", "tokens": 5, "layer_tokens": 10, "earned": 5.0}
    # expiry: the window turns uncovered, the old lease cannot renew, another node can claim
    clock.now += 6
    cov = (await market.get("/v1/coverage")).json()["models"][0]["windows"][1]
    assert cov["holder"] is None
    r = await market.post("/v1/claims/renew", json=serving)
    assert r.status_code == 409 and r.json()["error"]["code"] == "lease_expired"
    assert (await market.post("/v1/credits", json=credit)).status_code == 409
    lease2 = (await market.post("/v1/claims", json=_claim("n2"))).json()
    r = await market.post("/v1/claims/renew", json=serving)
    assert r.status_code == 409 and r.json()["error"]["code"] == "foreign_lease"
    # release frees it at once
    ref = {"model": SHA, "layers": [2, 4], "node_id": "n2", "lease_id": lease2["lease_id"]}
    assert (await market.post("/v1/claims/release", json=ref)).status_code == 200
    assert (await market.get("/v1/coverage")).json()["models"][0]["windows"][1]["holder"] is None
    ledger = (await market.get("/v1/ledger")).json()["nodes"]
    assert ledger == [{"node_id": "n1", "tokens": 5, "layer_tokens": 10, "earned": 5.0, "last": ledger[0]["last"]}]


async def test_demand_raises_rewards(market: httpx.AsyncClient, clock: Clock) -> None:
    before = (await market.get("/v1/coverage")).json()["models"][0]["windows"]
    assert [w["reward"] for w in before] == [1.0, 1.0, 3.0]
    r = await market.post("/v1/demand", json={"model": SHA, "requests": 4, "tokens": 500})
    d = r.json()["models"][0]
    assert (d["requests"], d["tokens"], d["multiplier"]) == (4, 500, 1.5)
    after = (await market.get("/v1/coverage")).json()["models"][0]["windows"]
    assert [w["reward"] for w in after] == [1.5, 1.5, 4.5]
    clock.now += 3600  # old demand no longer counts
    assert (await market.get("/v1/demand")).json()["models"][0]["multiplier"] == 1.0


async def test_bad_requests_store_nothing(market: httpx.AsyncClient) -> None:
    async def err(r: httpx.Response, status: int, code: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code

    await err(await market.post("/v1/claims", content=b"{not json"), 400, "bad_request")
    await err(await market.post("/v1/claims", json=[1, 2]), 400, "bad_request")
    await err(await market.post("/v1/claims", json=_claim("n1", layers=(1, 3))), 404, "unknown_window")
    await err(await market.post("/v1/claims", json={**_claim("n1"), "model": OTHER}), 404, "unknown_model")
    await err(await market.get("/v1/claims"), 405, "method_not_allowed")
    await err(await market.get("/v1/nowhere"), 404, "not_found")
    await err(await market.put(f"/v1/models/{OTHER}", json=_model()), 400, "bad_request")
    bad_manifest = {"windows": [{"layers": [0, 3]}, {"layers": [3, 6]}]}
    await err(await market.put(f"/v1/models/{SHA}/manifest", json=bad_manifest), 400, "bad_request")
    gap = {"windows": [{"layers": [0, 2]}, {"layers": [4, 6]}]}
    await err(await market.put(f"/v1/models/{SHA}/manifest", json=gap), 400, "bad_request")
    await err(await market.get(f"/v1/models/{OTHER}/manifest"), 404, "no_manifest")
    await err(await market.post("/v1/demand", json={"model": SHA, "tokens": -1}), 400, "bad_request")
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
    store.put_model(ModelRecord.from_wire(_model()))
    from kvasir.market.records import ManifestRecord

    store.put_manifest(ManifestRecord.from_wire(MANIFEST, SHA))
    lease = store.claim(ClaimRequest(SHA, 0, 2, "n1", 30.0))
    store.close()
    again = MarketStore(db, clock=clock)
    cov = again.coverage()["models"][0]["windows"]
    assert cov[0]["holder"] == "n1" and cov[0]["lease_expires"] == lease.expires_at
    again.close()


def test_relay_runs_the_market(tmp_path: Path) -> None:
    from tests.marketutil import Proc

    relay = Proc(
        "relay", "--trust-key", "ed25519:" + "A" * 43, "--listen", "127.0.0.1:0", "--market", "127.0.0.1:0",
        "--db", str(tmp_path / "m.sqlite"),
    )  # fmt: skip
    try:
        url = relay.wait_line(r"market on (http://\S+)").group(1)
        relay.wait_line(r"listening on ws://")
        r = httpx.put(f"{url}/v1/models/{SHA}", json=_model(), timeout=10)
        assert r.status_code == 201
        assert httpx.get(f"{url}/v1/models", timeout=10).json()["models"][0]["sha256"] == SHA
    finally:
        relay.stop()
    assert (tmp_path / "m.sqlite").exists()
