"""The market's time: its host's wall clock read once at start, then advanced by the monotonic clock.

Lease expiries, request freshness, tickets and the ledger all use this one clock, so a step of the host's wall
clock while the market runs (an NTP correction, an operator's ``date -s``) changes nothing: no lease expires early
or late, and nodes, which sign with their estimate of the market's time (docs/protocol.md § Market time), stay in
step. The market logs such a step once (:meth:`MarketClock.__call__` compares the two clocks).

Market time never runs backwards over the market's whole life: a start anchors at the later of the wall clock and
the time the database was last written (``alive_at``), so a host whose clock went back does not reopen old nonces'
times or extend leases. A step forward taken at a restart is downtime, which
:meth:`kvasir.market.server.sqlite.Database._resume` gives back to every lease.

``KVASIR_MARKET_WALL_SKEW_FILE`` (a test and ops hook, read by ``kvasir market`` only): a file holding seconds
added to the host's wall clock as the market reads it, re-read at every read, so tests step the market's wall clock
without touching the system's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("kvasir.market")

#: The environment variable naming the skew file (see the module's docstring).
SKEW_FILE_ENV = "KVASIR_MARKET_WALL_SKEW_FILE"
#: A change of (wall − market time) beyond this is logged as a step of the host's clock.
STEP_LOG_S = 2.0


class MarketClock:
    """Unix seconds as the market counts them (call it). ``wall``: the host's clock (read at start, then only to
    report steps); ``floor``: the latest market time already used (the database's ``alive_at``)."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        *,
        floor: float = 0.0,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.wall = wall
        self.mono = mono
        now = wall()
        self.anchor = max(now, floor)
        self.mono0 = mono()
        #: How far the host's clock was behind the market's last time at start (0: it was not).
        self.behind_at_start = self.anchor - now
        self._drift = now - self.anchor

    def __call__(self) -> float:
        now = self.anchor + (self.mono() - self.mono0)
        drift = self.wall() - now
        if abs(drift - self._drift) > STEP_LOG_S:
            log.warning(
                "the host's clock stepped by %+.1f s; market time (leases, request times) runs on unchanged, "
                "%+.1f s from the host's clock until the market restarts",
                drift - self._drift,
                -drift,
            )
            self._drift = drift
        return now


def wall_clock_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> Callable[[], float]:
    """``time.time``, or with ``KVASIR_MARKET_WALL_SKEW_FILE`` set, ``time.time`` plus the seconds that file holds
    (re-read each call; an unreadable or malformed file counts as 0)."""
    name = environ.get(SKEW_FILE_ENV)
    if not name:
        return time.time
    path = Path(name)

    def skewed() -> float:
        try:
            skew = float(path.read_text().strip() or 0)
        except (OSError, ValueError):
            skew = 0.0
        return time.time() + skew

    return skewed
