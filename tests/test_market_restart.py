"""Issue 11: the market killed with SIGKILL mid-enrollment and started again on the same database and port.

A real ``kvasir market`` process; nodes are the real client with their own keys (no llama.cpp: the market only
sees their requests). Before the kill four nodes hold windows and serve, and the operator funds a client's account;
spares are claiming the last windows when the market dies. After the restart: every lease, ticket, account and ledger
row is as it was, the holders renew their own leases (same lease ids, tickets from the same market key), no window
has two holders, the spares finish enrolling, and the client's paid request settles.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import trio

from kvasir.core.clientauth import MICRO, sign_auth
from kvasir.core.errors import MarketError
from kvasir.core.identity import Identity, PublicKey, load_or_create_identity
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import ClaimRequest, CreditReport, Lease, Receipt, ReceiptBatch
from kvasir.market.tickets import parse_ticket
from tests.harness.marketload import publish
from tests.marketutil import Proc

WINDOWS = 6
LEASE_S = 30.0
CLIENT = Identity.generate()  # long enough that nothing expires on a slow machine: this test is about the restart


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _market(tmp: Path, port: int) -> tuple[Proc, str]:
    p = Proc("market", "--listen", f"127.0.0.1:{port}", "--db", str(tmp / "m.sqlite"), "--identity",
             str(tmp / "market.pem"), "--create-identity")  # fmt: skip
    return p, p.wait_line(r"listening on (http://\S+)").group(1)


def _serving(lease: Lease, node: Identity, i: int) -> ClaimRequest:
    return ClaimRequest(lease.model, lease.start, lease.end, node.node_id, LEASE_S, state="serving",
                        endpoint=f"127.0.0.1:{7000 + i}", lease_id=lease.lease_id)  # fmt: skip


def test_kill_9_mid_enrollment_loses_nothing(tmp_path: Path) -> None:
    operator = load_or_create_identity(tmp_path / "market.pem")  # the market's own key is the operator's
    port = _free_port()
    holders = [Identity.generate() for _ in range(4)]
    spares = [Identity.generate() for _ in range(8)]
    market, url = _market(tmp_path, port)
    try:
        model, leases, tickets, ledger, spare_wins = trio.run(
            _before_kill, url, operator, holders, spares, market, tmp_path / "m.sqlite"
        )
        market.stop()  # already dead: collects its output
        assert market.p.returncode == -signal.SIGKILL
        market, url2 = _market(tmp_path, port)
        assert url2 == url
        trio.run(_after_restart, url, operator, model, holders, spares, leases, tickets, ledger, spare_wins)
    finally:
        market.stop()


async def _before_kill(
    url: str, operator: Identity, holders: list[Identity], spares: list[Identity], market: Proc, db: Path
) -> tuple[str, list[Lease], list[str], dict[str, object], dict[int, tuple[str, str]]]:
    (model,) = await publish(url, operator, WINDOWS)
    leases = []
    for i, node in enumerate(holders):  # enrolled: claimed, then serving
        async with MarketClient(url, identity=node) as c:
            lease = await c.claim(ClaimRequest(model, i, i + 1, node.node_id, LEASE_S))
            leases.append(await c.renew(_serving(lease, node, i)))
    # The operator funds a client while the market runs (SQLite takes turns); nothing is settled yet.
    fund = Proc("market", "fund", "--db", str(db), "--key", CLIENT.public.to_text(), "--credits", "1000")
    assert await trio.to_thread.run_sync(fund.wait) == 0, fund.err
    async with MarketClient(url) as c:
        ledger = await c.status()

    # Spares race for the two free windows while the market is killed under them.
    wins: dict[int, tuple[str, str]] = {}
    cut: list[str] = []
    odd: list[str] = []

    async def spare(node: Identity, k: int) -> None:
        window = len(holders) + k % 2
        async with MarketClient(url, identity=node, timeout=5) as c:
            for _ in range(200):
                try:
                    lease = await c.claim(ClaimRequest(model, window, window + 1, node.node_id, LEASE_S))
                except MarketError as exc:
                    if exc.status == 0:
                        cut.append(node.node_id)  # the market died under this claim: no answer, no lease believed
                        return
                    if exc.code != "window_taken":
                        odd.append(f"{node.node_id}: {exc!r}")
                    await trio.sleep(0.01)
                    continue
                except Exception as exc:  # collected, so a failure says what happened to every spare
                    odd.append(f"{node.node_id}: {exc!r}")
                    return
                if wins.setdefault(window, (node.node_id, lease.lease_id)) != (node.node_id, lease.lease_id):
                    odd.append(f"{node.node_id} won window {window} held by {wins[window]}")
                return

    async with trio.open_nursery() as nursery:
        for k, node in enumerate(spares):
            nursery.start_soon(spare, node, k)
        await trio.sleep(0.05)
        market.p.send_signal(signal.SIGKILL)
    assert not odd, odd
    assert cut, "the market was killed after enrollment, not during it"
    return model, leases, [lease.ticket or "" for lease in leases], ledger["ledger"], wins


async def _after_restart(
    url: str,
    operator: Identity,
    model: str,
    holders: list[Identity],
    spares: list[Identity],
    leases: list[Lease],
    tickets: list[str],
    ledger: dict[str, object],
    spare_wins: dict[int, tuple[str, str]],
) -> None:
    async with MarketClient(url) as c:
        keys = await c.operator()
        status = await c.status()
    market_key = PublicKey.from_text(keys["market"])
    assert market_key == operator.public
    assert status["ledger"] == ledger  # credits and who earned them: intact
    windows = status["coverage"]["models"][0]["windows"]
    for lease, w in zip(leases, windows, strict=False):
        assert w["holder"] == lease.node_id and w["state"] == "serving"
        assert w["lease_expires"] >= lease.expires_at  # and extended by the outage, never shortened
    for w in windows[len(leases) :]:
        won = spare_wins.get(w["rank"])
        if won is not None:  # a spare told it won before the kill holds it now
            assert w["holder"] == won[0], (w, won)
    for lease, ticket in zip(leases, tickets, strict=True):  # tickets issued before the kill still verify
        t = parse_ticket(ticket, market_key)
        assert (t.start, t.end, t.holder.fingerprint) == (lease.start, lease.end, lease.node_id)

    # The holders carry on: their own leases renew, with fresh tickets from the same key.
    for i, (node, lease) in enumerate(zip(holders, leases, strict=True)):
        async with MarketClient(url, identity=node) as c:
            again = await c.renew(_serving(lease, node, i))
            assert again.lease_id == lease.lease_id and again.ticket
            assert parse_ticket(again.ticket, market_key).not_after > time.time()
    # The spares finish enrolling: each free window goes to exactly one of them.
    got: dict[int, str] = {}
    for node in spares:
        async with MarketClient(url, identity=node) as c:
            for window in range(len(holders), WINDOWS):
                try:
                    lease = await c.claim(ClaimRequest(model, window, window + 1, node.node_id, LEASE_S))
                except MarketError as exc:
                    assert exc.code == "window_taken", exc
                    continue
                assert window not in got or got[window] == node.node_id
                got[window] = node.node_id
    async with MarketClient(url) as c:
        final = (await c.status())["coverage"]["models"][0]
    assert final["covered"] == WINDOWS
    for window in range(len(holders), WINDOWS):
        holder = final["windows"][window]["holder"]
        assert holder == spare_wins.get(window, (got.get(window),))[0]
    # The client's account came through the kill: every holder's receipt of its paid request settles it.
    ring = tuple(w["holder"] for w in final["windows"])
    paid = sign_auth(CLIENT, market_key, model, max_tokens=40, max_price=10 * MICRO, not_after=int(time.time()) + 600)
    for node in [*holders, *spares]:
        if node.node_id in ring:
            async with MarketClient(url, identity=node) as c:
                await c.receipts(ReceiptBatch(model, node.node_id, (Receipt(1, 40, ring, client_auth=paid),)))
    async with MarketClient(url, identity=holders[0]) as c:
        lease = leases[0]
        mine = await c.credit(CreditReport(model, lease.start, lease.end, lease.node_id, lease.lease_id, 10**9))
    assert mine["tokens"] == 40  # what the client's request paid, not what the holder says
