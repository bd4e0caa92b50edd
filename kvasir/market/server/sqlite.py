"""The market's SQLite database (WAL, one connection): its schema, its write transactions and its meta keys.

Every write is one ``BEGIN IMMEDIATE`` transaction (a claim's read and write are one atomic compare-and-set), and
records when the market was last alive, so that after a downtime every lease that was live gets back the time it
had left. The parts of :class:`~kvasir.market.server.store.MarketStore` share one :class:`Database`.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvasir.core.errors import InputError
from kvasir.market.server.clock import MarketClock

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (sha256 TEXT PRIMARY KEY, body TEXT NOT NULL, added REAL NOT NULL);
CREATE TABLE IF NOT EXISTS manifests (model TEXT PRIMARY KEY, body TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    model TEXT NOT NULL, start INTEGER NOT NULL, "end" INTEGER NOT NULL,
    node_id TEXT NOT NULL, lease_id TEXT NOT NULL, expires_at REAL NOT NULL,
    endpoint TEXT, state TEXT NOT NULL, claimed_at REAL NOT NULL, holder_key TEXT, confirmed_at REAL,
    PRIMARY KEY (model, start, "end"));
CREATE TABLE IF NOT EXISTS idle_keys (
    model TEXT NOT NULL, node_id TEXT NOT NULL, until REAL NOT NULL, PRIMARY KEY (model, node_id));
CREATE TABLE IF NOT EXISTS admitted (holder_key TEXT PRIMARY KEY, bits INTEGER NOT NULL, ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS demand_buckets (
    model TEXT NOT NULL, bucket INTEGER NOT NULL, requests INTEGER NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (model, bucket));
CREATE TABLE IF NOT EXISTS lease_credits (
    lease_id TEXT PRIMARY KEY, node_id TEXT NOT NULL, model TEXT NOT NULL, start INTEGER NOT NULL,
    "end" INTEGER NOT NULL, tokens INTEGER NOT NULL, layer_tokens INTEGER NOT NULL, earned REAL NOT NULL,
    ts REAL NOT NULL, earned_micro INTEGER NOT NULL DEFAULT 0, account TEXT);
CREATE INDEX IF NOT EXISTS lease_credits_node ON lease_credits (node_id);
DROP TABLE IF EXISTS receipts_seen;
DROP TABLE IF EXISTS receipts;
DROP TABLE IF EXISTS lease_confirmed;
CREATE TABLE IF NOT EXISTS accounts (
    account TEXT PRIMARY KEY, balance INTEGER NOT NULL, funded INTEGER NOT NULL, paid INTEGER NOT NULL,
    earned INTEGER NOT NULL, ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS paid_receipts (
    auth_id TEXT NOT NULL, rank INTEGER NOT NULL, witness TEXT NOT NULL, account TEXT NOT NULL,
    lease_id TEXT NOT NULL, request TEXT NOT NULL, tokens INTEGER NOT NULL, holders TEXT NOT NULL,
    expires REAL NOT NULL, ts REAL NOT NULL, PRIMARY KEY (auth_id, rank));
CREATE INDEX IF NOT EXISTS paid_receipts_witness ON paid_receipts (witness, ts);
CREATE INDEX IF NOT EXISTS paid_receipts_expires ON paid_receipts (expires);
CREATE TABLE IF NOT EXISTS settlements (
    auth_id TEXT PRIMARY KEY, client TEXT NOT NULL, model TEXT NOT NULL, request TEXT NOT NULL,
    tokens INTEGER NOT NULL, amount INTEGER NOT NULL, expires REAL NOT NULL, ts REAL NOT NULL);
CREATE INDEX IF NOT EXISTS settlements_expires ON settlements (expires);
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


class Database:
    """One connection; the service never runs two calls at once (``resume=False``: a tool beside a running
    market, which leaves its leases alone). Time is market time
    (:class:`~kvasir.market.server.clock.MarketClock` on ``wall``, anchored no earlier than the last write), or
    ``clock`` (unix seconds) where tests move it by hand."""

    def __init__(
        self,
        path: Path | str,
        *,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] = time.time,
        resume: bool = True,
    ) -> None:
        self.clock: Callable[[], float] = clock or wall
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False, timeout=10)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(_SCHEMA)
            columns = {r[1] for r in self.db.execute("PRAGMA table_info(leases)")}
            if "holder_key" not in columns:  # a database from before signed claims
                self.db.execute("ALTER TABLE leases ADD COLUMN holder_key TEXT")
            credits = {r[1] for r in self.db.execute("PRAGMA table_info(lease_credits)")}
            if "account" not in credits:  # a database from before client accounts
                self.db.execute("ALTER TABLE lease_credits ADD COLUMN earned_micro INTEGER NOT NULL DEFAULT 0")
                self.db.execute("ALTER TABLE lease_credits ADD COLUMN account TEXT")
            if "confirmed_at" not in columns:  # a database from before neighbours vouched (security N6)
                self.db.execute("ALTER TABLE leases ADD COLUMN confirmed_at REAL")
            if clock is None:
                alive_at = self.get_meta("alive_at")
                self.clock = MarketClock(wall, floor=0.0 if alive_at is None else float(alive_at))
            if resume:  # not beside a running market (``kvasir market fund``): its leases are not ours to move
                self._resume()
        except sqlite3.Error as exc:
            raise InputError(f"{path}: cannot open the market database ({exc})") from None

    def _resume(self) -> None:
        """After a downtime, give every lease that was live when the market stopped the time it had left.

        Holders could not renew while the market was away; without this, a spare that polls first after a restart
        would take a healthy holder's window and cut its streams. The shift is ``now - alive_at`` in market time,
        so a step of the host's clock taken at the restart counts as downtime too: nobody's lease shrinks.
        """
        row = self.db.execute("SELECT value FROM meta WHERE key = 'alive_at'").fetchone()
        now = self.clock()
        if row is not None and now > float(row[0]):
            alive_at = float(row[0])
            with self.write() as db:
                # Nobody could serve or vouch meanwhile: deadlines and confirmations move by the downtime too.
                db.execute(
                    "UPDATE leases SET expires_at = expires_at + ?1, claimed_at = claimed_at + ?1,"
                    " confirmed_at = confirmed_at + ?1 WHERE expires_at > ?2",
                    (now - alive_at, alive_at),
                )

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
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
        with self.write() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))


class StorePart:
    """One concern of the store, on the shared :class:`Database`."""

    def __init__(self, base: Database) -> None:
        self.base = base
        self.db = base.db

    def clock(self) -> float:
        return self.base.clock()

    def _write(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        return self.base.write()
