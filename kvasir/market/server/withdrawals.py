"""Fraud: what a proven cheat loses (its credit on the window, in the ledger and in its account; its lease there;
its claims on the model for a while), and the record of every withdrawal (``GET /v1/fraud``).
kvasir.market.server.fraud judges the proof."""

from __future__ import annotations

import json
from typing import Any

from kvasir.market.records import FraudRecord
from kvasir.market.server.catalog import Catalog
from kvasir.market.server.sqlite import Database, StorePart

#: How long a node proven to cheat on a model may not claim its windows again.
FRAUD_BAN_S = 24 * 3600.0
#: Withdrawals (one per proof) and bans the market keeps at most: the oldest go first.
MAX_FRAUD_ROWS = 100_000
MAX_BANS = 100_000
#: Withdrawals one ``GET /v1/fraud`` lists at most (the latest).
MAX_FRAUD_LISTED = 1000


class Withdrawals(StorePart):
    def __init__(self, base: Database, models: Catalog) -> None:
        super().__init__(base)
        self.catalog = models

    def withdraw(self, fraud: FraudRecord) -> dict[str, Any]:
        """Act on a fraud proof that holds: zero the suspect's credit on that window of the model (every lease of
        it there), revoke its live lease on the window, refuse its claims on the model for FRAUD_BAN_S, and write
        the proof's id down with what was withdrawn. The same proof again changes nothing and replies the same."""
        self.catalog.window(fraud.model, fraud.start, fraud.end)
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
            # What the window earned leaves the cheat's account too (as much as is left there): withdrawn from
            # circulation, paid to nobody.
            for account, micro in db.execute(
                "SELECT account, SUM(earned_micro) FROM lease_credits WHERE node_id = ? AND model = ? AND start = ?"
                ' AND "end" = ? AND account IS NOT NULL GROUP BY account',
                window,
            ).fetchall():
                db.execute(
                    "UPDATE accounts SET balance = balance - MIN(balance, ?), ts = ? WHERE account = ?",
                    (micro, now, account),
                )
            db.execute(
                "UPDATE lease_credits SET tokens = 0, layer_tokens = 0, earned = 0, earned_micro = 0, ts = ?"
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
            for lease in set(leases):  # its receipts awaiting their ring settle nothing now
                db.execute("DELETE FROM paid_receipts WHERE lease_id = ?", (lease,))
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


def _fraud_row(row: Any, *, duplicate: bool | None = None) -> dict[str, Any]:
    keys = ("proof_id", "node_id", "model", "start", "end", "request", "step", "submitter", "verdict", "withdrawn",
            "leases", "lease_revoked", "banned_until", "ts")  # fmt: skip
    out = dict(zip(keys, row, strict=True))
    out["leases"] = json.loads(out["leases"])
    out["lease_revoked"] = bool(out["lease_revoked"])
    if duplicate is not None:
        out["duplicate"] = duplicate
    return out
