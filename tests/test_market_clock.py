"""Issue 25 item 4: the market through time (docs/market.md § Market time).

A real ``kvasir market`` process on loopback with real SQLite, whose wall clock alone is stepped through the
``KVASIR_MARKET_WALL_SKEW_FILE`` hook (the system clock is untouched); nodes are the real market client and lease
keeper with their own keys (no llama.cpp: the market only sees their requests). A step of the market's clock, a
restart onto a skewed clock either way, and a node whose own clock is off evict nobody and refuse nobody; a
replayed request is still refused; a spare takes a dead holder's window within one lease. The pure parts are
tested first.
"""

from __future__ import annotations

import logging
import random
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from kvasir.core.errors import MarketError
from kvasir.core.identity import Identity, load_or_create_identity
from kvasir.market import auth
from kvasir.market.agent.client import MarketClient, is_transient
from kvasir.market.agent.enroll import _window_failed
from kvasir.market.agent.lease import LeaseKeeper, LeaseLost
from kvasir.market.agent.policy import Claim, OwnState, decide, next_look, window_key
from kvasir.market.agent.ringmap import UNKNOWN_HOST, UNKNOWN_PORT, keep_known
from kvasir.market.records import ClaimRequest, CoverageEntry
from kvasir.market.server.clock import SKEW_FILE_ENV, MarketClock, wall_clock_from_env
from kvasir.ring.manifest import Manifest, RankEntry
from tests.harness.marketload import publish
from tests.marketutil import Proc

LEASE_S = 3.0
POLL_S = 0.3
WINDOWS = 3


# ---------------------------------------------------------------------------------------------- pure parts


class Ticking:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_market_time_ignores_wall_steps_and_never_runs_back(caplog: pytest.LogCaptureFixture) -> None:
    wall, mono = Ticking(1000.0), Ticking(5.0)
    clock = MarketClock(wall, mono=mono)
    assert clock() == 1000.0
    mono.t += 10
    wall.t += 10 + 40  # the host's clock stepped +40 s meanwhile
    with caplog.at_level(logging.WARNING, logger="kvasir.market"):
        assert clock() == 1010.0
        assert clock() == 1010.0  # logged once per step
    assert [r.getMessage().split(";")[0] for r in caplog.records] == ["the host's clock stepped by +40.0 s"]
    # A start on a host whose clock is behind the market's last time carries on from that time.
    again = MarketClock(Ticking(700.0), floor=1010.0, mono=mono)
    assert again() == 1010.0 and again.behind_at_start == 310.0


def test_the_skew_file_shifts_only_the_clock_read_through_it(tmp_path: Path) -> None:
    skew = tmp_path / "skew"
    assert wall_clock_from_env({}) is time.time
    wall = wall_clock_from_env({SKEW_FILE_ENV: str(skew)})
    assert abs(wall() - time.time()) < 1  # no file yet: no skew
    skew.write_text("-300\n")
    assert abs(wall() - (time.time() - 300)) < 1
    skew.write_text("garbage")
    assert abs(wall() - time.time()) < 1


def test_the_market_time_header_and_the_estimate() -> None:
    assert auth.parse_market_time(auth.format_market_time(1234.5678)) == 1234.568
    for bad in (None, "", "-5", "1e9", "12.", "nan"):
        assert auth.parse_market_time(bad) is None
    assert auth.MarketTime(1000.0, 3.0).at(5.5) == 1002.5


def test_what_counts_as_the_markets_failure_not_the_windows() -> None:
    down = MarketError(0, "unreachable", "market: ConnectError")
    assert is_transient(down) and is_transient(MarketError(503, "busy", "x"))
    assert not is_transient(MarketError(409, "window_taken", "x")) and not is_transient(LeaseLost("no source"))
    assert is_transient(MarketError(401, "stale_request", "x"))
    assert not is_transient(MarketError(401, "bad_signature", "x"))
    nested: Any = BaseExceptionGroup("inner", [down])
    assert not _window_failed(BaseExceptionGroup("s", [down, nested]))
    assert _window_failed(BaseExceptionGroup("s", [down, LeaseLost("no source")]))


def test_a_node_holding_nothing_takes_back_a_window_the_map_shows_it_holding() -> None:
    """A claim whose reply was lost when the market died: claiming again renews it, instead of taking a second window
    (which would leave a node that fits only that one waiting while the lost claim blocks the first)."""
    base = CoverageEntry("a" * 64, 0, 0, 2, 1.0, 1.0, 100, "b" * 64)
    coverage = [base, attrs.evolve(base, rank=1, start=2, end=4, reward=9.0, holder="me", state="fetching")]
    assert decide(coverage, OwnState("me"), 1000, random.Random(0)) == Claim(coverage[1])
    assert decide(coverage, OwnState("other"), 1000, random.Random(0)) == Claim(coverage[0])


def test_a_waiting_node_looks_again_as_a_claimable_lease_ends() -> None:
    base = CoverageEntry("a" * 64, 0, 0, 2, 1.0, 1.0, 100, "b" * 64, "x", lease_expires=1000.5, state="serving")
    big = attrs.evolve(base, rank=1, start=2, end=4, bytes=10_000, lease_expires=1000.1)
    own = OwnState("me")
    assert next_look([base, big], own, 1000, 1000.0, 2.0) == pytest.approx(0.55)  # the big one does not fit
    assert next_look([base], OwnState("me", avoid=frozenset({window_key(base)})), 1000, 1000.0, 2.0) == 2.0
    assert next_look([base], own, 1000, 990.0, 2.0) == 2.0  # not before the next poll anyway
    assert next_look([base], own, 1000, 1001.0, 2.0) == 2.0  # looks over already: no tight loop


def _manifest(*hosts: tuple[str, int]) -> Manifest:
    ranks = tuple(RankEntry(r, 2 * r, 2 * r + 2, h, p) for r, (h, p) in enumerate(hosts))
    return Manifest(model_sha256="a" * 64, n_layers=2 * len(hosts), ranks=ranks)


def test_an_uncovered_window_keeps_the_neighbour_the_node_knows() -> None:
    unknown = (UNKNOWN_HOST, UNKNOWN_PORT)
    current = _manifest(("127.0.0.1", 1), ("127.0.0.1", 2), ("127.0.0.1", 3))
    lapsed = _manifest(("127.0.0.1", 1), unknown, unknown)
    assert keep_known(lapsed, current, {1, 2}) == current
    moved = _manifest(("127.0.0.1", 1), ("127.0.0.1", 9), unknown)
    assert [r.port for r in keep_known(moved, current, {2}).ranks] == [1, 9, 3]
    # A serving neighbour behind a relay has no address on the map, only its key: that is news, not a lapse.
    relayed = _manifest(("127.0.0.1", 1), unknown, unknown)
    assert keep_known(relayed, current, set()) == relayed


# ---------------------------------------------------------------------------------------------- real processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def skew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The market's wall-clock skew file (seconds); only ``kvasir market`` reads it."""
    path = tmp_path / "skew"
    path.write_text("0")
    monkeypatch.setenv(SKEW_FILE_ENV, str(path))
    return path


def _market(tmp: Path, port: int) -> tuple[Proc, str]:
    p = Proc("market", "--listen", f"127.0.0.1:{port}", "--db", str(tmp / "m.sqlite"), "--identity",
             str(tmp / "market.pem"), "--create-identity")  # fmt: skip
    return p, p.wait_line(r"listening on (http://\S+)").group(1)


class Ring:
    """Holders of every window, each a real client and lease keeper renewing as ``serving``, and a spare that polls
    the coverage map and claims whatever the enrollment policy offers it."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.holders = [Identity.generate() for _ in range(WINDOWS)]
        self.clients = [MarketClient(url, identity=h, timeout=3) for h in self.holders]
        self.keepers = [LeaseKeeper(c, h.node_id, LEASE_S) for c, h in zip(self.clients, self.holders, strict=True)]
        self.scopes = [trio.CancelScope() for _ in self.holders]
        self.lease_ids: list[str] = []
        self.spare = Identity.generate()
        self.spare_client = MarketClient(url, identity=self.spare, timeout=3)
        self.spare_won: list[tuple[float, int]] = []  # (monotonic time, rank)
        self.spare_claimed = trio.Event()
        self.errors: list[str] = []

    async def enroll(self, nursery: trio.Nursery) -> None:
        coverage = await self.clients[0].coverage(self.model)
        for i, (keeper, window) in enumerate(zip(self.keepers, coverage, strict=True)):
            await keeper.claim(window)
            keeper.endpoint = f"127.0.0.1:{7000 + i}"
            await keeper.renew()
            assert keeper.lease is not None
            self.lease_ids.append(keeper.lease.lease_id)
            nursery.start_soon(self._keep, i)
        nursery.start_soon(self._spare)

    async def _keep(self, i: int) -> None:
        with self.scopes[i]:
            try:
                await self.keepers[i].keep()
            except LeaseLost as exc:
                self.errors.append(f"holder {i}: {exc}")

    async def _spare(self) -> None:
        keeper = LeaseKeeper(self.spare_client, self.spare.node_id, LEASE_S)
        own = OwnState(self.spare.node_id)
        wait = POLL_S
        while True:
            await trio.sleep(wait)
            wait = POLL_S
            try:
                coverage = await self.spare_client.coverage(self.model)
                decision = decide(coverage, own, 1 << 40, random.Random(0))
                if isinstance(decision, Claim):
                    await keeper.claim(decision.window)
                    self.spare_won.append((time.monotonic(), decision.window.rank))
                    self.spare_claimed.set()
                    return
                wait = next_look(coverage, own, 1 << 40, self.spare_client.market_time(), POLL_S)  # as Enrollment
            except MarketError as exc:
                if not is_transient(exc) and exc.status != 409:
                    self.errors.append(f"spare: {exc}")

    async def all_kept(self, seconds: float) -> None:
        """Watch for ``seconds``; then every holder still holds its first lease, live, and the spare won nothing."""
        await trio.sleep(seconds)
        assert not self.errors, self.errors
        assert not self.spare_won, f"the spare evicted a healthy holder: {self.spare_won}"
        coverage = await self.spare_client.coverage(self.model)
        assert [w.holder for w in coverage] == [h.node_id for h in self.holders]
        assert all(w.serving for w in coverage)
        for keeper, lease_id, client in zip(self.keepers, self.lease_ids, self.clients, strict=True):
            assert keeper.lease is not None and keeper.lease.lease_id == lease_id
            assert keeper.lease.expires_at > client.market_time()  # renewed lately, in the market's time

    async def aclose(self) -> None:
        for c in (*self.clients, self.spare_client):
            await c.aclose()


@pytest.mark.slow
def test_a_step_of_the_markets_clock_evicts_nobody_and_a_dead_holder_goes_within_a_lease(
    tmp_path: Path, skew: Path
) -> None:
    operator = load_or_create_identity(tmp_path / "market.pem")
    market, url = _market(tmp_path, _free_port())
    try:
        took = trio.run(_step_then_kill, url, operator, skew)
    finally:
        market.stop()
    err = "\n".join(market.err)
    assert "the host's clock stepped by +40" in err and "the host's clock stepped by -340" in err, err
    print(f"the spare held the window {took:.2f} s after its holder died just after a renewal (lease {LEASE_S} s)")


async def _step_then_kill(url: str, operator: Identity, skew: Path) -> float:
    (model,) = await publish(url, operator, WINDOWS)
    ring = Ring(url, model)
    try:
        async with trio.open_nursery() as nursery:
            await ring.enroll(nursery)
            await ring.all_kept(LEASE_S)
            await trio.Path(skew).write_text("40")  # +40 s: more than a lease
            await ring.all_kept(2 * LEASE_S)
            await trio.Path(skew).write_text("-300")  # then back 340 s: far more than the request window
            await ring.all_kept(2 * LEASE_S)
            # Holder 1 dies without a word right after a renewal (the worst case): the spare takes its window as
            # that lease ends, one lease after the death, not a poll later.
            keeper = ring.keepers[1]
            renewed = keeper.lease
            with trio.fail_after(LEASE_S):
                while keeper.lease is renewed:  # noqa: ASYNC110 (the keeper has no event to wait on)
                    await trio.sleep(0.005)
            ring.scopes[1].cancel()
            dead = time.monotonic()
            with trio.fail_after(2 * LEASE_S):
                await ring.spare_claimed.wait()
            at, rank = ring.spare_won[0]
            assert rank == 1
            took = at - dead
            assert LEASE_S - 0.25 <= took <= LEASE_S + 0.25, took
            nursery.cancel_scope.cancel()
        return took
    finally:
        await ring.aclose()


@pytest.mark.slow
def test_a_market_restarted_on_a_clock_ahead_or_behind_keeps_every_holder(tmp_path: Path, skew: Path) -> None:
    operator = load_or_create_identity(tmp_path / "market.pem")
    port = _free_port()
    markets = [_market(tmp_path, port)[0]]
    url = f"http://127.0.0.1:{port}"

    def restart(seconds: str) -> None:
        markets[-1].p.send_signal(signal.SIGKILL)
        markets[-1].stop()
        time.sleep(1.0)  # down a third of a lease
        skew.write_text(seconds)
        markets.append(_market(tmp_path, port)[0])

    try:
        skews = trio.run(_restarts, url, operator, restart)
    finally:
        for m in markets:
            m.stop()
    ahead, behind = skews
    assert 118 < ahead < 125, ahead  # the nodes learnt the market's new time
    # Restarted on a clock 300 s behind: market time carried on from its last time (less the downtime, during
    # which it does not run), it never ran back.
    assert ahead - 15 < behind <= ahead, behind
    assert "s behind the market's last time" in "\n".join(markets[-1].err), markets[-1].err


async def _restarts(url: str, operator: Identity, restart: Callable[[str], None]) -> tuple[float, float]:
    (model,) = await publish(url, operator, WINDOWS)
    ring = Ring(url, model)
    skews = []
    try:
        async with trio.open_nursery() as nursery:
            await ring.enroll(nursery)
            await ring.all_kept(LEASE_S)
            for seconds in ("120", "-300"):
                await trio.to_thread.run_sync(restart, seconds)
                await ring.all_kept(2 * LEASE_S)
                skew = ring.clients[0].skew()
                assert skew is not None
                skews.append(skew)
            nursery.cancel_scope.cancel()
    finally:
        await ring.aclose()
    return skews[0], skews[1]


def test_a_node_whose_clock_is_off_is_heard_and_a_replay_is_still_refused(tmp_path: Path, skew: Path) -> None:
    operator = load_or_create_identity(tmp_path / "market.pem")
    skew.write_text("-200")  # the market's clock 200 s behind the nodes' from its start
    market, url = _market(tmp_path, _free_port())
    try:
        trio.run(_skewed_node, url, operator)
    finally:
        market.stop()


async def _skewed_node(url: str, operator: Identity) -> None:
    (model,) = await publish(url, operator, WINDOWS)  # the operator's first write: refused stale, signed again
    node = Identity.generate()
    async with MarketClient(url, identity=node, clock=lambda: time.time() + 3600) as c:  # and this one's an hour ahead
        lease = await c.claim(ClaimRequest(model, 0, 1, node.node_id, LEASE_S))  # its first contact is a write
        skew = c.skew()
        assert skew is not None and -3810 < skew < -3790, skew
        body = ClaimRequest(model, 0, 1, node.node_id, LEASE_S, lease_id=lease.lease_id).to_wire()
        content = httpx.Request("POST", url, json=body).content
        async with httpx.AsyncClient() as h:
            for when, code in ((time.time() + 3600, "stale_request"), (c.market_time() - 120, "stale_request")):
                headers = auth.sign_request(node, "POST", "/v1/claims/renew", content, when)
                r = await h.post(f"{url}/v1/claims/renew", content=content, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == code, r.text
                assert auth.parse_market_time(r.headers.get(auth.H_MARKET_TIME)) is not None
            headers = auth.sign_request(node, "POST", "/v1/claims/renew", content, c.market_time())
            first = await h.post(f"{url}/v1/claims/renew", content=content, headers=headers)
            assert first.status_code == 200, first.text
            replay = await h.post(f"{url}/v1/claims/renew", content=content, headers=headers)
            assert replay.status_code == 401 and replay.json()["error"]["code"] == "replayed_request", replay.text
