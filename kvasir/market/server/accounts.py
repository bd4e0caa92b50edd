"""Accounts: balances of keys the market knows, in micro-credits (docs/market.md § Credit).

A client's account is funded by the operator (``kvasir market fund``, on the market's database); paid requests
move credit from it to the accounts of the holders that served them; a proven cheat loses what it earned on the
window (the credit is withdrawn from circulation, never handed to anyone). An account is a public key's text, so
a key that merely shares another's 64-bit fingerprint owns nothing of it. No code path adds to a balance without
taking the same amount from another, except funding.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from kvasir.core.clientauth import MICRO
from kvasir.core.errors import InputError, MarketError
from kvasir.core.identity import PublicKey
from kvasir.market.server.sqlite import Database, StorePart

#: All balances together at most (micro-credits, what funding may put in): moves conserve the total, so no balance
#: or sum of balances ever nears 2^63.
MAX_BALANCE = 10**18


def credit_account(db: sqlite3.Connection, account: str, micro: int, now: float, *, earned: bool) -> None:
    """Add ``micro`` to ``account`` (a move's receiving half: the caller took it from another account)."""
    db.execute(
        "INSERT INTO accounts (account, balance, funded, paid, earned, ts) VALUES (?, ?, 0, 0, ?, ?)"
        " ON CONFLICT (account) DO UPDATE SET balance = balance + excluded.balance,"
        " earned = earned + excluded.earned, ts = excluded.ts",
        (account, micro, micro if earned else 0, now),
    )


def balance_of(db: sqlite3.Connection, account: str) -> int | None:
    row = db.execute("SELECT balance FROM accounts WHERE account = ?", (account,)).fetchone()
    return None if row is None else int(row[0])


class AccountBook(StorePart):
    def __init__(self, base: Database) -> None:
        super().__init__(base)

    def fund(self, key: str, micro: int) -> dict[str, Any]:
        """The operator adds ``micro`` micro-credits to the account of public key ``key`` (opened if new)."""
        PublicKey.from_text(key)
        if not 0 < micro <= MAX_BALANCE:
            raise InputError(f"an amount is 1-{MAX_BALANCE} micro-credits")
        now = self.clock()
        with self._write() as db:
            (total,) = db.execute("SELECT COALESCE(SUM(balance), 0) FROM accounts").fetchone()
            if total + micro > MAX_BALANCE:
                raise InputError(f"that would take the market's credit past {MAX_BALANCE // MICRO} credits in all")
            db.execute(
                "INSERT INTO accounts (account, balance, funded, paid, earned, ts) VALUES (?, ?, ?, 0, 0, ?)"
                " ON CONFLICT (account) DO UPDATE SET balance = balance + excluded.balance,"
                " funded = funded + excluded.funded, ts = excluded.ts",
                (key, micro, micro, now),
            )
        return self.account(key)

    def account(self, key: str) -> dict[str, Any]:
        """``GET /v1/accounts?key=…``: balance, funded, paid and earned (micro-credits); 404 for an unknown key."""
        row = self.db.execute(
            "SELECT balance, funded, paid, earned, ts FROM accounts WHERE account = ?", (key,)
        ).fetchone()
        if row is None:
            raise MarketError(404, "no_account", "the market has no account for that key")
        balance, funded, paid, earned, ts = row
        return {"key": key, "balance": balance, "funded": funded, "paid": paid, "earned": earned, "ts": ts}

    def total(self) -> int:
        """Every balance together (micro-credits): what funding put in, less what fraud withdrew."""
        (total,) = self.db.execute("SELECT COALESCE(SUM(balance), 0) FROM accounts").fetchone()
        return int(total)
