"""Speculative decoding in the ring: what each node keeps per request, and the decisions (pure where they can be).

The schedule is ``kvasir generate --speculate K``'s (docs/speculation.md), split across the ring:

- the last rank knows the tokens: after each step it drafts (``kvasir.core.speculate.Drafter``, prompt lookup over
  prompt + output, the same object ``generate`` drafts with)
  and sends rank 0 a TOKEN carrying the sampled token and the drafts;
- rank 0 embeds them as one verify batch; every window runs it one row at a time (``forward_verify``: each row is
  the plain one-token step, so the answer is the plain ring's) and passes a BOUNDARY flagged with the drafts;
- the last rank samples each row as it is computed and stops at the first rejected draft (:class:`RowSampler`);
- the next step's position says how much was kept: every node forgets its cache from that position on
  (:class:`CacheEnd`: ``Stage.truncate``) before it computes the step, which is where ``generate`` truncates too.

Every frame of a request starts at a higher position than the one before (the next step starts right after the
accepted drafts), so replay deduplication by position still holds, and a replayed log rebuilds a replacement's
cache with the same verify batches and the same truncations in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvasir.core.speculate import RowSampler
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
    stage: RingStage,
    seq: int,
    cache: CacheEnd,
    speculative: bool,
    pos: int,
    verify: bool,
    inputs: dict[str, Any],
    rows: RowSampler | None = None,
) -> Any:
    """Worker thread: one chunk through a window (``forward``, or ``forward_verify`` for a verify batch, sampled by
    ``rows`` on the last rank). A speculative step that starts before the cache's end follows rejected drafts:
    forget them first, the same point of the sequence where ``generate`` truncates."""
    if speculative and cache.rollback(pos):
        stage.truncate(seq, pos)
    out = stage.forward_verify(seq, pos, until=rows, **inputs) if verify else stage.forward(seq, pos, **inputs)
    tokens = inputs.get("tokens")
    n = len(tokens) if tokens is not None else len(inputs["hidden"])
    cache.computed(pos, len(rows.tokens) if verify and rows is not None else n)
    return out


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
