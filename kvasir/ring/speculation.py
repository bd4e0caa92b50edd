"""Speculative decoding in the ring: what each node keeps per request, and the decisions (pure where they can be).

The schedule is ``kvasir generate --speculate K``'s (docs/speculation.md), split across the ring:

- the last rank knows the tokens: after each step it drafts (``kvasir.core.speculate.Drafter``, prompt lookup over
  prompt + output, the same object ``generate`` drafts with)
  and sends rank 0 a TOKEN carrying the sampled token and the drafts;
- rank 0 embeds them as one verify batch, one row at a time (each row is the plain one-token step, so the answer is
  the plain ring's), and sends each row on as a BOUNDARY flagged with the drafts and its row index as soon as it is
  computed; every window does the same, so the windows work on successive rows at once (a pipeline: while the last
  rank samples row 0, the window before it computes row 1);
- the last rank samples each row as it arrives and stops at the first rejected draft (:class:`VerifyBatch`): the
  rows behind it are stale, dropped uncomputed;
- the next step's position says how much was kept: every node forgets its cache from that position on
  (:class:`CacheEnd`: ``Stage.truncate``) before it computes the step, which is where ``generate`` truncates too.

Frames of a request arrive in (position, row) order: the next step starts right after the accepted drafts, past the
batch's position, and a batch's rows come in row order. Replay deduplication keys on that pair, and a replayed log
rebuilds a replacement's cache with the same rows and the same truncations in the same order.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs

from kvasir.core.speculate import DraftPolicy, RowSampler, latency_bound
from kvasir.ring.compute import RingStage


@attrs.define
class CacheEnd:
    """Where one request's cache ends at one node: the next step at an earlier position means drafts were rejected."""

    end: int = 0

    def rollback(self, pos: int) -> bool:
        """Whether the cache must forget positions ``[pos, end)`` before a chunk at ``pos`` is computed."""
        return pos < self.end

    def computed(self, pos: int, n: int) -> None:
        self.end = pos + n


def window_step(
    stage: RingStage, seq: int, cache: CacheEnd, speculative: bool, pos: int, inputs: dict[str, Any]
) -> Any:
    """Worker thread: one chunk (or one verify row) through a window. A speculative step that starts before the
    cache's end follows rejected drafts: forget them first, the same point of the sequence where ``generate``
    truncates."""
    if speculative and cache.rollback(pos):
        stage.truncate(seq, pos)
    out = stage.forward(seq, pos, **inputs)
    tokens = inputs.get("tokens")
    cache.computed(pos, len(tokens) if tokens is not None else len(inputs["hidden"]))
    return out


class RowFate(enum.Enum):
    """What the last rank does with an arriving verify row (:func:`row_fate`)."""

    START = "start"  #: row 0: a new batch
    NEXT = "next"  #: the next row of the open batch: compute and sample it
    STALE = "stale"  #: a row after the batch's rejected draft: drop it uncomputed
    UNEXPECTED = "unexpected"  #: out of order, or of no batch this node has: a misbehaving predecessor


@attrs.define
class VerifyBatch:
    """Last rank: the verify batch whose rows are arriving, sampled as they come (``rows``, in ``generate``'s order
    of sampler calls); closed once a row's token differs from its draft, or after the row past the last draft."""

    position: int
    rows: RowSampler
    closed: bool = False

    def sample(self, row: int) -> list[int] | None:
        """Worker thread, after row ``row`` was computed: sample it; the batch's tokens once that closes it."""
        self.closed = self.rows(row)
        return self.rows.tokens if self.closed else None


def row_fate(batch: VerifyBatch | None, position: int, row: int) -> RowFate:
    """Pure: the fate of verify row ``row`` of the batch at ``position``, given the last batch begun (or None)."""
    if row == 0:
        return RowFate.START
    if batch is None or batch.position != position:
        return RowFate.UNEXPECTED
    if batch.closed:
        return RowFate.STALE
    return RowFate.NEXT if row == len(batch.rows.tokens) else RowFate.UNEXPECTED


#: Ring passes and rows the last rank remembers for its drafting policy, and the passes it needs before it judges.
PACE_SAMPLES = 32
PACE_MIN_PASSES = 4


@attrs.define
class RingPace:
    """Last rank: how long its steps take to come back round (from sending a TOKEN to the step's first row arriving)
    and what a decode row costs here: what ``--draft-policy auto`` decides by (:func:`latency_bound`). The least wait
    stands for the ring's latency: rows a wrong guess wasted only ever add to a wait."""

    waits: deque[float] = attrs.field(factory=lambda: deque(maxlen=PACE_SAMPLES))
    rows: deque[float] = attrs.field(factory=lambda: deque(maxlen=PACE_SAMPLES))

    def eager(self, policy: DraftPolicy, k_max: int) -> bool:
        if policy != "auto":
            return policy in ("eager", "fixed")
        if len(self.waits) < PACE_MIN_PASSES or not self.rows:
            return False
        return latency_bound(min(self.waits), statistics.median(self.rows), k_max)

    def plain_trip_s(self) -> float | None:
        """What a plain trip takes now: the median wait for a step to come back round plus a row here (None: too
        few passes seen)."""
        if len(self.waits) < PACE_MIN_PASSES or not self.rows:
            return None
        return statistics.median(self.waits) + statistics.median(self.rows)


#: Drafting trips a request's payoff is judged over, and the share of the plain rate below which it stops paying.
PAYOFF_TRIPS = 8
PAYOFF_FLOOR = 0.95


@attrs.define
class DraftPayoff:
    """Last rank, per request: the acceptance gate of ``--draft-policy auto``. Eager drafting on a latency-bound
    ring pays only while the trips right drafts save outweigh the rows wrong ones cost every window (and, where nodes
    share CPUs, each other). So the last rank times each eagerly drafted trip (from the previous trip's tokens
    sampled to its own, drafting included); once the last ``PAYOFF_TRIPS`` of them emitted fewer tokens per second
    than ``PAYOFF_FLOOR`` of a plain trip's rate (:meth:`RingPace.plain_trip_s`), the gate closes and the request
    drafts adaptively from then on (which stops drafting after a lone rejected draft and resumes on a right shadow
    guess)."""

    trips: deque[tuple[int, float]] = attrs.field(factory=lambda: deque(maxlen=PAYOFF_TRIPS))
    closed: bool = False

    def trip(self, tokens: int, seconds: float) -> None:
        self.trips.append((tokens, seconds))

    def pays(self, plain_trip_s: float | None) -> bool:
        if self.closed or plain_trip_s is None or len(self.trips) < PAYOFF_TRIPS:
            return not self.closed
        seconds = sum(s for _, s in self.trips)
        if seconds > 0 and sum(t for t, _ in self.trips) / seconds < PAYOFF_FLOOR / plain_trip_s:
            self.closed = True
        return not self.closed


@attrs.define
class TokenTrail:
    """Non-last nodes: the latest verify batch seen (its position and tokens), so the tokens a step accepted can be
    told to the node's client and the TUI: a draft is accepted once the next step starts past it."""

    pos: int = -1
    tokens: tuple[int, ...] = ()

    def step(self, pos: int, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """A step at ``pos`` feeding ``tokens``: the (position, token) pairs now known emitted, in order."""
        known = [*self.confirmed(pos), (pos, tokens[0])]
        self.pos, self.tokens = pos, tuple(tokens)
        return known

    def confirmed(self, upto: int) -> list[tuple[int, int]]:
        """The previous batch's tokens at positions before ``upto``."""
        if self.pos < 0:
            return []
        return [(self.pos + i, t) for i, t in enumerate(self.tokens) if self.pos + i < upto]
