"""Attackers on an open market ring, and the pure parts of bench/market_attack.py (tests/test_market_attack.py).

Each attacker is a pluggable piece with ``start()`` (returns once the attack is under way) and ``stop()`` (ends it,
cleans up, returns what it attempted and achieved). They do each attack the way the outside review did it
(``../shared/reviews/security-2.md``), through the market's real HTTP API and real sockets, so the bench reports
whether the code it runs refuses them:

- :class:`Squatters` (N6): one free key per window claims it before any honest node, says it serves at a dead
  endpoint, renews, and claims again whatever comes free (with a fresh key when a claim is refused);
- :class:`SybilPair` (N7): two free keys hold two windows of a model nobody serves, one reports invented requests
  that pay the other, both ask for credit, and one reports a million tokens of demand;
- :class:`StartRewriter` (N8): switches on a ring member that rewrites START (``tests/harness/evil_start.py``);
- :class:`SlotHolders` (N4): silent connections from four /24s to a node's ring port, reconnecting whenever closed,
  then the node's predecessor link is cut (``ss -K``) so that the predecessor has to get back in past them.

Attackers bind their own loopback addresses (127.0.x.1), so per-address limits a market or node applies meet them,
not the honest nodes on 127.0.0.1.
"""

from __future__ import annotations

import random
import secrets
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import attrs
import httpx
import trio

from kvasir.control.client import ControlClient
from kvasir.core.clientauth import MAX_AUTH_TOKENS, MAX_PRICE, sign_auth
from kvasir.core.errors import InputError, KvasirError, MarketError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.sampling import SamplingParams
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import (
    MAX_LEASE_S,
    MAX_LEASE_TOKENS,
    MAX_RECEIPTS,
    MAX_REPORT_TOKENS,
    ClaimRequest,
    CreditReport,
    Lease,
    LeaseRef,
    ManifestRecord,
    ModelRecord,
    Receipt,
    ReceiptBatch,
)
from tests.harness.marketload import percentile

PROMPTS = (
    "The ring passes the hidden state on",
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The three primary colours are",
)
#: Seeds of the sampled jobs start here (fixed: a sampled answer is reproducible, so it has a reference).
SAMPLE_SEED = 4242
SAMPLE_TEMPERATURE = 0.8
OUTCOMES = ("identical", "different", "failed")


@attrs.frozen
class Job:
    """One honest request: its prompt and sampling (greedy, or seeded at SAMPLE_TEMPERATURE)."""

    prompt: str
    temperature: float = 0.0
    seed: int | None = None

    def params(self) -> dict[str, Any]:
        """The sampling fields the control socket takes."""
        return {"temperature": 0.0} if self.temperature == 0 else {"temperature": self.temperature, "seed": self.seed}

    def sampling(self) -> SamplingParams:
        return SamplingParams.GREEDY.with_fields(self.params())


def jobs(n: int) -> list[Job]:
    """``n`` jobs: the prompts in turn, greedy and seeded alternately."""
    out = []
    for i in range(n):
        prompt = PROMPTS[(i // 2) % len(PROMPTS)]
        out.append(Job(prompt) if i % 2 == 0 else Job(prompt, SAMPLE_TEMPERATURE, SAMPLE_SEED + i))
    return out


@attrs.frozen
class Answer:
    """What one honest request got, against its fault-free reference."""

    phase: str
    job: int
    outcome: str
    latency_s: float
    #: Why it failed (an error or an end reason), or how it differs.
    detail: str | None = None


def classify(
    tokens: Sequence[int], end: dict[str, Any] | None, error: str | None, want: Sequence[int]
) -> tuple[str, str | None]:
    """An answer's outcome (pure): ``failed`` when the request raised or ended with an error, else ``identical`` or
    ``different`` against the reference tokens."""
    if error is not None:
        return "failed", error
    if end is None:
        return "failed", "no end"
    if end.get("error"):
        return "failed", str(end["error"])[:120]
    if end.get("reason") not in ("max_tokens", "eog", "stop"):
        return "failed", f"reason {end.get('reason')}"
    if list(tokens) == list(want):
        return "identical", None
    return "different", f"{len(tokens)} tokens, reference {len(want)}; first difference at {_first_diff(tokens, want)}"


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def ask(sock: Path, job: Job, max_tokens: int, want: Sequence[int], phase: str, index: int, timeout: float) -> Answer:
    """Send one honest request to the node at ``sock`` and classify its answer."""
    t0 = time.monotonic()
    tokens: list[int] = []
    end: dict[str, Any] | None = None
    error = None
    try:
        with ControlClient(sock, timeout) as c:
            for msg in c.generate(prompt=job.prompt, max_tokens=max_tokens, **job.params()):
                if msg.get("type") == "token" and msg["token"] >= 0:
                    tokens.append(msg["token"])
                elif msg.get("type") == "end":
                    end = msg
    except (KvasirError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:120]
    outcome, detail = classify(tokens, end, error, want)
    return Answer(phase, index, outcome, time.monotonic() - t0, detail)


def phase_row(phase: str, answers: Sequence[Answer], attack: dict[str, Any] | None) -> dict[str, Any]:
    """One row of the table (pure): honest counts and latency over served requests, and the attacker's report."""
    counts = {k: sum(a.outcome == k for a in answers) for k in OUTCOMES}
    served = [a.latency_s for a in answers if a.outcome != "failed"]
    return {
        "phase": phase,
        "requests": len(answers),
        "served": counts["identical"] + counts["different"],
        **counts,
        "p50_s": percentile(served, 0.5) if served else None,
        "p95_s": percentile(served, 0.95) if served else None,
        "details": sorted({a.detail for a in answers if a.detail})[:5],
        "attack": attack,
    }


ROW_KEYS = ("phase", "requests", "served", *OUTCOMES, "p50_s", "p95_s", "details", "attack")
ATTACK_KEYS = ("attacker", "attempted", "achieved", "succeeded")


def check_row(row: dict[str, Any]) -> list[str]:
    """What is wrong with a row's structure (pure; empty when none)."""
    bad = [f"missing {k}" for k in ROW_KEYS if k not in row]
    if not bad and row["served"] + row["failed"] != row["requests"]:
        bad.append("served + failed != requests")
    if not bad and row["served"] != row["identical"] + row["different"]:
        bad.append("served != identical + different")
    attack = row.get("attack")
    if attack is not None:
        bad += [f"attack: missing {k}" for k in ATTACK_KEYS if k not in attack]
    return bad


# ---------------------------------------------------------------------------------------------- attackers


class Attacker:
    """The interface of an attacker: ``start`` returns once it is under way, ``stop`` ends it and reports."""

    name: ClassVar[str] = "attacker"
    #: Started before the honest nodes (it races them for the market), not while the ring is up.
    before_ring: ClassVar[bool] = False

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> dict[str, Any]:
        raise NotImplementedError


class _Background(Attacker):
    """An attacker that runs ``attack()`` under trio in a thread of its own until ``stop``."""

    #: Seconds ``start`` waits for ``ready`` at most.
    START_TIMEOUT_S = 30.0

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.ready.wait(self.START_TIMEOUT_S)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(60)
        report = self.report()
        return {"attacker": self.name, **report, "errors": self.errors[:5]}

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # reported, not raised: a broken attacker must not hide the honest figures
            self.errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            self.ready.set()

    async def _run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.attack)
            await trio.to_thread.run_sync(self._stop.wait, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()
        with trio.CancelScope(shield=True), trio.move_on_after(15):
            await self.cleanup()

    async def attack(self) -> None:
        raise NotImplementedError

    async def cleanup(self) -> None:
        """Runs after the attack was cancelled (shielded)."""

    def report(self) -> dict[str, Any]:
        raise NotImplementedError


#: The lease an attacker falls back to when the market refuses MAX_LEASE_S (``kvasir node``'s default).
SHORT_LEASE_S = 30.0


def _http(source: str) -> httpx.AsyncClient:
    """An HTTP client whose connections come from loopback address ``source``."""
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=source), timeout=10.0)


def _code(exc: Exception) -> str:
    if isinstance(exc, MarketError):
        return f"{exc.status} {exc.code}"
    return type(exc).__name__


def _ref(lease: Lease) -> LeaseRef:
    return LeaseRef(lease.model, lease.start, lease.end, lease.node_id, lease.lease_id)


def _tally(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


class Squatters(_Background):
    """N6: ``keys`` free keys, one per window of ``model``, claim before the honest nodes, say they serve at
    ``dead_endpoint`` and hold on; whatever comes free (a lease released by the market) they claim again, with a
    fresh key whenever a claim was refused other than by a race (a per-key limit; a cost of new keys stops that)."""

    name = "squat"
    before_ring = True
    #: How often a squatter renews (a third of SHORT_LEASE_S: in time whichever lease the market grants).
    RENEW_S = 10.0
    #: Keys used at most: a squatter whose claim is refused (not lost to a race) comes back with a fresh key.
    MAX_KEYS = 64

    def __init__(self, url: str, model: str, keys: int, dead_endpoint: str, *, poll_s: float = 1.0) -> None:
        super().__init__()
        self.url, self.model, self.keys, self.dead_endpoint, self.poll_s = url, model, keys, dead_endpoint, poll_s
        self.ids = [Identity.generate() for _ in range(keys)]
        self.node_ids = {i.node_id for i in self.ids}
        self.lease_s = MAX_LEASE_S
        self.leases: dict[str, Lease] = {}
        self.claims: dict[str, int] = {}
        self.renewals: dict[str, int] = {}
        self.window_s = 0.0
        self.peak = 0
        self.held_at_stop = 0
        self.started = 0.0
        self.lost = 0

    async def attack(self) -> None:
        self.started = time.monotonic()
        async with _http("127.0.9.1") as http:
            clients = [MarketClient(self.url, identity=i, client=http) for i in self.ids]
            last = time.monotonic()
            renewed = 0.0
            while True:
                now = time.monotonic()
                self.window_s += len(self.leases) * (now - last)
                last = now
                try:
                    cov = await clients[0].coverage(self.model)
                except (MarketError, KvasirError) as exc:
                    self.errors.append(f"coverage: {_code(exc)}")
                    await trio.sleep(self.poll_s)
                    continue
                for node, lease in list(self.leases.items()):  # the market gave it to someone else
                    w = next((w for w in cov if (w.start, w.end) == (lease.start, lease.end)), None)
                    if w is None or w.holder != node:
                        del self.leases[node]
                        self.lost += 1
                renew = now - renewed >= self.RENEW_S
                renewed = now if renew else renewed
                free = [w for w in cov if w.holder is None]
                for k, c in enumerate(clients):
                    assert c.identity is not None
                    me = c.identity.node_id
                    if me in self.leases:
                        if renew:
                            await self._renew(c, self.leases[me])
                    elif free:
                        w = free.pop(0)
                        refused = await self._claim(c, ClaimRequest(self.model, w.start, w.end, me, self.lease_s))
                        if refused and len(self.ids) < self.MAX_KEYS:  # limited per key? a fresh key is free
                            fresh = Identity.generate()
                            self.ids.append(fresh)
                            self.node_ids.add(fresh.node_id)
                            clients[k] = MarketClient(self.url, identity=fresh, client=http)
                self.peak = max(self.peak, len(self.leases))
                if len(self.leases) == self.keys or (self.leases and not free):
                    self.ready.set()
                await trio.sleep(self.poll_s)

    async def _claim(self, c: MarketClient, req: ClaimRequest) -> bool:
        """Claim a free window; whether the market refused the claim for anything but a race (409)."""
        try:
            lease = await c.claim(req)
        except (MarketError, KvasirError) as exc:
            _tally(self.claims, _code(exc))
            if isinstance(exc, InputError):  # the lease asked for is too long now: ask for the node's default
                self.lease_s = SHORT_LEASE_S
            return not (isinstance(exc, MarketError) and exc.status == 409)
        _tally(self.claims, "granted")
        self.leases[req.node_id] = lease
        await self._renew(c, lease)  # at once: "serving", at an endpoint that never answers
        return False

    async def _renew(self, c: MarketClient, lease: Lease) -> None:
        assert c.identity is not None
        req = ClaimRequest(self.model, lease.start, lease.end, c.identity.node_id, self.lease_s, state="serving",
                           endpoint=self.dead_endpoint, lease_id=lease.lease_id)  # fmt: skip
        try:
            self.leases[req.node_id] = await c.renew(req)
            _tally(self.renewals, "renewed")
        except (MarketError, KvasirError) as exc:
            _tally(self.renewals, _code(exc))
            if isinstance(exc, InputError):
                self.lease_s = SHORT_LEASE_S
            if isinstance(exc, MarketError) and exc.status in (403, 404, 409):
                self.leases.pop(req.node_id, None)
                self.lost += 1

    async def cleanup(self) -> None:
        self.held_at_stop = len(self.leases)
        async with _http("127.0.9.1") as http:
            for i in self.ids:
                lease = self.leases.pop(i.node_id, None)
                if lease is not None:
                    try:
                        await MarketClient(self.url, identity=i, client=http).release(_ref(lease))
                    except (MarketError, KvasirError) as exc:
                        self.errors.append(f"release: {_code(exc)}")

    def report(self) -> dict[str, Any]:
        held = time.monotonic() - self.started if self.started else 0.0
        return {
            "attempted": f"{self.keys} free keys claim every window, announce a dead endpoint, renew, re-claim"
            f" (a fresh key after a refusal: {len(self.ids)} keys used)",
            "keys_used": len(self.ids),
            "achieved": f"held {self.peak} windows at most, {self.held_at_stop} at the end; {self.window_s:.0f}"
            f" window-seconds in {held:.0f} s; lost {self.lost} leases",
            "claims": self.claims,
            "renewals": self.renewals,
            "peak_windows": self.peak,
            "windows_at_end": self.held_at_stop,
            "window_s": self.window_s,
            # The verdict needs the honest side too: the bench adds "succeeded" (the ring did not form in time).
            "succeeded": self.held_at_stop > 0,
        }


def sybil_model(operator: Identity, windows: int = 3, index: int = 0) -> tuple[ModelRecord, ManifestRecord]:
    """A signed model nobody serves (``windows`` one-layer windows, each larger than any honest node's budget, so
    honest nodes leave it alone): where the sybils mint."""
    sha = random.Random(f"sybil-{index}").randbytes(32).hex()
    layer = 10**12
    model = ModelRecord.from_wire(
        {
            "sha256": sha,
            "name": f"sybil-{index}",
            "layers": windows,
            "file_bytes": 1000 + layer * windows,
            "header_bytes": 1000,
            "sources": ["http://127.0.0.1:9/m.gguf"],
            "layer_bytes": [layer] * windows,
            "outside_bytes": 0,
            "stages": [{"layers": [i, i + 1], "sha256": f"{i:064x}", "bytes": layer} for i in range(windows)],
        }
    ).signed(operator)
    manifest = ManifestRecord.from_wire(
        {"origin": "explicit", "windows": [{"layers": [i, i + 1]} for i in range(windows)]}, sha
    )
    return model, manifest


async def publish_sybil_model(url: str, operator: Identity, windows: int = 3) -> str:
    model, manifest = sybil_model(operator, windows)
    async with MarketClient(url, identity=operator) as c:
        await c.put_model(model)
        await c.put_manifest(manifest)
    return model.sha256


async def _multiplier(c: MarketClient, model: str) -> float:
    """The demand multiplier the market applies to ``model``'s rewards now (reward / weight of its first window)."""
    try:
        w = (await c.coverage(model))[0]
    except (KvasirError, IndexError):  # a market that no longer shows it (or answers otherwise): unknown
        return float("nan")
    return w.reward / w.weight if w.weight else float("nan")


class SybilPair(_Background):
    """N7: keys A and B hold windows 0 and 1 of ``model`` (its last window uncovered, so A's receipts have no exit
    witness); A reports invented requests that name B, B asks for credit for them, and A reports a million tokens of
    demand. Nobody computes anything."""

    name = "sybil"
    INTERVAL_S = 1.0

    def __init__(self, url: str, model: str) -> None:
        super().__init__()
        self.url, self.model = url, model
        self.a, self.b = Identity.generate(), Identity.generate()
        self.client = Identity.generate()  # an unfunded client key of the sybils' own
        self.market_key: PublicKey | None = None
        self.leases: dict[str, Lease] = {}
        self.calls: dict[str, int] = {}
        self.tokens = 0
        self.earned = 0.0
        self.mult_before = float("nan")
        self.mult_after = float("nan")
        self.receipts = 0

    async def attack(self) -> None:
        async with _http("127.0.10.1") as http:
            a = MarketClient(self.url, identity=self.a, client=http)
            b = MarketClient(self.url, identity=self.b, client=http)
            try:
                self.mult_before = await _multiplier(a, self.model)
                for c, rank in ((a, 0), (b, 1)):
                    assert c.identity is not None
                    for lease_s in (MAX_LEASE_S, SHORT_LEASE_S):  # the longest lease, else the node's default
                        try:
                            self.leases[c.identity.node_id] = await c.claim(
                                ClaimRequest(self.model, rank, rank + 1, c.identity.node_id, lease_s)
                            )
                            _tally(self.calls, "claim granted")
                            break
                        except (MarketError, KvasirError) as exc:
                            _tally(self.calls, f"claim {_code(exc)}")
                            if not isinstance(exc, InputError):
                                break
                # The old demand report (the market answers 410 since demand is settled traffic).
                demand = {"model": self.model, "requests": 1000, "tokens": MAX_REPORT_TOKENS}
                await self._call("demand", a._call("POST", "/v1/demand", demand))
                ok, info = await self._call("operator", a._call("GET", "/v1/operator"))
                if ok and isinstance(info, dict):
                    self.market_key = PublicKey.from_text(str(info["market"]))
                self.mult_after = await _multiplier(a, self.model)
            finally:
                self.ready.set()
            while True:
                await self._mint(a, b)
                await trio.sleep(self.INTERVAL_S)

    async def _call(self, what: str, call: Any) -> tuple[bool, Any]:
        """(accepted, reply) of one market call, tallied by outcome."""
        try:
            out = await call
        except (MarketError, KvasirError) as exc:
            _tally(self.calls, f"{what} {_code(exc)}")
            return False, None
        _tally(self.calls, f"{what} ok")
        return True, out

    async def _mint(self, a: MarketClient, b: MarketClient) -> None:
        holders = (self.a.node_id, self.b.node_id, *([""] * 1))
        # Receipts of invented requests, each "paid" by a client key of the sybils' own that no operator funded.
        auth = (
            None
            if self.market_key is None
            else sign_auth(
                self.client,
                self.market_key,
                self.model,
                max_tokens=MAX_AUTH_TOKENS,
                max_price=MAX_PRICE,
                not_after=int(time.time()) + 600,
            )
        )
        receipts = tuple(
            Receipt(secrets.randbits(63), MAX_REPORT_TOKENS, holders, client_auth=auth)
            for _ in range(min(16, MAX_RECEIPTS))
        )
        accepted, _ = await self._call("receipts", a.receipts(ReceiptBatch(self.model, self.a.node_id, receipts)))
        self.receipts += len(receipts) if accepted else 0
        lease = self.leases.get(self.b.node_id)
        if lease is None:
            return
        report = CreditReport(self.model, lease.start, lease.end, self.b.node_id, lease.lease_id, MAX_LEASE_TOKENS)
        _, out = await self._call("credit", b.credit(report))
        if isinstance(out, dict):
            self.tokens = max(self.tokens, int(out.get("tokens", 0)))
            self.earned = max(self.earned, float(out.get("earned", 0.0)))

    async def cleanup(self) -> None:
        async with _http("127.0.10.1") as http:
            for i in (self.a, self.b):
                lease = self.leases.pop(i.node_id, None)
                if lease is not None:
                    try:
                        await MarketClient(self.url, identity=i, client=http).release(_ref(lease))
                    except (MarketError, KvasirError) as exc:
                        self.errors.append(f"release: {_code(exc)}")

    def report(self) -> dict[str, Any]:
        return {
            "attempted": f"2 free keys hold 2 of 3 windows; {self.receipts} invented receipts accepted, credit asked"
            f" every {self.INTERVAL_S:.0f} s; a demand report of {MAX_REPORT_TOKENS} tokens",
            "achieved": f"{self.tokens} tokens credited, {self.earned:.3g} credits earned; reward multiplier"
            f" {self.mult_before:.3g} -> {self.mult_after:.3g}",
            "calls": self.calls,
            "tokens_minted": self.tokens,
            "credits_minted": self.earned,
            "multiplier_before": self.mult_before,
            "multiplier_after": self.mult_after,
            "succeeded": self.tokens > 0 or self.mult_after > self.mult_before,
        }


class StartRewriter(Attacker):
    """N8: switches on the ring member started from tests/harness/evil_start.py (its flag file)."""

    name = "start"

    def __init__(self, flag: Path) -> None:
        self.flag = flag
        self.log = flag.with_name(flag.name + ".log")

    def start(self) -> None:
        self.flag.write_text("on\n")

    def stop(self) -> dict[str, Any]:
        self.flag.unlink(missing_ok=True)
        rewrites = len(self.log.read_text().splitlines()) if self.log.exists() else 0
        self.log.unlink(missing_ok=True)
        return {
            "attacker": self.name,
            "attempted": f"a member rewrote {rewrites} STARTs it forwarded (temperature 1.5, another seed,"
            " 4 x max_tokens)",
            "achieved": "see the honest answers of this phase: different = altered requests served",
            "rewrites": rewrites,
            "succeeded": None,  # the bench decides from the honest answers
            "errors": [],
        }


class SlotHolders(_Background):
    """N4: ``conns`` silent connections to ``port`` from ``groups`` /24 networks of 127/8, each reconnecting the
    moment the node closes it; once they are in place, the node's predecessor link is cut (``ss -K``) and the time
    until the node at ``control`` has a predecessor again is measured."""

    name = "slots"
    HOLD_BEFORE_CUT_S = 1.0

    def __init__(self, port: int, control: Path, *, conns: int = 16, groups: int = 4, cut: bool = True) -> None:
        super().__init__()
        self.port, self.control, self.conns, self.groups, self.cut = port, control, conns, groups, cut
        self.connects = 0
        self.open_now = 0
        self.peak_open = 0
        self.cut_result = "not tried"
        self.relink_s: float | None = None
        #: Set once the relink is measured (or cannot be): ``stop`` waits for it, so a phase whose honest requests
        #: end at once (a tiny model) does not cancel the measurement.
        self.measured = threading.Event()

    async def attack(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                for k in range(self.conns):
                    nursery.start_soon(self._hold, f"127.0.{1 + k % self.groups}.1")
                await trio.sleep(self.HOLD_BEFORE_CUT_S)
                if self.cut:
                    t_cut = time.monotonic()
                    self.cut_result = await trio.to_thread.run_sync(cut_links, self.port)
                    self.ready.set()
                    if self.cut_ok:
                        self.relink_s = await self._relinked(t_cut)
                self.ready.set()
                self.measured.set()
        finally:
            self.measured.set()

    def stop(self) -> dict[str, Any]:
        self.measured.wait(130)
        return super().stop()

    async def _hold(self, source: str) -> None:
        while True:
            sock = trio.socket.socket()
            try:
                await sock.bind((source, 0))
                await sock.connect(("127.0.0.1", self.port))
                self.connects += 1
                self.open_now += 1
                self.peak_open = max(self.peak_open, self.open_now)
                try:
                    while await sock.recv(4096):
                        pass
                finally:
                    self.open_now -= 1
            except OSError:
                await trio.sleep(0.01)
            finally:
                sock.close()

    async def _relinked(self, t_cut: float, limit: float = 120.0) -> float | None:
        """Seconds from the cut until the node has a predecessor link younger than the cut (None: not in
        ``limit``)."""
        while time.monotonic() - t_cut < limit:
            since = time.monotonic() - t_cut
            try:
                status = await trio.to_thread.run_sync(_status, self.control)
            except (KvasirError, OSError):
                status = {}
            pred = status.get("links", {}).get("predecessor") or {}
            if pred.get("kind") is not None and pred.get("up_s") is not None and pred["up_s"] < since:
                return since - float(pred["up_s"])
            await trio.sleep(0.2)
        return None

    @property
    def cut_ok(self) -> bool:
        return self.cut_result.startswith("ss -K")

    def report(self) -> dict[str, Any]:
        relink = "never (in 120 s)" if self.relink_s is None else f"{self.relink_s:.1f} s"
        relink = relink if self.cut_ok else "not measured (no cut)"
        return {
            "attempted": f"{self.conns} silent connections from {self.groups} /24s to port {self.port},"
            f" {self.connects} connects in all; predecessor link cut: {self.cut_result}",
            "achieved": f"predecessor back after {relink}; {self.peak_open} attacker connections open at most",
            "connects": self.connects,
            "cut": self.cut_result,
            "relink_s": self.relink_s,
            # Kept out: no relink within RELINK_OK_S of the cut. The bench adds the honest side (failed requests).
            "succeeded": self.cut_ok and (self.relink_s is None or self.relink_s > RELINK_OK_S),
        }


#: A predecessor that gets back in within this many seconds of a cut was not kept out.
RELINK_OK_S = 10.0


def _status(sock: Path) -> dict[str, Any]:
    with ControlClient(sock, 5) as c:
        return c.status()


def cut_links(port: int) -> str:
    """Kill every established TCP connection to or from ``port`` (``ss -K``: root and a kernel with sock_destroy):
    the drop of a link (a restart, a network change). What happened, in words."""
    flt = f"( dport = :{port} or sport = :{port} )"
    try:
        r = subprocess.run(["ss", "-K", "state", "established", flt], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    killed = max(0, len([ln for ln in r.stdout.splitlines() if ln.strip()]) - 1)
    if r.returncode == 0 and killed:
        return f"ss -K closed {killed} sockets"
    return f"failed: rc {r.returncode} {r.stderr[-80:]}"
