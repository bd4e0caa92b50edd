"""Keys admitted to claim on an open market: each paid its proof of work once (:mod:`kvasir.market.work`)."""

from __future__ import annotations

from kvasir.market.server.sqlite import StorePart


class Admissions(StorePart):
    def admitted(self, holder_key: str) -> bool:
        row = self.db.execute("SELECT 1 FROM admitted WHERE holder_key = ?", (holder_key,)).fetchone()
        return row is not None

    def admit(self, holder_key: str, bits: int) -> None:
        """Remember ``holder_key`` as admitted (its work of ``bits`` bits checked by the caller); idempotent."""
        with self._write() as db:
            db.execute(
                "INSERT OR IGNORE INTO admitted (holder_key, bits, ts) VALUES (?, ?, ?)",
                (holder_key, bits, self.clock()),
            )
