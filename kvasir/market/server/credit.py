"""Credit: witnesses' receipts, settled into what they confirm for each lease, and the ledger that pays for it
(docs/market.md § Credit)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from kvasir.core.errors import MarketError
from kvasir.market.records import MAX_LEASE_TOKENS, CreditReport, ReceiptBatch
from kvasir.market.server.catalog import Catalog
from kvasir.market.server.demand import demand_multiplier, recent_tokens, reward_of
from kvasir.market.server.leases import LeaseBook
from kvasir.market.server.sqlite import Database, StorePart

#: Tokens per second one window can be credited for at most, and the seconds of slack a fresh lease starts with.
MAX_TOKENS_PER_S = 2000.0
CREDIT_SLACK_S = 10.0
#: Receipts are remembered (so a repeated one counts once) this long, and at most this many at once.
RECEIPT_HORIZON_S = 3600.0
MAX_RECEIPTS_SEEN = 1_000_000
#: Receipts one witness may have waiting for their partner (what a node keeps while the market is away).
MAX_PENDING_PER_WITNESS = 4096
#: Ledger rows in one reply at most.
MAX_LEDGER_ROWS = 1000
#: Witnesses a ledger row names at most (those that confirmed the most of the node's tokens).
LEDGER_WITNESSES = 8


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


class CreditBook(StorePart):
    def __init__(
        self, base: Database, models: Catalog, leases: LeaseBook, *, max_tokens_per_s: float = MAX_TOKENS_PER_S
    ) -> None:
        super().__init__(base)
        self.catalog = models
        self.leases = leases
        self.max_tokens_per_s = max_tokens_per_s

    def add_receipts(self, batch: ReceiptBatch) -> dict[str, Any]:
        """A witness's receipts (docs/market.md § Credit). An entry receipt (``entry`` None) is the signer's own; an
        exit receipt names the entry node and counts only from that request's exit witness (the live holder of the
        last window, or of window 0 when the entry holds the last one). Each (entry, request) is settled once: when
        both receipts are in, or at once when the request has no exit witness. Replies with how many were new."""
        manifest = self.catalog.manifest(batch.model)
        now = self.clock()
        if not self.leases.holds_lease(batch.node_id, batch.model):
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
        manifest, rank = self.catalog.window(report.model, report.start, report.end)
        now = self.clock()
        reward = reward_of(manifest.windows[rank].weight, demand_multiplier(recent_tokens(self.db, report.model, now)))
        layers = report.end - report.start
        with self._write() as db:
            self.leases.check_lease(db, report, now, holder_key)
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
