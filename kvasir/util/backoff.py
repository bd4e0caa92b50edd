"""Jittered exponential backoff for redial loops.

Pure: the randomness comes from the ``rng`` passed in, so tests can pin it. "Equal jitter": each delay lies in
``[base * (1 - jitter), base]``, so peers that lost a link at the same moment (a relay restart) spread their redials
instead of retrying in lockstep, while a delay never exceeds the ``maximum``.
"""

from __future__ import annotations

import random

import attrs


def jittered(base: float, jitter: float, rng: random.Random) -> float:
    """``base`` shortened by up to ``jitter`` (a fraction in [0, 1]) of itself, drawn from ``rng``."""
    return base * (1.0 - jitter * rng.random())


@attrs.define
class Backoff:
    """Delays that double from ``initial`` up to ``maximum``; ``reset()`` after a success."""

    initial: float = 0.05
    maximum: float = 2.0
    factor: float = 2.0
    jitter: float = 0.5
    rng: random.Random = attrs.field(factory=random.Random)
    _base: float | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum or self.factor < 1 or not 0 <= self.jitter <= 1:
            raise ValueError("backoff needs 0 < initial <= maximum, factor >= 1 and jitter in [0, 1]")

    def next(self, *, at_least: float = 0.0) -> float:
        """The delay before the next attempt; ``at_least`` raises this attempt's base (e.g. after a refusal)."""
        base = self.initial if self._base is None else min(self._base * self.factor, self.maximum)
        base = min(max(base, at_least), self.maximum)
        self._base = base
        return jittered(base, self.jitter, self.rng)

    def reset(self) -> None:
        self._base = None
