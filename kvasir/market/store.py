"""The market's state in SQLite (WAL): models, rank manifests, leases, demand and the contribution ledger.

Every method is synchronous and runs one transaction (``BEGIN IMMEDIATE`` for writes, so a claim's read and write
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvasir.errors import InputError, MarketError
from kvasir.market.records import (
    ClaimRequest,
    CoverageEntry,
    CreditReport,
    DemandReport,
    Lease,
    LeaseRef,
    ManifestRecord,
    ModelRecord,
)

#: Demand older than this no longer raises rewards.
DEMAND_HORIZON_S = 600.0
#: Recent tokens that double a model's rewards.
DEMAND_SCALE_TOKENS = 1000.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (sha256 TEXT PRIMARY KEY, body TEXT NOT NULL, added REAL NOT NULL);
CREATE TABLE IF NOT EXISTS manifests (model TEXT PRIMARY KEY, body TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    model TEXT NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL,
    node_id TEXT NOT NULL, lease_id TEXT NOT NULL, expires_at REAL NOT NULL,
    endpoint TEXT, state TEXT NOT NULL, claimed_at REAL NOT NULL,
    PRIMARY KEY (model, start, "end"));
CREATE TABLE IF NOT EXISTS demand (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, model TEXT NOT NULL,
    requests INTEGER NOT NULL, tokens INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS demand_ts ON demand (model, ts);
CREATE TABLE IF NOT EXISTS credits (
    id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, node_id TEXT NOT NULL, model TEXT NOT NULL,
    start INTEGER NOT NULL, "end" INTEGER NOT NULL, tokens INTEGER NOT NULL, layer_tokens INTEGER NOT NULL,
    earned REAL NOT NULL);
CREATE INDEX IF NOT EXISTS credits_node ON credits (node_id);
"""


def demand_multiplier(recent_tokens: int) -> float:
    """How much recent demand raises a model's rewards (pure): 1 at no demand, +1 per DEMAND_SCALE_TOKENS."""
    return 1.0 + recent_tokens / DEMAND_SCALE_TOKENS


class MarketStore:
    def __init__(self, path: Path | str, *, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise InputError(f"{path}: cannot open the market database ({exc})") from None

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ------------------------------------------------------------------------------------------ models

    def put_model(self, model: ModelRecord) -> bool:
        """Store or replace a model record; True if it is new."""
        with self._write() as db:
            new = db.execute("SELECT 1 FROM models WHERE sha256 = ?", (model.sha256,)).fetchone() is None
            db.execute(
                "INSERT INTO models (sha256, body, added) VALUES (?, ?, ?)"
                " ON CONFLICT (sha256) DO UPDATE SET body = excluded.body",
                (model.sha256, json.dumps(model.to_wire()), self.clock()),
            )
        return new

    def models(self) -> list[ModelRecord]:
        rows = self.db.execute("SELECT body FROM models ORDER BY added").fetchall()
        return [ModelRecord.from_wire(json.loads(r[0])) for r in rows]

    def model(self, sha256: str) -> ModelRecord:
        row = self.db.execute("SELECT body FROM models WHERE sha256 = ?", (sha256,)).fetchone()
        if row is None:
            raise MarketError(404, "unknown_model", f"no model {sha256[:12]}… on this market")
        return ModelRecord.from_wire(json.loads(row[0]))

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
        """The coverage map (``GET /v1/coverage``): every manifest window, its reward and its live holder."""
        now = self.clock()
        out = []
        models = [self.model(model)] if model is not None else self.models()
        for m in models:
            try:
                manifest = self.manifest(m.sha256)
            except MarketError:
                continue
            mult = demand_multiplier(self._recent_tokens(m.sha256, now))
            leases = {
                (r[0], r[1]): r
                for r in self.db.execute(
                    'SELECT start, "end", node_id, expires_at, state, endpoint FROM leases'
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
                        reward=w.weight * mult,
                        bytes=stage.bytes,
                        sha256=stage.sha256,
                        holder=lease[2] if lease else None,
                        lease_expires=lease[3] if lease else None,
                        state=lease[4] if lease else None,
                        endpoint=lease[5] if lease else None,
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
        return {"now": now, "models": out}

    def _window(self, model: str, start: int, end: int) -> tuple[ManifestRecord, int]:
        self.model(model)
        manifest = self.manifest(model)
        for rank, w in enumerate(manifest.windows):
            if (w.start, w.end) == (start, end):
                return manifest, rank
        raise MarketError(404, "unknown_window", f"model {model[:12]}… has no window [{start}, {end})")

    # ------------------------------------------------------------------------------------------ claims

    def claim(self, req: ClaimRequest) -> Lease:
        """Compare-and-set: grant the window if it has no live lease (or the caller already holds it)."""
        self._window(req.model, req.start, req.end)
        now = self.clock()
        with self._write() as db:
            row = db.execute(
                'SELECT node_id, lease_id, expires_at FROM leases WHERE model = ? AND start = ? AND "end" = ?',
                (req.model, req.start, req.end),
            ).fetchone()
            if row is not None and row[2] > now and row[0] != req.node_id:
                raise MarketError(409, "window_taken", f"window [{req.start}, {req.end}) is held by node {row[0]}")
            lease_id = row[1] if row is not None and row[2] > now else secrets.token_hex(12)
            expires = now + req.lease_s
            db.execute(
                'INSERT OR REPLACE INTO leases (model, start, "end", node_id, lease_id, expires_at, endpoint, state,'
                " claimed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (req.model, req.start, req.end, req.node_id, lease_id, expires, req.endpoint, req.state, now),
            )
        return Lease(req.model, req.start, req.end, req.node_id, lease_id, expires)

    def _check_lease(self, db: sqlite3.Connection, ref: LeaseRef | ClaimRequest | CreditReport, now: float) -> None:
        row = db.execute(
            'SELECT node_id, lease_id, expires_at FROM leases WHERE model = ? AND start = ? AND "end" = ?',
            (ref.model, ref.start, ref.end),
        ).fetchone()
        window = f"[{ref.start}, {ref.end})"
        if row is None or (row[2] <= now and (row[0], row[1]) == (ref.node_id, ref.lease_id)):
            raise MarketError(409, "lease_expired", f"the lease on window {window} has expired; claim it again")
        if (row[0], row[1]) != (ref.node_id, ref.lease_id):
            if row[2] <= now:
                raise MarketError(409, "lease_expired", f"the lease on window {window} has expired; claim it again")
            raise MarketError(409, "foreign_lease", f"window {window} is held by another lease")

    def renew(self, req: ClaimRequest) -> Lease:
        self._window(req.model, req.start, req.end)
        assert req.lease_id is not None
        now = self.clock()
        expires = now + req.lease_s
        with self._write() as db:
            self._check_lease(db, req, now)
            db.execute(
                'UPDATE leases SET expires_at = ?, endpoint = ?, state = ? WHERE model = ? AND start = ? AND "end" = ?',
                (expires, req.endpoint, req.state, req.model, req.start, req.end),
            )
        return Lease(req.model, req.start, req.end, req.node_id, req.lease_id, expires)

    def release(self, ref: LeaseRef) -> None:
        self._window(ref.model, ref.start, ref.end)
        with self._write() as db:
            self._check_lease(db, ref, self.clock())
            db.execute(
                'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ?', (ref.model, ref.start, ref.end)
            )

    # ------------------------------------------------------------------------------------------ demand, ledger

    def _recent_tokens(self, model: str, now: float) -> int:
        row = self.db.execute(
            "SELECT COALESCE(SUM(tokens), 0) FROM demand WHERE model = ? AND ts > ?", (model, now - DEMAND_HORIZON_S)
        ).fetchone()
        return int(row[0])

    def add_demand(self, report: DemandReport) -> None:
        self.model(report.model)
        with self._write() as db:
            db.execute(
                "INSERT INTO demand (ts, model, requests, tokens) VALUES (?, ?, ?, ?)",
                (self.clock(), report.model, report.requests, report.tokens),
            )

    def demand(self) -> dict[str, Any]:
        now = self.clock()
        out = []
        for m in self.models():
            row = self.db.execute(
                "SELECT COALESCE(SUM(requests), 0), COALESCE(SUM(tokens), 0) FROM demand WHERE model = ? AND ts > ?",
                (m.sha256, now - DEMAND_HORIZON_S),
            ).fetchone()
            rewards = []
            try:
                mult = demand_multiplier(int(row[1]))
                rewards = [
                    {"layers": [w.start, w.end], "reward": w.weight * mult} for w in self.manifest(m.sha256).windows
                ]
            except MarketError:
                mult = demand_multiplier(int(row[1]))
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

    def credit(self, report: CreditReport) -> dict[str, Any]:
        """Credit a lease holder for tokens served: layer_tokens = tokens × window layers, earned = tokens × reward."""
        manifest, rank = self._window(report.model, report.start, report.end)
        now = self.clock()
        reward = manifest.windows[rank].weight * demand_multiplier(self._recent_tokens(report.model, now))
        layer_tokens = report.tokens * (report.end - report.start)
        earned = report.tokens * reward
        with self._write() as db:
            self._check_lease(db, report, now)
            db.execute(
                'INSERT INTO credits (ts, node_id, model, start, "end", tokens, layer_tokens, earned)'
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (now, report.node_id, report.model, report.start, report.end, report.tokens, layer_tokens, earned),
            )
        return {"node_id": report.node_id, "tokens": report.tokens, "layer_tokens": layer_tokens, "earned": earned}

    def ledger(self) -> dict[str, Any]:
        rows = self.db.execute(
            "SELECT node_id, SUM(tokens), SUM(layer_tokens), SUM(earned), MAX(ts) FROM credits"
            " GROUP BY node_id ORDER BY SUM(earned) DESC, node_id"
        ).fetchall()
        return {
            "nodes": [
                {"node_id": r[0], "tokens": int(r[1]), "layer_tokens": int(r[2]), "earned": float(r[3]), "last": r[4]}
                for r in rows
            ]
        }
