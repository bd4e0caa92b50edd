"""Leases: who holds which window until when (claims are one compare-and-set), and the coverage map built from
them (``GET /v1/coverage``)."""

from __future__ import annotations

import secrets
import sqlite3
from typing import Any

from kvasir.core.errors import MarketError
from kvasir.market.records import ClaimRequest, CoverageEntry, CreditReport, Lease, LeaseRef
from kvasir.market.server import catalog
from kvasir.market.server.demand import demand_multiplier, recent_tokens, reward_of
from kvasir.market.server.sqlite import Database, StorePart

_LEASE_ROW = 'SELECT node_id, lease_id, expires_at, holder_key FROM leases WHERE model = ? AND start = ? AND "end" = ?'


class LeaseBook(StorePart):
    def __init__(self, base: Database, models: catalog.Catalog) -> None:
        super().__init__(base)
        self.catalog = models

    def coverage(self, model: str | None = None) -> dict[str, Any]:
        """The coverage map (``GET /v1/coverage``): every manifest window, its reward and its live holder.

        At most MAX_COVERAGE_WINDOWS windows in one reply (whole models, oldest first; ``truncated`` says when
        some were left out, and ``?model=`` asks for one)."""
        now = self.clock()
        out = []
        shown, truncated = 0, False
        models = [self.catalog.model(model)] if model is not None else self.catalog.models()
        for m in models:
            try:
                manifest = self.catalog.manifest(m.sha256)
            except MarketError:
                continue
            if shown + len(manifest.windows) > catalog.MAX_COVERAGE_WINDOWS:
                truncated = True
                continue
            shown += len(manifest.windows)
            mult = demand_multiplier(recent_tokens(self.db, m.sha256, now))
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

    def claim(self, req: ClaimRequest, holder_key: str | None = None) -> Lease:
        """Compare-and-set: grant the window if it has no live lease, or renew the caller's own (``node_id`` is the
        fingerprint of the key that signed the request, so nobody gets or changes another holder's lease)."""
        self.catalog.window(req.model, req.start, req.end)
        now = self.clock()
        expires = now + req.lease_s
        with self._write() as db:
            self.check_ban(db, req.model, req.node_id, now)
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
    def check_ban(db: sqlite3.Connection, model: str, node_id: str, now: float) -> None:
        row = db.execute(
            "SELECT until, proof_id FROM bans WHERE model = ? AND node_id = ?", (model, node_id)
        ).fetchone()
        if row is not None and row[0] > now:
            raise MarketError(
                403, "banned", f"node {node_id} was proven to cheat on this model (proof {row[1][:16]}…); "
                f"it may claim again in {row[0] - now:.0f} s",
            )  # fmt: skip

    def check_lease(
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
        self.catalog.window(req.model, req.start, req.end)
        assert req.lease_id is not None
        now = self.clock()
        expires = now + req.lease_s
        with self._write() as db:
            self.check_lease(db, req, now, holder_key)
            db.execute(
                'UPDATE leases SET expires_at = ?, endpoint = ?, state = ? WHERE model = ? AND start = ? AND "end" = ?',
                (expires, req.endpoint, req.state, req.model, req.start, req.end),
            )
        return Lease(req.model, req.start, req.end, req.node_id, req.lease_id, expires)

    def release(self, ref: LeaseRef, holder_key: str | None = None) -> None:
        self.catalog.window(ref.model, ref.start, ref.end)
        with self._write() as db:
            self.check_lease(db, ref, self.clock(), holder_key)
            db.execute(
                'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ?', (ref.model, ref.start, ref.end)
            )

    def holds_lease(self, node_id: str, model: str) -> bool:
        row = self.db.execute(
            "SELECT 1 FROM leases WHERE model = ? AND node_id = ? AND expires_at > ?", (model, node_id, self.clock())
        ).fetchone()
        return row is not None

    def holder_key(self, model: str, start: int, end: int) -> str | None:
        row = self.db.execute(
            'SELECT holder_key FROM leases WHERE model = ? AND start = ? AND "end" = ?', (model, start, end)
        ).fetchone()
        return None if row is None else row[0]
