"""The market's state in SQLite (WAL): models, rank manifests, leases, demand and the contribution ledger.

The SQLite engine behind :class:`kvasir.market.server.backend.MarketBackend` (the contracts are there). Every
method is synchronous and runs one transaction (``BEGIN IMMEDIATE`` for writes, so a claim's read and write
are one atomic compare-and-set: two nodes never hold one window). The service calls them from worker threads
through a limiter of one, so the single connection is never used concurrently. Time comes from ``clock`` (unix
seconds) so tests can move it.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from kvasir.errors import InputError, MarketError
from kvasir.market.records import (
    MAX_LEASE_TOKENS,
    MAX_REWARD,
    ClaimRequest,
    CoverageEntry,
    CreditReport,
    DemandReport,
    FraudRecord,
    Lease,
    LeaseRef,
    ManifestRecord,
    ModelRecord,
    ReceiptBatch,
)

#: Demand older than this no longer raises rewards.
DEMAND_HORIZON_S = 600.0
#: Recent tokens that double a model's rewards.
DEMAND_SCALE_TOKENS = 1000.0
#: Demand is summed per bucket of this many seconds: one row per model and bucket, whoever reports.
DEMAND_BUCKET_S = 60
#: Tokens one bucket counts at most (a sum that never nears 2^63, whatever the reports).
BUCKET_MAX_TOKENS = 10**9
BUCKET_MAX_REQUESTS = 10**7
#: The most demand can raise rewards.
MAX_MULTIPLIER = 1000.0
#: Tokens per second one window can be credited for at most, and the seconds of slack a fresh lease starts with.
MAX_TOKENS_PER_S = 2000.0
CREDIT_SLACK_S = 10.0
#: Receipts are remembered (so a repeated one counts once) this long, and at most this many at once.
RECEIPT_HORIZON_S = 3600.0
MAX_RECEIPTS_SEEN = 1_000_000
#: Receipts one witness may have waiting for their partner (what a node keeps while the market is away).
MAX_PENDING_PER_WITNESS = 4096
#: Models a market offers at most; ledger rows in one reply at most.
MAX_MODELS = 256
#: Windows one coverage reply lists at most (a manifest has at most 4096).
MAX_COVERAGE_WINDOWS = 16384
MAX_LEDGER_ROWS = 1000
#: Witnesses a ledger row names at most (those that confirmed the most of the node's tokens).
LEDGER_WITNESSES = 8
#: How long a node proven to cheat on a model may not claim its windows again.
FRAUD_BAN_S = 24 * 3600.0
#: Withdrawals (one per proof) and bans the market keeps at most: the oldest go first.
MAX_FRAUD_ROWS = 100_000
MAX_BANS = 100_000
#: Withdrawals one ``GET /v1/fraud`` lists at most (the latest).
MAX_FRAUD_LISTED = 1000

_LEASE_ROW = 'SELECT node_id, lease_id, expires_at, holder_key FROM leases WHERE model = ? AND start = ? AND "end" = ?'

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (sha256 TEXT PRIMARY KEY, body TEXT NOT NULL, added REAL NOT NULL);
CREATE TABLE IF NOT EXISTS manifests (model TEXT PRIMARY KEY, body TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    model TEXT NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL,
    node_id TEXT NOT NULL, lease_id TEXT NOT NULL, expires_at REAL NOT NULL,
    endpoint TEXT, state TEXT NOT NULL, claimed_at REAL NOT NULL, holder_key TEXT,
    PRIMARY KEY (model, start, "end"));
CREATE TABLE IF NOT EXISTS demand_buckets (
    model TEXT NOT NULL, bucket INTEGER NOT NULL, requests INTEGER NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (model, bucket));
CREATE TABLE IF NOT EXISTS lease_credits (
    lease_id TEXT PRIMARY KEY, node_id TEXT NOT NULL, model TEXT NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, tokens INTEGER NOT NULL, layer_tokens INTEGER NOT NULL, earned REAL NOT NULL,
    ts REAL NOT NULL);
CREATE INDEX IF NOT EXISTS lease_credits_node ON lease_credits (node_id);
DROP TABLE IF EXISTS receipts_seen;
CREATE TABLE IF NOT EXISTS receipts (
    model TEXT NOT NULL, entry TEXT NOT NULL, request TEXT NOT NULL, role TEXT NOT NULL, witness TEXT NOT NULL,
    tokens INTEGER NOT NULL, holders TEXT NOT NULL, settled INTEGER NOT NULL, ts REAL NOT NULL,
    PRIMARY KEY (model, entry, request, role));
CREATE INDEX IF NOT EXISTS receipts_ts ON receipts (ts);
CREATE INDEX IF NOT EXISTS receipts_pending ON receipts (witness, settled, ts);
CREATE TABLE IF NOT EXISTS lease_confirmed (lease_id TEXT PRIMARY KEY, tokens INTEGER NOT NULL, ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS lease_witnesses (
    lease_id TEXT NOT NULL, witness TEXT NOT NULL, tokens INTEGER NOT NULL, PRIMARY KEY (lease_id, witness));
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS frauds (
    proof_id TEXT PRIMARY KEY, node_id TEXT NOT NULL, model TEXT NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, request TEXT NOT NULL, step INTEGER NOT NULL, submitter TEXT NOT NULL,
    verdict TEXT NOT NULL, withdrawn REAL NOT NULL, leases TEXT NOT NULL, lease_revoked INTEGER NOT NULL,
    banned_until REAL NOT NULL, ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS bans (
    model TEXT NOT NULL, node_id TEXT NOT NULL, until REAL NOT NULL, proof_id TEXT NOT NULL,
    PRIMARY KEY (model, node_id));
"""


def demand_multiplier(recent_tokens: int) -> float:
    """How much recent demand raises a model's rewards (pure): 1 at no demand, +1 per DEMAND_SCALE_TOKENS, at most
    MAX_MULTIPLIER."""
    return min(1.0 + recent_tokens / DEMAND_SCALE_TOKENS, MAX_MULTIPLIER)


def exit_witness(entry: str, holders: list[str | None]) -> str | None:
    """The second witness of a request that entered at node ``entry``, given the live holder of each rank (pure):
    the last rank, which samples every token; or, when the entry holds the last rank, rank 0, which embeds every
    token. None when there is none other than the entry (a one-window ring, an uncovered rank)."""
    if not holders:
        return None
    witness = holders[-1] if holders[-1] != entry else holders[0]
    return witness if witness != entry else None


def confirmed_tokens(holder: str, rank: int, witnessed: list[tuple[str, int, list[str]]]) -> int:
    """What one request's receipts confirm for the window at ``rank`` held by ``holder`` (pure). ``witnessed``:
    (witness, tokens, holders named) per receipt. Every receipt must name the holder (receipts that disagree about
    who held it confirm nothing) and at least one must come from a witness other than the holder (nobody confirms
    their own window); then the smallest token count is confirmed."""
    if not witnessed or all(w == holder for w, _, _ in witnessed):
        return 0
    if any(rank >= len(named) or named[rank] != holder for _, _, named in witnessed):
        return 0
    return min(t for _, t, _ in witnessed)


def reward_of(weight: float, multiplier: float) -> float:
    return min(weight * multiplier, MAX_REWARD)


class MarketStore:
    #: One connection: the service never runs two calls at once.
    concurrency = 1

    def __init__(
        self, path: Path | str, *, clock: Callable[[], float] = time.time, max_tokens_per_s: float = MAX_TOKENS_PER_S
    ) -> None:
        self.clock = clock
        self.max_tokens_per_s = max_tokens_per_s
        self._models: dict[str, ModelRecord] = {}  # parsed once: a published record never changes
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
            columns = {r[1] for r in self.db.execute("PRAGMA table_info(leases)")}
            if "holder_key" not in columns:  # a database from before signed claims
                self.db.execute("ALTER TABLE leases ADD COLUMN holder_key TEXT")
            self._resume()
        except sqlite3.Error as exc:
            raise InputError(f"{path}: cannot open the market database ({exc})") from None

    def _resume(self) -> None:
        """After a downtime, give every lease that was live when the market stopped the time it had left.

        Holders could not renew while the market was away; without this, a spare that polls first after a restart
        would take a healthy holder's window and cut its streams.
        """
        row = self.db.execute("SELECT value FROM meta WHERE key = 'alive_at'").fetchone()
        now = self.clock()
        if row is not None and now > float(row[0]):
            alive_at = float(row[0])
            with self._write() as db:
                db.execute(
                    "UPDATE leases SET expires_at = expires_at + ? WHERE expires_at > ?", (now - alive_at, alive_at)
                )

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
            # When the market was last alive (every write): a restart extends leases by the time it was away.
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('alive_at', ?)", (str(self.clock()),))
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # ------------------------------------------------------------------------------------------ models

    def put_model(self, model: ModelRecord) -> bool:
        """Store a model record; True if it is new. A published record is immutable: the same record again is a
        no-op, different content under the same sha256 is refused (409)."""
        with self._write() as db:
            row = db.execute("SELECT body FROM models WHERE sha256 = ?", (model.sha256,)).fetchone()
            if row is not None:
                if not ModelRecord.from_wire(json.loads(row[0])).same_content(model):
                    raise MarketError(409, "model_immutable", f"model {model.sha256[:12]}… is published already")
                return False
            (count,) = db.execute("SELECT COUNT(*) FROM models").fetchone()
            if count >= MAX_MODELS:
                raise MarketError(409, "too_many_models", f"this market offers {MAX_MODELS} models at most")
            db.execute(
                "INSERT INTO models (sha256, body, added) VALUES (?, ?, ?)",
                (model.sha256, json.dumps(model.to_wire()), self.clock()),
            )
        return True

    def models(self) -> list[ModelRecord]:
        rows = self.db.execute("SELECT sha256 FROM models ORDER BY added LIMIT ?", (MAX_MODELS,)).fetchall()
        return [self.model(r[0]) for r in rows]

    def model(self, sha256: str) -> ModelRecord:
        cached = self._models.get(sha256)
        if cached is not None:
            return cached
        row = self.db.execute("SELECT body FROM models WHERE sha256 = ?", (sha256,)).fetchone()
        if row is None:
            raise MarketError(404, "unknown_model", f"no model {sha256[:12]}… on this market")
        record = self._models[sha256] = ModelRecord.from_wire(json.loads(row[0]))
        return record

    # ------------------------------------------------------------------------------------------ manifests

    def put_manifest(self, manifest: ManifestRecord) -> None:
        """Set a model's rank manifest; leases on windows it no longer has are dropped."""
        model = self.model(manifest.model)
        expect = 0
        for w in manifest.windows:
            if w.start != expect:
                raise InputError(f"manifest: window [{w.start}, {w.end}) does not continue from layer {expect}")
            if model.stage(w.start, w.end) is None:
                raise InputError(f"manifest: the model lists no stage hash for window [{w.start}, {w.end})")
            expect = w.end
        if expect != model.n_layers:
            raise InputError(f"manifest: windows end at layer {expect}, the model has {model.n_layers}")
        keep = {(w.start, w.end) for w in manifest.windows}
        with self._write() as db:
            db.execute(
                "INSERT INTO manifests (model, body, updated) VALUES (?, ?, ?)"
                " ON CONFLICT (model) DO UPDATE SET body = excluded.body, updated = excluded.updated",
                (manifest.model, json.dumps(manifest.to_wire()), self.clock()),
            )
            held = db.execute('SELECT start, "end" FROM leases WHERE model = ?', (manifest.model,)).fetchall()
            for start, end in held:
                if (start, end) not in keep:
                    db.execute(
                        'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ?', (manifest.model, start, end)
                    )

    def manifest(self, model: str) -> ManifestRecord:
        row = self.db.execute("SELECT body FROM manifests WHERE model = ?", (model,)).fetchone()
        if row is None:
            raise MarketError(404, "no_manifest", f"model {model[:12]}… has no rank manifest yet")
        return ManifestRecord.from_wire(json.loads(row[0]), model)

    # ------------------------------------------------------------------------------------------ coverage

    def coverage(self, model: str | None = None) -> dict[str, Any]:
        """The coverage map (``GET /v1/coverage``): every manifest window, its reward and its live holder.

        At most MAX_COVERAGE_WINDOWS windows in one reply (whole models, oldest first; ``truncated`` says when
        some were left out, and ``?model=`` asks for one)."""
        now = self.clock()
        out = []
        shown, truncated = 0, False
        models = [self.model(model)] if model is not None else self.models()
        for m in models:
            try:
                manifest = self.manifest(m.sha256)
            except MarketError:
                continue
            if shown + len(manifest.windows) > MAX_COVERAGE_WINDOWS:
                truncated = True
                continue
            shown += len(manifest.windows)
            mult = demand_multiplier(self._recent_tokens(m.sha256, now))
            leases = {
                (r[0], r[1]): r
                for r in self.db.execute(
                    'SELECT start, "end", node_id, expires_at, state, endpoint, holder_key FROM leases'
                    " WHERE model = ? AND expires_at > ?",
                    (m.sha256, now),
                )
            }
            windows = []
            for rank, w in enumerate(manifest.windows):
                stage = m.stage(w.start, w.end)
                assert stage is not None
                lease = leases.get((w.start, w.end))
                windows.append(
                    CoverageEntry(
                        model=m.sha256,
                        rank=rank,
                        start=w.start,
                        end=w.end,
                        weight=w.weight,
                        reward=reward_of(w.weight, mult),
                        bytes=stage.bytes,
                        sha256=stage.sha256,
                        holder=lease[2] if lease else None,
                        lease_expires=lease[3] if lease else None,
                        state=lease[4] if lease else None,
                        endpoint=lease[5] if lease else None,
                        holder_key=lease[6] if lease else None,
                    )
                )
            out.append(
                {
                    "model": m.sha256,
                    "name": m.name,
                    "covered": sum(w.covered for w in windows),
                    "windows_total": len(windows),
                    "live": all(w.serving for w in windows),
                    "windows": [w.to_wire() for w in windows],
                }
            )
        return {"now": now, "models": out, "truncated": truncated}

    def window_of(self, model: str, start: int, end: int) -> tuple[ManifestRecord, int]:
        """The model's manifest and the rank of window [start, end) in it (404 if there is none)."""
        return self._window(model, start, end)

    def _window(self, model: str, start: int, end: int) -> tuple[ManifestRecord, int]:
        self.model(model)
        manifest = self.manifest(model)
        for rank, w in enumerate(manifest.windows):
            if (w.start, w.end) == (start, end):
                return manifest, rank
        raise MarketError(404, "unknown_window", f"model {model[:12]}… has no window [{start}, {end})")

    # ------------------------------------------------------------------------------------------ claims

    def claim(self, req: ClaimRequest, holder_key: str | None = None) -> Lease:
        """Compare-and-set: grant the window if it has no live lease, or renew the caller's own (``node_id`` is the
        fingerprint of the key that signed the request, so nobody gets or changes another holder's lease)."""
        self._window(req.model, req.start, req.end)
        now = self.clock()
        expires = now + req.lease_s
        with self._write() as db:
            self._check_ban(db, req.model, req.node_id, now)
            row = db.execute(
                _LEASE_ROW,
                (req.model, req.start, req.end),
            ).fetchone()
            if row is not None and row[2] > now:
                if row[0] != req.node_id or (holder_key is not None and row[3] not in (None, holder_key)):
                    raise MarketError(409, "window_taken", f"window [{req.start}, {req.end}) is held by node {row[0]}")
                lease_id = row[1]
                db.execute(
                    "UPDATE leases SET expires_at = ?, endpoint = ?, state = ?"
                    ' WHERE model = ? AND start = ? AND "end" = ?',
                    (expires, req.endpoint, req.state, req.model, req.start, req.end),
                )
            else:
                lease_id = secrets.token_hex(12)
                db.execute(
                    'INSERT OR REPLACE INTO leases (model, start, "end", node_id, lease_id, expires_at, endpoint,'
                    " state, claimed_at, holder_key) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (req.model, req.start, req.end, req.node_id, lease_id, expires, req.endpoint, req.state, now,
                     holder_key),
                )  # fmt: skip
        return Lease(req.model, req.start, req.end, req.node_id, lease_id, expires)

    @staticmethod
    def _check_ban(db: sqlite3.Connection, model: str, node_id: str, now: float) -> None:
        row = db.execute(
            "SELECT until, proof_id FROM bans WHERE model = ? AND node_id = ?", (model, node_id)
        ).fetchone()
        if row is not None and row[0] > now:
            raise MarketError(
                403, "banned", f"node {node_id} was proven to cheat on this model (proof {row[1][:16]}…); "
                f"it may claim again in {row[0] - now:.0f} s",
            )  # fmt: skip

    def _check_lease(
        self, db: sqlite3.Connection, ref: LeaseRef | ClaimRequest | CreditReport, now: float, key: str | None
    ) -> None:
        """The caller holds this lease: its node id and lease id match (and its full key, where both are known)."""
        row = db.execute(
            _LEASE_ROW,
            (ref.model, ref.start, ref.end),
        ).fetchone()
        if row is not None and key is not None and row[3] is not None and row[3] != key:
            row = (None, None, row[2], row[3])  # a key that merely shares the holder's fingerprint holds nothing
        window = f"[{ref.start}, {ref.end})"
        if row is None or (row[2] <= now and (row[0], row[1]) == (ref.node_id, ref.lease_id)):
            raise MarketError(409, "lease_expired", f"the lease on window {window} has expired; claim it again")
        if (row[0], row[1]) != (ref.node_id, ref.lease_id):
            if row[2] <= now:
                raise MarketError(409, "lease_expired", f"the lease on window {window} has expired; claim it again")
            raise MarketError(409, "foreign_lease", f"window {window} is held by another lease")

    def renew(self, req: ClaimRequest, holder_key: str | None = None) -> Lease:
        self._window(req.model, req.start, req.end)
        assert req.lease_id is not None
        now = self.clock()
        expires = now + req.lease_s
        with self._write() as db:
            self._check_lease(db, req, now, holder_key)
            db.execute(
                'UPDATE leases SET expires_at = ?, endpoint = ?, state = ? WHERE model = ? AND start = ? AND "end" = ?',
                (expires, req.endpoint, req.state, req.model, req.start, req.end),
            )
        return Lease(req.model, req.start, req.end, req.node_id, req.lease_id, expires)

    def release(self, ref: LeaseRef, holder_key: str | None = None) -> None:
        self._window(ref.model, ref.start, ref.end)
        with self._write() as db:
            self._check_lease(db, ref, self.clock(), holder_key)
            db.execute(
                'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ?', (ref.model, ref.start, ref.end)
            )

    # ------------------------------------------------------------------------------------------ demand, ledger

    def _recent_tokens(self, model: str, now: float) -> int:
        row = self.db.execute(
            "SELECT COALESCE(SUM(tokens), 0) FROM demand_buckets WHERE model = ? AND bucket >= ?",
            (model, _bucket(now - DEMAND_HORIZON_S)),
        ).fetchone()
        return int(row[0])

    def holds_lease(self, node_id: str, model: str) -> bool:
        row = self.db.execute(
            "SELECT 1 FROM leases WHERE model = ? AND node_id = ? AND expires_at > ?", (model, node_id, self.clock())
        ).fetchone()
        return row is not None

    def add_demand(self, report: DemandReport, node_id: str) -> None:
        """Add a lease holder's report to the current bucket (sums clamped); drop buckets past the horizon."""
        self.model(report.model)
        now = self.clock()
        if not self.holds_lease(node_id, report.model):
            raise MarketError(403, "not_a_holder", f"node {node_id} holds no window of model {report.model[:12]}…")
        with self._write() as db:
            db.execute(
                "INSERT INTO demand_buckets (model, bucket, requests, tokens) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (model, bucket) DO UPDATE SET requests = MIN(requests + excluded.requests, ?),"
                " tokens = MIN(tokens + excluded.tokens, ?)",
                (report.model, _bucket(now), report.requests, report.tokens, BUCKET_MAX_REQUESTS, BUCKET_MAX_TOKENS),
            )
            db.execute("DELETE FROM demand_buckets WHERE bucket < ?", (_bucket(now - DEMAND_HORIZON_S),))

    def demand(self) -> dict[str, Any]:
        """Recent demand per model, with each window's reward (window lists stop at MAX_COVERAGE_WINDOWS in all)."""
        now = self.clock()
        out = []
        shown = 0
        for m in self.models():
            row = self.db.execute(
                "SELECT COALESCE(SUM(requests), 0), COALESCE(SUM(tokens), 0) FROM demand_buckets"
                " WHERE model = ? AND bucket >= ?",
                (m.sha256, _bucket(now - DEMAND_HORIZON_S)),
            ).fetchone()
            mult = demand_multiplier(int(row[1]))
            rewards = []
            with suppress(MarketError):  # a model without a manifest yet
                windows = self.manifest(m.sha256).windows
                if shown + len(windows) <= MAX_COVERAGE_WINDOWS:
                    shown += len(windows)
                    rewards = [{"layers": [w.start, w.end], "reward": reward_of(w.weight, mult)} for w in windows]
            out.append(
                {
                    "model": m.sha256,
                    "name": m.name,
                    "requests": int(row[0]),
                    "tokens": int(row[1]),
                    "multiplier": mult,
                    "windows": rewards,
                }
            )
        return {"horizon_s": DEMAND_HORIZON_S, "models": out}

    def add_receipts(self, batch: ReceiptBatch) -> dict[str, Any]:
        """A witness's receipts (docs/market.md § Credit). An entry receipt (``entry`` None) is the signer's own; an
        exit receipt names the entry node and counts only from that request's exit witness (the live holder of the
        last window, or of window 0 when the entry holds the last one). Each (entry, request) is settled once: when
        both receipts are in, or at once when the request has no exit witness. Replies with how many were new."""
        manifest = self.manifest(batch.model)
        now = self.clock()
        if not self.holds_lease(batch.node_id, batch.model):
            raise MarketError(403, "not_a_holder", f"node {batch.node_id} holds no window of {batch.model[:12]}…")
        new = 0
        with self._write() as db:
            db.execute("DELETE FROM receipts WHERE ts < ?", (now - RECEIPT_HORIZON_S,))
            (seen,) = db.execute("SELECT COUNT(*) FROM receipts").fetchone()
            if seen + len(batch.receipts) > MAX_RECEIPTS_SEEN:
                raise MarketError(503, "busy", "too many receipts in the last hour; retry later")
            live = {
                (r[0], r[1]): (str(r[2]), str(r[3]))
                for r in db.execute(
                    'SELECT start, "end", node_id, lease_id FROM leases WHERE model = ? AND expires_at > ?',
                    (batch.model, now),
                )
            }
            holders: list[tuple[str, str] | None] = [live.get((w.start, w.end)) for w in manifest.windows]
            for receipt in batch.receipts:
                if len(receipt.holders) != len(holders):
                    continue  # not this manifest's ring
                entry = receipt.entry if receipt.entry is not None else batch.node_id
                exit_ = exit_witness(entry, [h[0] if h else None for h in holders])
                if receipt.entry is not None and (receipt.entry == batch.node_id or exit_ != batch.node_id):
                    continue  # not this request's exit witness: it confirms nothing
                role = "entry" if receipt.entry is None else "exit"
                key = (batch.model, entry, str(receipt.request))
                fresh = db.execute(
                    "INSERT OR IGNORE INTO receipts (model, entry, request, role, witness, tokens, holders, settled,"
                    " ts) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?)",
                    (*key, role, batch.node_id, receipt.tokens, json.dumps(receipt.holders), now),
                ).rowcount
                if not fresh:
                    continue
                new += 1
                rows = db.execute(
                    "SELECT witness, tokens, holders, settled FROM receipts WHERE model = ? AND entry = ?"
                    " AND request = ?",
                    key,
                ).fetchall()
                settled = any(r[3] for r in rows)  # a late partner of a request settled alone confirms nothing
                if not settled and (len(rows) == 2 or (role == "entry" and exit_ is None)):
                    witnessed = [(str(r[0]), int(r[1]), list(json.loads(r[2]))) for r in rows]
                    self._settle(db, witnessed, holders, now)
                    settled = True
                if settled:  # the holders are not needed again, only the request's id (counted once)
                    db.execute(
                        "UPDATE receipts SET settled = 1, holders = '' WHERE model = ? AND entry = ? AND request = ?",
                        key,
                    )
            # A witness's unsettled receipts (awaiting their partner; invented ones never get one) are capped: the
            # oldest go first.
            db.execute(
                "DELETE FROM receipts WHERE rowid IN (SELECT rowid FROM receipts WHERE witness = ? AND settled = 0"
                " ORDER BY ts DESC, rowid DESC LIMIT -1 OFFSET ?)",
                (batch.node_id, MAX_PENDING_PER_WITNESS),
            )
        return {"accepted": new}

    @staticmethod
    def _settle(
        db: sqlite3.Connection,
        witnessed: list[tuple[str, int, list[str]]],
        holders: list[tuple[str, str] | None],
        now: float,
    ) -> None:
        """Confirm one request's tokens (:func:`confirmed_tokens`) into each live lease it pays, noting who confirmed
        them."""
        for rank, holder in enumerate(holders):
            if holder is None:
                continue
            tokens = confirmed_tokens(holder[0], rank, witnessed)
            if not tokens:
                continue
            db.execute(
                "INSERT INTO lease_confirmed (lease_id, tokens, ts) VALUES (?, MIN(?, ?), ?)"
                " ON CONFLICT (lease_id) DO UPDATE SET tokens = MIN(tokens + excluded.tokens, ?), ts = ?",
                (holder[1], tokens, MAX_LEASE_TOKENS, now, MAX_LEASE_TOKENS, now),
            )
            for witness, _, _ in witnessed:
                if witness != holder[0]:
                    db.execute(
                        "INSERT INTO lease_witnesses (lease_id, witness, tokens) VALUES (?, ?, MIN(?, ?))"
                        " ON CONFLICT (lease_id, witness) DO UPDATE SET tokens = MIN(tokens + excluded.tokens, ?)",
                        (holder[1], witness, tokens, MAX_LEASE_TOKENS, MAX_LEASE_TOKENS),
                    )

    def credit(self, report: CreditReport, holder_key: str | None = None) -> dict[str, Any]:
        """Credit a lease holder: ``report.tokens`` is its cumulative count under this lease, so a repeated report
        adds nothing. The count is cut to what witnesses' receipts confirmed for this lease and to what one
        window could serve since the claim (MAX_TOKENS_PER_S); each new token earns layers (layer_tokens) and the
        window's reward now (earned). Replies with the lease's totals."""
        manifest, rank = self._window(report.model, report.start, report.end)
        now = self.clock()
        reward = reward_of(manifest.windows[rank].weight, demand_multiplier(self._recent_tokens(report.model, now)))
        layers = report.end - report.start
        with self._write() as db:
            self._check_lease(db, report, now, holder_key)
            (claimed_at,) = db.execute(
                'SELECT claimed_at FROM leases WHERE model = ? AND start = ? AND "end" = ?',
                (report.model, report.start, report.end),
            ).fetchone()
            cap = int((max(0.0, now - claimed_at) + CREDIT_SLACK_S) * self.max_tokens_per_s)
            confirmed = db.execute(
                "SELECT tokens FROM lease_confirmed WHERE lease_id = ?", (report.lease_id,)
            ).fetchone()
            cap = min(cap, confirmed[0] if confirmed is not None else 0)
            prior = db.execute(
                "SELECT tokens, layer_tokens, earned FROM lease_credits WHERE lease_id = ?", (report.lease_id,)
            ).fetchone()
            tokens, layer_tokens, earned = prior if prior is not None else (0, 0, 0.0)
            new = max(0, min(report.tokens, cap) - tokens)
            tokens, layer_tokens, earned = tokens + new, layer_tokens + new * layers, earned + new * reward
            db.execute(
                'INSERT INTO lease_credits (lease_id, node_id, model, start, "end", tokens, layer_tokens, earned, ts)'
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (lease_id) DO UPDATE SET tokens = excluded.tokens,"
                " layer_tokens = excluded.layer_tokens, earned = excluded.earned, ts = excluded.ts",
                (report.lease_id, report.node_id, report.model, report.start, report.end, tokens, layer_tokens,
                 earned, now),
            )  # fmt: skip
        return {"node_id": report.node_id, "tokens": tokens, "layer_tokens": layer_tokens, "earned": earned}

    def ledger(self) -> dict[str, Any]:
        rows = self.db.execute(
            "SELECT node_id, SUM(tokens), SUM(layer_tokens), SUM(earned), MAX(ts) FROM lease_credits"
            " GROUP BY node_id ORDER BY SUM(earned) DESC, node_id LIMIT ?",
            (MAX_LEDGER_ROWS,),
        ).fetchall()
        by: dict[str, dict[str, int]] = {}
        for node, witness, tokens in self.db.execute(
            "SELECT c.node_id, w.witness, SUM(w.tokens) FROM lease_witnesses w JOIN lease_credits c"
            " ON c.lease_id = w.lease_id GROUP BY c.node_id, w.witness ORDER BY SUM(w.tokens) DESC LIMIT ?",
            (MAX_LEDGER_ROWS * LEDGER_WITNESSES,),
        ):
            top = by.setdefault(node, {})
            if len(top) < LEDGER_WITNESSES:
                top[witness] = int(tokens)
        return {
            "nodes": [
                {"node_id": r[0], "tokens": int(r[1]), "layer_tokens": int(r[2]), "earned": float(r[3]), "last": r[4],
                 "confirmed_by": by.get(r[0], {})}
                for r in rows
            ]
        }  # fmt: skip

    # ------------------------------------------------------------------------------------------ fraud

    def withdraw(self, fraud: FraudRecord) -> dict[str, Any]:
        """Act on a fraud proof that holds: zero the suspect's credit on that window of the model (every lease of
        it there), revoke its live lease on the window, refuse its claims on the model for FRAUD_BAN_S, and write
        the proof's id down with what was withdrawn. The same proof again changes nothing and replies the same."""
        self._window(fraud.model, fraud.start, fraud.end)
        now = self.clock()
        with self._write() as db:
            row = db.execute("SELECT * FROM frauds WHERE proof_id = ?", (fraud.proof_id,)).fetchone()
            if row is not None:
                return _fraud_row(row, duplicate=True)
            window = (fraud.node_id, fraud.model, fraud.start, fraud.end)
            leases = [
                str(r[0])
                for r in db.execute(
                    'SELECT lease_id FROM lease_credits WHERE node_id = ? AND model = ? AND start = ? AND "end" = ?',
                    window,
                )
            ]
            (withdrawn,) = db.execute(
                "SELECT COALESCE(SUM(earned), 0) FROM lease_credits WHERE node_id = ? AND model = ? AND start = ?"
                ' AND "end" = ?',
                window,
            ).fetchone()
            db.execute(
                "UPDATE lease_credits SET tokens = 0, layer_tokens = 0, earned = 0, ts = ?"
                ' WHERE node_id = ? AND model = ? AND start = ? AND "end" = ?',
                (now, *window),
            )
            live = db.execute(
                'SELECT lease_id FROM leases WHERE model = ? AND start = ? AND "end" = ? AND node_id = ?',
                (fraud.model, fraud.start, fraud.end, fraud.node_id),
            ).fetchone()
            if live is not None:
                leases.append(str(live[0]))
                db.execute(
                    'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ? AND node_id = ?',
                    (fraud.model, fraud.start, fraud.end, fraud.node_id),
                )
            for lease in set(leases):  # nothing it was confirmed for under those leases can be credited again
                db.execute("DELETE FROM lease_confirmed WHERE lease_id = ?", (lease,))
            until = now + FRAUD_BAN_S
            db.execute(
                "INSERT INTO bans (model, node_id, until, proof_id) VALUES (?, ?, ?, ?) ON CONFLICT (model, node_id)"
                " DO UPDATE SET until = MAX(until, excluded.until), proof_id = excluded.proof_id",
                (fraud.model, fraud.node_id, until, fraud.proof_id),
            )
            db.execute("DELETE FROM bans WHERE until <= ?", (now,))
            db.execute(
                "DELETE FROM bans WHERE rowid IN (SELECT rowid FROM bans ORDER BY until DESC LIMIT -1 OFFSET ?)",
                (MAX_BANS,),
            )
            db.execute(
                'INSERT INTO frauds (proof_id, node_id, model, start, "end", request, step, submitter, verdict,'
                " withdrawn, leases, lease_revoked, banned_until, ts)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (fraud.proof_id, fraud.node_id, fraud.model, fraud.start, fraud.end, str(fraud.request), fraud.step,
                 fraud.submitter, fraud.verdict, float(withdrawn), json.dumps(sorted(set(leases))),
                 int(live is not None), until, now),
            )  # fmt: skip
            db.execute(
                "DELETE FROM frauds WHERE rowid IN (SELECT rowid FROM frauds ORDER BY ts DESC, rowid DESC"
                " LIMIT -1 OFFSET ?)",
                (MAX_FRAUD_ROWS,),
            )
            row = db.execute("SELECT * FROM frauds WHERE proof_id = ?", (fraud.proof_id,)).fetchone()
        return _fraud_row(row, duplicate=False)

    def frauds(self) -> dict[str, Any]:
        """The latest withdrawals (``GET /v1/fraud``), newest first."""
        rows = self.db.execute(
            "SELECT * FROM frauds ORDER BY ts DESC, rowid DESC LIMIT ?", (MAX_FRAUD_LISTED,)
        ).fetchall()
        return {"withdrawals": [_fraud_row(r) for r in rows]}

    def holder_key(self, model: str, start: int, end: int) -> str | None:
        row = self.db.execute(
            'SELECT holder_key FROM leases WHERE model = ? AND start = ? AND "end" = ?', (model, start, end)
        ).fetchone()
        return None if row is None else row[0]


def _fraud_row(row: Any, *, duplicate: bool | None = None) -> dict[str, Any]:
    keys = ("proof_id", "node_id", "model", "start", "end", "request", "step", "submitter", "verdict", "withdrawn",
            "leases", "lease_revoked", "banned_until", "ts")  # fmt: skip
    out = dict(zip(keys, row, strict=True))
    out["leases"] = json.loads(out["leases"])
    out["lease_revoked"] = bool(out["lease_revoked"])
    if duplicate is not None:
        out["duplicate"] = duplicate
    return out


def _bucket(ts: float) -> int:
    return int(ts // DEMAND_BUCKET_S)
