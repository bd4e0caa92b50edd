"""Leases: who holds which window until when (claims are one compare-and-set), and the coverage map built from
them (``GET /v1/coverage``).

A lease must turn into service (security N6, :mod:`~kvasir.market.server.standing`): a holder that is neither
fresh nor vouched for by a neighbour window's holder is overdue, and another key's claim takes its window."""

from __future__ import annotations

import logging
import secrets
import sqlite3
from typing import Any

from kvasir.core.errors import MarketError
from kvasir.market.records import ClaimRequest, CoverageEntry, CreditReport, Lease, LeaseRef, LinkVouch
from kvasir.market.server import catalog
from kvasir.market.server.demand import demand_multiplier, recent_tokens, reward_of
from kvasir.market.server.sqlite import Database, StorePart
from kvasir.market.server.standing import LeaseRules, standing, tenure_start

log = logging.getLogger("kvasir.market")

_LEASE_ROW = 'SELECT node_id, lease_id, expires_at, holder_key FROM leases WHERE model = ? AND start = ? AND "end" = ?'
_CLAIM_ROW = (
    "SELECT node_id, lease_id, expires_at, holder_key, claimed_at, confirmed_at, state FROM leases"
    ' WHERE model = ? AND start = ? AND "end" = ?'
)


class LeaseBook(StorePart):
    def __init__(self, base: Database, models: catalog.Catalog, rules: LeaseRules | None = None) -> None:
        super().__init__(base)
        self.catalog = models
        self.rules = rules or LeaseRules()

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
                    'SELECT start, "end", node_id, expires_at, state, endpoint, holder_key, claimed_at, confirmed_at'
                    " FROM leases"
                    " WHERE model = ? AND expires_at > ?",
                    (m.sha256, now),
                )
            }
            windows = []
            for rank, w in enumerate(manifest.windows):
                stage = m.stage(w.start, w.end)
                assert stage is not None
                lease = leases.get((w.start, w.end))
                held = None if lease is None else standing(lease[7], lease[8], now, len(manifest.windows), self.rules)
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
                        confirmed=held == "confirmed",
                        claimable=held == "overdue",
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
        """Compare-and-set: grant the window if it has no live lease or only an overdue one (security N6), or renew
        the caller's own (``node_id`` is the fingerprint of the key that signed the request, so nobody gets or
        changes another holder's lease)."""
        manifest, _ = self.catalog.window(req.model, req.start, req.end)
        now = self.clock()
        expires = now + req.lease_s
        with self._write() as db:
            self.check_ban(db, req.model, req.node_id, now)
            self.check_idle(db, req.model, req.node_id, now)
            row = db.execute(_CLAIM_ROW, (req.model, req.start, req.end)).fetchone()
            window = f"[{req.start}, {req.end})"
            prior = None if row is None else (row[0], row[4], row[2], row[5])
            claimed_at = tenure_start(prior, req.node_id, now, self.rules)
            live = row is not None and row[2] > now
            if live and (row[0] != req.node_id or (holder_key is not None and row[3] not in (None, holder_key))):
                held = standing(row[4], row[5], now, len(manifest.windows), self.rules)
                if held != "overdue":
                    open_at = row[4] + self.rules.serve_deadline_s
                    when = f"; unless a neighbour vouches for it, other claims take it at {open_at:.0f}"
                    raise MarketError(
                        409, "window_taken",
                        f"window {window} is held by node {row[0]}{when if held == 'fresh' else ''}",
                    )  # fmt: skip
                self._evict_overdue(db, req, row[0], now)
                claimed_at, live = now, False
            if live:
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
                    (req.model, req.start, req.end, req.node_id, lease_id, expires, req.endpoint, req.state,
                     claimed_at, holder_key),
                )  # fmt: skip
        return Lease(req.model, req.start, req.end, req.node_id, lease_id, expires)

    def _evict_overdue(self, db: sqlite3.Connection, req: ClaimRequest, holder: str, now: float) -> None:
        """The window's overdue holder gives way to ``req``; its key may not claim on the model for a while."""
        until = now + self.rules.idle_cooldown_s
        db.execute("DELETE FROM idle_keys WHERE until <= ?", (now,))  # bounded: only cooldowns still running
        db.execute(
            "INSERT OR REPLACE INTO idle_keys (model, node_id, until) VALUES (?, ?, ?)", (req.model, holder, until)
        )
        log.warning(
            "window %d:%d of %s: node %s took it from node %s, which did not serve it (no neighbour vouched)",
            req.start, req.end, req.model[:12], req.node_id, holder,
        )  # fmt: skip

    @staticmethod
    def check_idle(db: sqlite3.Connection, model: str, node_id: str, now: float) -> None:
        row = db.execute("SELECT until FROM idle_keys WHERE model = ? AND node_id = ?", (model, node_id)).fetchone()
        if row is not None and row[0] > now:
            raise MarketError(
                403, "idle_cooldown", f"node {node_id} held a window of this model without serving it (no neighbour "
                f"vouched for it); it may claim on this model again in {row[0] - now:.0f} s",
            )  # fmt: skip

    def vouch(self, v: LinkVouch, holder_key: str | None = None) -> dict[str, Any]:
        """The holder of ``v``'s window vouches for its link with the holder of the window before (or after) it:
        that lease is confirmed (both must be serving; the two keys must differ)."""
        manifest, rank = self.catalog.window(v.model, v.start, v.end)
        now = self.clock()
        if len(manifest.windows) <= 1:
            raise MarketError(409, "no_neighbour", "a model of one window has no neighbour to vouch for")
        other = manifest.windows[(rank + (1 if v.side == "successor" else -1)) % len(manifest.windows)]
        with self._write() as db:
            self.check_lease(db, LeaseRef(v.model, v.start, v.end, v.node_id, v.lease_id), now, holder_key)
            own = db.execute(_CLAIM_ROW, (v.model, v.start, v.end)).fetchone()
            row = db.execute(_CLAIM_ROW, (v.model, other.start, other.end)).fetchone()
            if own[6] != "serving":
                raise MarketError(409, "not_serving", "only a serving holder vouches for its neighbours")
            if row is None or row[2] <= now or row[3] != v.key:
                raise MarketError(
                    409, "not_holder", f"window [{other.start}, {other.end}) is not held by the key that vouch names"
                )
            if v.key == (holder_key or own[3]):
                raise MarketError(409, "own_key", "a holder cannot vouch for its own key")
            if row[6] != "serving":
                raise MarketError(409, "not_serving", f"the holder of [{other.start}, {other.end}) is not serving")
            db.execute(
                'UPDATE leases SET confirmed_at = ? WHERE model = ? AND start = ? AND "end" = ?',
                (now, v.model, other.start, other.end),
            )
        return {"confirmed": [other.start, other.end], "holder": row[0], "until": now + self.rules.confirm_ttl_s}

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
        """End the caller's lease. One never confirmed is kept as expired: a claim of the same key soon after
        continues its tenure (:func:`~kvasir.market.server.standing.tenure_start`) instead of starting a fresh one."""
        self.catalog.window(ref.model, ref.start, ref.end)
        now = self.clock()
        where = (ref.model, ref.start, ref.end)
        with self._write() as db:
            self.check_lease(db, ref, now, holder_key)
            db.execute('UPDATE leases SET expires_at = ? WHERE model = ? AND start = ? AND "end" = ?', (now, *where))
            db.execute(
                'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ? AND confirmed_at IS NOT NULL', where
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
