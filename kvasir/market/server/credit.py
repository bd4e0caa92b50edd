"""Credit: paid requests settled from their receipts, moving the client's credit to the windows that served, and
the ledger of what each node earned (docs/market.md § Credit).

Credit is moved, never minted: a window earns only what a client's signed authorisation pays, once the holder of
every window of the ring sent a receipt carrying it (at least two distinct holders), and each authorisation settles
at most once. Demand (which raises the price of a model's windows) is the settled traffic, never a holder's word.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from kvasir.core.clientauth import MAX_PRICE, ClientAuth, parse_auth
from kvasir.core.errors import InputError, MarketError
from kvasir.market.records import CreditReport, ManifestRecord, ReceiptBatch
from kvasir.market.server.accounts import balance_of, credit_account
from kvasir.market.server.catalog import Catalog
from kvasir.market.server.demand import add_settled, demand_multiplier, recent_tokens, reward_of
from kvasir.market.server.leases import LeaseBook
from kvasir.market.server.settle import Witnessed, affordable_tokens, settled_tokens, window_prices
from kvasir.market.server.sqlite import Database, StorePart

#: Receipts of a paid request are taken until this long after its authorisation expires (a node that lost the
#: market for a while sends them late); the market remembers a settlement as long, so it never settles twice.
RECEIPT_GRACE_S = 3600.0
#: An authorisation valid for longer than this from now is refused (what the market must remember stays bounded).
MAX_AUTH_S = 24 * 3600.0
#: Receipts waiting for the rest of their ring, at most in all and per witness (oldest first out).
MAX_PENDING = 1_000_000
MAX_PENDING_PER_WITNESS = 4096
#: Ledger rows in one reply at most.
MAX_LEDGER_ROWS = 1000
#: Witnesses a ledger row names at most (those that confirmed the most of the node's tokens).
LEDGER_WITNESSES = 8


class CreditBook(StorePart):
    def __init__(self, base: Database, models: Catalog, leases: LeaseBook) -> None:
        super().__init__(base)
        self.catalog = models
        self.leases = leases

    def add_receipts(self, batch: ReceiptBatch, holder_key: str | None, market_key: str) -> dict[str, Any]:
        """A holder's receipts (docs/market.md § Credit): each counts for the windows the sender holds now and the
        receipt names it holding, if it carries a valid authorisation for this market and model that has not
        settled or expired, from a client with an account. A request settles when every window's receipt is in.
        Replies with how many receipts were new and how many requests settled."""
        manifest = self.catalog.manifest(batch.model)
        now = self.clock()
        with self._write() as db:
            live = {
                (r[0], r[1]): (str(r[2]), str(r[3]), r[4])
                for r in db.execute(
                    'SELECT start, "end", node_id, lease_id, holder_key FROM leases WHERE model = ? AND expires_at > ?',
                    (batch.model, now),
                )
            }
            held = {
                rank: live[(w.start, w.end)]
                for rank, w in enumerate(manifest.windows)
                if (w.start, w.end) in live
                and live[(w.start, w.end)][0] == batch.node_id
                and holder_key in (None, live[(w.start, w.end)][2])
            }
            if not held:
                raise MarketError(403, "not_a_holder", f"node {batch.node_id} holds no window of {batch.model[:12]}…")
            db.execute("DELETE FROM paid_receipts WHERE expires < ?", (now,))
            db.execute("DELETE FROM settlements WHERE expires < ?", (now,))
            (pending,) = db.execute("SELECT COUNT(*) FROM paid_receipts").fetchone()
            if pending + len(batch.receipts) > MAX_PENDING:
                raise MarketError(503, "busy", "too many receipts awaiting their ring; retry later")
            new = settled = 0
            for receipt in batch.receipts:
                auth = self._auth(db, receipt.client_auth, batch.model, market_key, now)
                if auth is None or len(receipt.holders) != len(manifest.windows):
                    continue  # unpaid, not payable here, or not this manifest's ring: it settles nothing
                for rank, (node_id, lease_id, key) in held.items():
                    if receipt.holders[rank] != node_id:
                        continue
                    new += db.execute(
                        "INSERT OR IGNORE INTO paid_receipts (auth_id, rank, witness, account, lease_id, request,"
                        " tokens, holders, expires, ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                        (auth.auth_id, rank, node_id, key or node_id, lease_id, str(receipt.request), receipt.tokens,
                         json.dumps(receipt.holders), auth.not_after + RECEIPT_GRACE_S, now),
                    ).rowcount  # fmt: skip
                settled += self._settle(db, manifest, auth, now)
            # A witness's receipts awaiting their ring (invented ones never complete) are capped: the oldest go first.
            db.execute(
                "DELETE FROM paid_receipts WHERE rowid IN (SELECT rowid FROM paid_receipts WHERE witness = ?"
                " ORDER BY ts DESC, rowid DESC LIMIT -1 OFFSET ?)",
                (batch.node_id, MAX_PENDING_PER_WITNESS),
            )
        return {"accepted": new, "settled": settled}

    @staticmethod
    def _auth(db: sqlite3.Connection, text: str | None, model: str, market_key: str, now: float) -> ClientAuth | None:
        """The receipt's authorisation if it can still settle here: signed by its client, for this market and
        model, not expired (past the grace), not too long-lived, not settled, from a client with an account."""
        if text is None:
            return None
        try:
            auth = parse_auth(text)
        except InputError:
            return None
        if auth.market.to_text() != market_key or auth.model != model:
            return None
        if not now - RECEIPT_GRACE_S <= auth.not_after <= now + MAX_AUTH_S:
            return None
        if db.execute("SELECT 1 FROM settlements WHERE auth_id = ?", (auth.auth_id,)).fetchone() is not None:
            return None
        if balance_of(db, auth.client.to_text()) is None:
            return None
        return auth

    def _settle(self, db: sqlite3.Connection, manifest: ManifestRecord, auth: ClientAuth, now: float) -> int:
        """Settle ``auth`` if its receipts are complete (:func:`~kvasir.market.server.settle.settled_tokens`): move
        what its tokens cost from the client's account to each window's holder, once. 1 if it settled, else 0."""
        rows = db.execute(
            "SELECT rank, witness, account, lease_id, request, tokens, holders FROM paid_receipts WHERE auth_id = ?",
            (auth.auth_id,),
        ).fetchall()
        witnessed = [Witnessed(int(r[0]), str(r[1]), int(r[4]), int(r[5]), tuple(json.loads(r[6]))) for r in rows]
        tokens = settled_tokens(len(manifest.windows), witnessed, auth.max_tokens)
        if tokens is None:
            return 0
        mult = demand_multiplier(recent_tokens(db, manifest.model, now))
        prices = window_prices([reward_of(w.weight, mult) for w in manifest.windows], auth.max_price)
        client = auth.client.to_text()
        paid = affordable_tokens(tokens, sum(prices), balance_of(db, client) or 0)
        amount = paid * sum(prices)
        db.execute(
            "UPDATE accounts SET balance = balance - ?, paid = paid + ?, ts = ? WHERE account = ?",
            (amount, amount, now, client),
        )
        by_rank = {int(r[0]): r for r in rows}
        for rank, w in enumerate(manifest.windows):
            _, witness, account, lease_id, *_ = by_rank[rank]
            share = paid * prices[rank]
            credit_account(db, str(account), share, now, earned=True)
            db.execute(
                'INSERT INTO lease_credits (lease_id, node_id, model, start, "end", tokens, layer_tokens, earned,'
                " earned_micro, account, ts) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (lease_id)"
                " DO UPDATE SET"
                " tokens = tokens + excluded.tokens, layer_tokens = layer_tokens + excluded.layer_tokens,"
                " earned_micro = earned_micro + excluded.earned_micro,"
                " earned = (earned_micro + excluded.earned_micro) / 1e6, ts = excluded.ts",
                (lease_id, witness, manifest.model, w.start, w.end, paid, paid * (w.end - w.start), share / 1e6,
                 share, account, now),
            )  # fmt: skip
            for other in {str(r[1]) for r in rows} - {str(witness)}:
                db.execute(
                    "INSERT INTO lease_witnesses (lease_id, witness, tokens) VALUES (?, ?, ?)"
                    " ON CONFLICT (lease_id, witness) DO UPDATE SET tokens = tokens + excluded.tokens",
                    (lease_id, other, paid),
                )
        # Demand counts paid tokens at the base price: a request paid below it (a low price cap) counts for less,
        # so an authorisation capped at nothing raises no reward.
        base = sum(window_prices([w.weight for w in manifest.windows], MAX_PRICE))
        add_settled(db, manifest.model, paid if base == 0 else min(paid, amount // base), now)
        db.execute(
            "INSERT INTO settlements (auth_id, client, model, request, tokens, amount, expires, ts)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (auth.auth_id, client, manifest.model, str(witnessed[0].request), paid, amount,
             auth.not_after + RECEIPT_GRACE_S, now),
        )  # fmt: skip
        db.execute("DELETE FROM paid_receipts WHERE auth_id = ?", (auth.auth_id,))
        return 1

    def credit(self, report: CreditReport, holder_key: str | None = None) -> dict[str, Any]:
        """A lease holder's totals under this lease (what settled requests paid it). The report's own count is
        ignored: a holder's word credits nothing (security N7)."""
        with self._write() as db:
            self.leases.check_lease(db, report, self.clock(), holder_key)
            row = db.execute(
                "SELECT tokens, layer_tokens, earned FROM lease_credits WHERE lease_id = ?", (report.lease_id,)
            ).fetchone()
        tokens, layer_tokens, earned = row if row is not None else (0, 0, 0.0)
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
