"""A load of simulated enrolling nodes against a running market (bench/market_load.py, tests/test_market_load.py).

Each simulated node has its own Ed25519 identity and talks through the real client
(:class:`~kvasir.market.agent.client.MarketClient`) over real sockets, like an enrolling node without llama.cpp:
a spare polls the whole coverage map and claims a free window at random; a holder renews every ``lease_s / 3`` and
polls its model's map every ``poll_s`` (as ``kvasir node`` does to follow its neighbours); now and then a holder goes
silent (a crash: no release) and comes back later as a spare, so expired windows change hands under contention.
Requests in flight are bounded by one shared connection pool.

Every lease a node was granted is recorded with the market's own times (``expires_at - lease_s`` is when the claim
was granted), so :func:`double_holders` can prove that no two leases on one window overlapped, and
:func:`store_disagreements` checks the market's database against what the nodes were told.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import httpx
import trio

from kvasir.core.errors import InputError, MarketError
from kvasir.core.identity import Identity
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import ClaimRequest, Lease, ManifestRecord, ModelRecord

T = TypeVar("T")

#: Slack when comparing the market's float times (expires_at - lease_s is the grant time to within an ulp).
TIME_EPS = 1e-6


@attrs.frozen
class LoadConfig:
    nodes: int = 1000
    models: int = 10
    #: One-layer windows per model.
    windows: int = 8
    duration_s: float = 60.0
    #: Nodes start spread over this many seconds (an enrolling crowd, not one burst).
    ramp_s: float = 40.0
    lease_s: float = 30.0
    #: A holder polls its own model's map this often (``kvasir node --poll`` is 2 s).
    poll_s: float = 5.0
    #: A spare polls the whole map this often (also ``--poll`` in ``kvasir node``).
    spare_poll_s: float = 60.0
    #: Chance that a holder goes silent at a renewal (it comes back as a spare after a lease or two).
    drop_p: float = 0.05
    #: Requests in flight at most (one shared pool; the market allows 32 connections per client address).
    connections: int = 24
    seed: int = 1


@attrs.frozen
class Grant:
    """One lease as its node saw it: window [window, window + 1) of ``model``, granted at ``start`` (market time),
    last renewed to ``end``."""

    model: str
    window: int
    node: str
    lease_id: str
    start: float
    end: float


@attrs.define
class Tally:
    claim_s: list[float] = attrs.field(factory=list)
    renew_s: list[float] = attrs.field(factory=list)
    poll_s: list[float] = attrs.field(factory=list)  # a holder's poll of its model
    map_s: list[float] = attrs.field(factory=list)  # a spare's poll of the whole map
    wait_s: list[float] = attrs.field(factory=list)  # waiting for a slot (offered load beyond what is answered)
    claims_won: int = 0
    claims_taken: int = 0  # refused: the window was held (the compare-and-set working)
    renewals_lost: int = 0  # refused: the lease had expired (a late renewal)
    drops: int = 0
    #: Requests with no answer (unreachable, timeout) or an answer other than 200 and the expected 409s.
    errors: list[str] = attrs.field(factory=list)
    grants: list[Grant] = attrs.field(factory=list)


def model_bodies(windows: int, operator: Identity, index: int = 0) -> tuple[ModelRecord, ManifestRecord]:
    """Model ``index``: a signed record of ``windows`` one-layer windows and its manifest (nobody fetches it)."""
    sha = random.Random(f"{index}/{windows}").randbytes(32).hex()
    model = ModelRecord.from_wire(
        {
            "sha256": sha,
            "name": f"load-{index}",
            "layers": windows,
            "file_bytes": 1000 + 100 * windows,
            "header_bytes": 1000,
            "sources": ["http://127.0.0.1:9/m.gguf"],
            "layer_bytes": [100] * windows,
            "outside_bytes": 0,
            "stages": [{"layers": [i, i + 1], "sha256": f"{i:064x}", "bytes": 100} for i in range(windows)],
        }
    ).signed(operator)
    manifest = ManifestRecord.from_wire(
        {"origin": "explicit", "windows": [{"layers": [i, i + 1]} for i in range(windows)]}, sha
    )
    return model, manifest


async def publish(url: str, operator: Identity, windows: int, models: int = 1) -> list[str]:
    """Publish ``models`` models of ``windows`` windows each (``operator``: the market's operator); their sha256s."""
    out = []
    async with MarketClient(url, identity=operator) as c:
        for i in range(models):
            model, manifest = model_bodies(windows, operator, i)
            await c.put_model(model)
            await c.put_manifest(manifest)
            out.append(model.sha256)
    return out


class _Node:
    def __init__(
        self, market: MarketClient, cfg: LoadConfig, tally: Tally, slots: trio.CapacityLimiter, seed: int
    ) -> None:
        assert market.identity is not None
        self.market = market
        self.slots = slots
        self.cfg = cfg
        self.tally = tally
        self.rng = random.Random(seed)
        self.node_id = market.identity.node_id
        self.endpoint = f"127.0.0.1:{self.rng.randrange(1024, 65536)}"  # announced, never dialled
        self.deadline = 0.0

    async def _call(self, what: str, samples: list[float], call: Coroutine[Any, Any, T]) -> tuple[T | None, bool]:
        """Run one request and time its answer: (value, refused). A 409 is an answer (refused); no answer, or any
        other error, is tallied in ``errors`` and gives (None, False). The latency runs from when the request gets
        one of the ``connections`` slots; the wait for the slot is tallied apart (``wait_s``)."""
        t0 = time.perf_counter()
        async with self.slots:  # signed once it has a slot (``call`` has not started), so it never goes stale here
            self.tally.wait_s.append(time.perf_counter() - t0)
            if time.monotonic() >= self.deadline:  # the run is over: do not drain the queue
                call.close()
                return None, False
            t0 = time.perf_counter()
            try:
                value = await call
            except MarketError as exc:
                if exc.status == 409:
                    samples.append(time.perf_counter() - t0)
                    return None, True
                self.tally.errors.append(f"{what}: {exc}")
                return None, False
            except InputError as exc:
                self.tally.errors.append(f"{what}: {exc}")
                return None, False
            samples.append(time.perf_counter() - t0)
            return value, False

    async def _nap(self, seconds: float, deadline: float) -> None:
        await trio.sleep(max(0.0, min(seconds, deadline - time.monotonic())))

    async def run(self, deadline: float) -> None:
        self.deadline = deadline
        await trio.sleep(self.rng.uniform(0, self.cfg.ramp_s))
        while time.monotonic() < deadline:
            lease = await self._spare(deadline)
            if lease is not None:
                await self._hold(lease, deadline)

    async def _spare(self, deadline: float) -> Lease | None:
        """Poll the whole map (as an enrolling node does); claim a free window at random. The lease, or None
        (nothing free, refused, no answer)."""
        cfg = self.cfg
        cov, _ = await self._call("coverage", self.tally.map_s, self.market.coverage())
        free = [w for w in cov or () if w.holder is None]
        if not free:
            await self._nap(cfg.spare_poll_s * self.rng.uniform(0.5, 1.5), deadline)
            return None
        w = self.rng.choice(free)
        req = ClaimRequest(w.model, w.start, w.end, self.node_id, cfg.lease_s)
        lease, refused = await self._call("claim", self.tally.claim_s, self.market.claim(req))
        if lease is None:
            self.tally.claims_taken += refused
            await self._nap(self.rng.uniform(0, cfg.poll_s), deadline)
            return None
        self.tally.claims_won += 1
        return lease

    async def _hold(self, lease: Lease, deadline: float) -> None:
        cfg = self.cfg
        grant = Grant(
            lease.model, lease.start, self.node_id, lease.lease_id, lease.expires_at - cfg.lease_s, lease.expires_at
        )
        next_renew = time.monotonic() + cfg.lease_s / 3
        try:
            while time.monotonic() < deadline:
                if time.monotonic() < next_renew:
                    await self._nap(min(cfg.poll_s, next_renew - time.monotonic()), deadline)
                    if time.monotonic() < next_renew:  # a holder follows its neighbours on the map
                        await self._call("coverage", self.tally.poll_s, self.market.coverage(lease.model))
                    continue
                if self.rng.random() < cfg.drop_p:  # a crash: no release; back as a spare after a lease or two
                    self.tally.drops += 1
                    await self._nap(cfg.lease_s * self.rng.uniform(1.0, 2.0), deadline)
                    return
                req = ClaimRequest(lease.model, lease.start, lease.end, self.node_id, cfg.lease_s, state="serving",
                                   endpoint=self.endpoint, lease_id=lease.lease_id)  # fmt: skip
                renewed, refused = await self._call("renew", self.tally.renew_s, self.market.renew(req))
                next_renew = time.monotonic() + cfg.lease_s / 3
                if refused:
                    self.tally.renewals_lost += 1
                    return
                if renewed is None:
                    continue  # no answer: a node retries until its lease runs out
                if renewed.lease_id != lease.lease_id:
                    self.tally.errors.append(f"renew: lease id {lease.lease_id} came back as {renewed.lease_id}")
                grant = attrs.evolve(grant, end=max(grant.end, renewed.expires_at))
        finally:
            self.tally.grants.append(grant)


async def drive(url: str, cfg: LoadConfig) -> Tally:
    """Run ``cfg.nodes`` simulated nodes on the market's models for ``cfg.ramp_s + cfg.duration_s`` seconds."""
    tally = Tally()
    limits = httpx.Limits(max_connections=cfg.connections, max_keepalive_connections=cfg.connections)
    deadline = time.monotonic() + cfg.ramp_s + cfg.duration_s
    slots = trio.CapacityLimiter(cfg.connections)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, pool=300.0)) as http:
        nodes = [
            _Node(MarketClient(url, identity=Identity.generate(), client=http), cfg, tally, slots, cfg.seed * 7919 + i)
            for i in range(cfg.nodes)
        ]
        async with trio.open_nursery() as nursery:
            for n in nodes:
                nursery.start_soon(n.run, deadline)
    return tally


# ---------------------------------------------------------------------------------------------- checks (pure)


def double_holders(grants: Sequence[Grant]) -> list[tuple[Grant, Grant]]:
    """Pairs of leases on one window that overlapped in time (each held from its grant to its last renewal's
    expiry). Empty when the market's compare-and-set held."""
    out = []
    by_window: dict[tuple[str, int], list[Grant]] = {}
    for g in grants:
        by_window.setdefault((g.model, g.window), []).append(g)
    for ws in by_window.values():
        ws.sort(key=lambda g: g.start)
        latest = ws[0]  # the lease whose hold ends last among those granted so far
        for g in ws[1:]:
            if g.start < latest.end - TIME_EPS:
                out.append((latest, g))
            if g.end > latest.end:
                latest = g
    return out


def store_disagreements(db: Path, grants: Sequence[Grant], now: float) -> list[str]:
    """Where the market's database and what the nodes were told differ, once no request is in flight: every live
    lease row is the last lease granted on its window, to the same node, expiring when that node was told; no node
    was told it holds a window past ``now`` that the database gives to another."""
    latest: dict[tuple[str, int], Grant] = {}
    for g in grants:
        key = (g.model, g.window)
        if key not in latest or g.start > latest[key].start:
            latest[key] = g
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute('SELECT model, start, "end", node_id, lease_id, expires_at FROM leases').fetchall()
    finally:
        con.close()
    out = []
    live = {}
    for model, start, end, node, lease_id, expires in rows:
        if end != start + 1:
            out.append(f"a lease row on a window not in the manifest: {model[:12]} [{start}, {end})")
        if expires <= now:
            continue
        live[model, start] = (node, lease_id)
        told = latest.get((model, start))
        if told is None or (told.node, told.lease_id) != (node, lease_id) or abs(told.end - expires) > TIME_EPS:
            out.append(f"{model[:12]} [{start}, {end}): the store has {node}/{lease_id} until {expires}; told: {told}")
    for key, g in latest.items():
        if g.end > now + TIME_EPS and live.get(key) != (g.node, g.lease_id):
            out.append(f"{key}: {g.node} was told it holds it until {g.end}; the store has {live.get(key)}")
    return out


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by the nearest rank; nan for no samples."""
    if not samples:
        return float("nan")
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


# ---------------------------------------------------------------------------------------------- the market process


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_peak_rss(pid: int) -> int:
    """Peak resident set of process ``pid`` in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"/proc/{pid}/status has no VmHWM")


def summary(tally: Tally) -> dict[str, Any]:
    """The figures of one run, for a table or JSON."""
    ms = 1000.0

    def lat(xs: list[float]) -> dict[str, float]:
        return {"n": len(xs), "p50_ms": percentile(xs, 0.5) * ms, "p99_ms": percentile(xs, 0.99) * ms}

    return {
        "claims": lat(tally.claim_s) | {"won": tally.claims_won, "refused": tally.claims_taken},
        "renewals": lat(tally.renew_s) | {"lost": tally.renewals_lost},
        "slot_wait": lat(tally.wait_s),
        "holder_polls": lat(tally.poll_s),
        "spare_polls": lat(tally.map_s),
        "drops": tally.drops,
        "errors": len(tally.errors),
        "first_errors": tally.errors[:5],
        "double_holders": len(double_holders(tally.grants)),
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
