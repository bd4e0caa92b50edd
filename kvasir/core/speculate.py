"""Speculative decoding's decisions: which tokens to draft and how many (adapted to acceptance).

Drafts come from a :class:`DraftSource`, fed every token the request emits: prompt lookup (:class:`PromptLookup`,
the default), a draft model (``kvasir.stage.draftmodel``), the model's own MTP block (``kvasir.stage.mtpsource``, a
:class:`StageDraftSource`), the benchmark oracle (``kvasir.core.oracle``). How many
to ask for is the :class:`Drafter`'s schedule, the same for every source. Prompt lookup and the schedule are pure
functions of the token history and the acceptance so far, so every node of a ring (and a rerun of
``kvasir generate --speculate K``) derives the same drafts and the same verify-batch shapes from the same tokens.
Whatever a source proposes, the answer is the plain one (each verify row is the plain step). See docs/speculation.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import attrs
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

#: Longest and shortest suffix n-gram searched for in the history (longest first: a longer match predicts better).
#: Single-token matches (a comma, "the") are common and rarely predict the continuation: each costs a verify batch.
NGRAM_MAX = 3
NGRAM_MIN = 2
#: Drafts per verify batch never exceed this, whatever ``--speculate K`` asks.
K_LIMIT = 16
#: Drafts in a request's first verify batch. A verify batch of n rows can cost nearly n one-token steps (small models
#: on a CPU: docs/benchmarks.md), so a wrong first guess must be cheap; full acceptance grows K quickly.
K_START = 1
#: Eager drafting (a latency-bound ring: ``latency_bound``): n-grams down to a single token, and K back to its maximum
#: after every fully accepted batch or plain step, never off. A wrong guess then costs a row of compute, where a ring
#: pass costs many.
EAGER_NGRAM_MIN = 1
#: A ring is latency-bound when the least wait for a ring pass exceeds this many full verify batches of rows.
EAGER_FACTOR = 2.0
#: ``--draft-policy``: auto (eager when the ring is latency-bound, else adaptive), or either one always, or fixed:
#: eager with K always at its maximum (what the latency law assumes; for benchmarks with the oracle drafter).
DraftPolicy = Literal["auto", "adaptive", "eager", "fixed"]
DRAFT_POLICIES: tuple[DraftPolicy, ...] = ("auto", "adaptive", "eager", "fixed")


def draft_lookup(
    history: Sequence[int], k: int, *, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN
) -> list[int]:
    """Prompt-lookup drafts: up to ``k`` tokens that followed the most recent earlier occurrence of the history's
    longest matching suffix n-gram (``ngram_max`` down to ``ngram_min`` tokens). Empty when nothing matches."""
    if k <= 0 or len(history) < 2:
        return []
    arr = np.asarray(history, dtype=np.int64)
    for n in range(min(ngram_max, len(arr) - 1), ngram_min - 1, -1):
        # Windows start at i <= len - 1 - n, so each has a following token and the suffix itself is excluded.
        windows = sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in arr[start : start + k]]
    return []


@attrs.define
class NgramIndex:
    """:func:`draft_lookup` in O(1) per step for a history that only grows: for every n-gram of the history
    (``ngram_min``…``ngram_max`` tokens) that a token follows, where that token stands in its latest occurrence. The
    answers are :func:`draft_lookup`'s; a step no longer scans the whole history (tens of µs on a few hundred tokens,
    on the last rank's path between sampling and sending the next step)."""

    history: list[int] = attrs.field(factory=list)
    ngram_max: int = NGRAM_MAX
    ngram_min: int = NGRAM_MIN
    _follows: dict[tuple[int, ...], int] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        tokens, self.history = self.history, []
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        self.history.append(token)
        end = len(self.history) - 1  # the n-grams ending just before the new token now have a follower: it
        for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
            self._follows[tuple(self.history[end - n : end])] = end

    def lookup(self, k: int, ngram_min: int | None = None) -> list[int]:
        """:func:`draft_lookup` (history, k) with this index's n-gram bounds (``ngram_min`` may narrow them)."""
        h = self.history
        if k <= 0 or len(h) < 2:
            return []
        n_min = self.ngram_min if ngram_min is None else max(self.ngram_min, ngram_min)
        for n in range(min(self.ngram_max, len(h) - 1), n_min - 1, -1):
            start = self._follows.get(tuple(h[len(h) - n :]))
            if start is not None:
                return h[start : start + k]
        return []


def initial_k(k_max: int) -> int:
    """The draft budget of a request's first step."""
    return min(k_max, K_START)


def adapt_k(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """The next draft budget: grow by 2 after a fully accepted batch, else shrink to one more than was accepted (at
    least 1), and to 0 (drafting off, see :func:`resume_k`) when a lone draft was rejected. A step without drafts
    says nothing about them and keeps ``k``."""
    if drafted == 0:
        return k
    if accepted >= drafted:
        return min(k_max, k + 2)
    if accepted == 0 and k <= 1:
        return 0
    return max(1, min(k - 1, accepted + 1))


def eager_k(drafted: int, accepted: int, k_max: int) -> int:
    """The next draft budget when drafting eagerly: the maximum after a fully accepted batch or a step without drafts,
    else two more than were accepted (a partial match often goes on after a correction)."""
    return k_max if drafted == 0 or accepted >= drafted else min(k_max, accepted + 2)


def latency_bound(wait_s: float, row_s: float, k_max: int) -> bool:
    """Whether a ring should draft eagerly: the least time a step took to come back round (``wait_s``: from sending
    it to its first row arriving at the last rank) exceeds ``EAGER_FACTOR`` verify batches of ``k_max`` rejected rows
    at ``row_s`` each (the last rank's compute per row, standing for a window's). There a ring pass saved by a right
    guess outweighs the rows a wrong one wastes; on a compute-bound ring (loopback, one machine) it does not."""
    return wait_s > EAGER_FACTOR * k_max * row_s


def resume_k(shadow: Sequence[int], sampled: int, k_max: int) -> int:
    """While drafting is off (k = 0): the draft a step would have made (``shadow``, one token, looked up as usual
    but not verified) and the token the step sampled. A right guess turns drafting back on at 1, so text where drafts
    fail costs no verify batches, and text that starts repeating is noticed."""
    return min(k_max, 1) if shadow and shadow[0] == sampled else 0


@attrs.frozen
class SpeculationStats:
    """What a speculative generation did: verify batches run, drafts offered and accepted, plain steps."""

    verify_batches: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_steps: int = 0
    #: Steps drafted eagerly (``latency_bound``).
    eager_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def after(self, drafted: int, accepted: int, *, eager: bool = False) -> SpeculationStats:
        eager_steps = self.eager_steps + eager
        if drafted == 0:
            return attrs.evolve(self, plain_steps=self.plain_steps + 1, eager_steps=eager_steps)
        return attrs.evolve(
            self,
            verify_batches=self.verify_batches + 1,
            drafted=self.drafted + drafted,
            accepted=self.accepted + accepted,
            eager_steps=eager_steps,
        )

    def to_json(self) -> dict[str, int | float]:
        return {**attrs.asdict(self), "acceptance": round(self.acceptance, 4)}


@attrs.define
class RowSampler:
    """Last rank: samples a verify batch as the stage computes it (``forward_verify``'s ``until``): row 0, then the
    next row while the sampled token equals the next draft (``generate``'s order of sampler calls, one per emitted
    token). The rows after a rejected draft are never computed."""

    sample: Callable[[], int]
    drafts: Sequence[int]
    tokens: list[int] = attrs.field(factory=list)

    def __call__(self, row: int) -> bool:
        token = self.sample()
        self.tokens.append(token)
        return row >= len(self.drafts) or token != self.drafts[row]


def verify_rows(
    forward: Callable[..., Any],
    n: int,
    *,
    tokens: Sequence[int] | None,
    hidden: Any,
    until: Callable[[int], bool] | None,
) -> list[Any]:
    """A verify batch of ``n`` rows one row at a time: ``forward(i, tokens=[row i]|hidden=row i)`` each (a stage's
    one-token step at the batch's position + i). The boundaries the rows returned; where ``forward`` returns None (a
    last stage), ``until(i)`` after row ``i`` and True ends the batch there."""
    rows = []
    for i in range(n):
        out = forward(
            i,
            tokens=None if tokens is None else tokens[i : i + 1],
            hidden=None if hidden is None else hidden[i : i + 1],
        )
        if out is not None:
            rows.append(out)
        elif until is not None and until(i):
            break
    return rows


class DraftSource(Protocol):
    """Where one request's drafts come from (docs/speculation.md § Drafters). It is fed every token the request
    emits (after the prompt it was made for) and asked for up to ``k`` tokens to follow them; :class:`Drafter` decides
    ``k``. A source must be deterministic in what it was fed and asked (a replaced last rank re-drafts the same
    tokens: failover compares them)."""

    #: True when :meth:`propose` computes (a model): the ring's last rank then calls it in a worker thread.
    @property
    def blocking(self) -> bool: ...

    def emitted(self, token: int) -> None:
        """The request emitted ``token`` (an accepted draft or a sampled token), in order."""

    def propose(self, k: int, *, eager: bool = False) -> list[int]:
        """Up to ``k`` tokens to follow the tokens fed so far (fewer, or none, when it has no guess). ``eager``: the
        ring is latency-bound, a weaker guess is worth a row (prompt lookup then accepts 1-token matches)."""

    def close(self) -> None:
        """The request ended: free what the source holds for it (idempotent)."""


@runtime_checkable
class StageDraftSource(DraftSource, Protocol):
    """A source that computes on the drafting stage's own model (the MTP block, docs/mtp.md): it reads what the
    stage computed for the request, so it is told each computed row (in the worker call that computed them, before
    anything else runs on the stage), and its proposals run on the stage's worker, one computation at a time with
    the stage's own."""

    def computed(self, pos0: int, n: int) -> None:
        """Worker thread: the stage just computed rows ``pos0 … pos0 + n - 1`` of the request's true sequence."""


#: Makes a request's draft source from its prompt and its sequence id at the drafting node (a model's cache slot).
DraftSources = Callable[[Sequence[int], int], DraftSource]


@attrs.define
class PromptLookup:
    """The default source: prompt lookup over prompt + output (:class:`NgramIndex`); free, so never blocking."""

    index: NgramIndex
    blocking = False

    @classmethod
    def for_prompt(cls, prompt: Sequence[int], _seq: int = 0) -> PromptLookup:
        return cls(NgramIndex(list(prompt), ngram_min=min(EAGER_NGRAM_MIN, NGRAM_MIN)))

    def emitted(self, token: int) -> None:
        self.index.append(token)

    def propose(self, k: int, *, eager: bool = False) -> list[int]:
        return self.index.lookup(k, EAGER_NGRAM_MIN if eager else NGRAM_MIN)

    def close(self) -> None:
        pass


@attrs.define
class Drafter:
    """One speculative request's drafting state (its draft source and the adapted K): the ring's last rank and
    ``generate --speculate K`` draft with it, so both follow the same schedule."""

    k_max: int
    k: int
    #: Where the drafts come from, fed the prompt and every emitted token.
    source: DraftSource
    stats: SpeculationStats = attrs.field(factory=SpeculationStats)
    #: While drafting is off: the guess the step in flight would have drafted (``resume_k``).
    shadow: list[int] = attrs.field(factory=list)
    #: Whether the step in flight was drafted eagerly (``drafts(eager=True)``).
    eager: bool = False
    #: ``--draft-policy fixed``: every step asks for ``k_max`` drafts, eagerly, whatever was accepted.
    fixed: bool = False

    @classmethod
    def for_prompt(
        cls, prompt: Sequence[int], k_max: int, source: DraftSource | None = None, *, fixed: bool = False
    ) -> Drafter:
        """A request's drafter; ``source`` None: prompt lookup over ``prompt``; ``fixed``: ``--draft-policy fixed``."""
        k = k_max if fixed else initial_k(k_max)
        return cls(k_max=k_max, k=k, source=source or PromptLookup.for_prompt(prompt), fixed=fixed)

    @property
    def blocking(self) -> bool:
        """Whether :meth:`drafts` computes (call it off the event loop)."""
        return self.source.blocking

    @property
    def on_stage(self) -> bool:
        """Whether :meth:`drafts` computes on the drafting stage's model (run it on the stage's worker)."""
        return isinstance(self.source, StageDraftSource)

    def computed(self, pos0: int, n: int) -> None:
        """Worker thread: the drafting stage computed rows ``pos0 …`` of the true sequence (a :class:`StageDraftSource`
        reads them; other sources need nothing)."""
        if isinstance(self.source, StageDraftSource):
            self.source.computed(pos0, n)

    def emitted(self, token: int) -> None:
        self.source.emitted(token)

    def close(self) -> None:
        self.source.close()

    def verified(self, drafted: int, accepted: int, sampled: int) -> None:
        """A step with ``drafted`` drafts kept ``accepted`` of them and sampled ``sampled`` first: count it, adapt K."""
        self.stats = self.stats.after(drafted, accepted, eager=self.eager)
        if self.fixed:
            self.k = self.k_max
        elif self.eager:
            self.k = eager_k(drafted, accepted, self.k_max)
        elif self.k == 0:
            self.k = resume_k(self.shadow, sampled, self.k_max)
        else:
            self.k = adapt_k(self.k, drafted, accepted, self.k_max)

    def drafts(self, may_emit: int, *, eager: bool = False) -> list[int]:
        """Drafts for the next step when at most ``may_emit`` more tokens may be emitted (drafts + one sample);
        ``eager``: the ring is latency-bound (``latency_bound``), draft as much as can be guessed."""
        self.eager = (eager or self.fixed) and self.k_max > 0
        if self.eager and self.k == 0:
            self.k = self.k_max  # drafting was off: a latency-bound ring turns it back on at once
        # The shadow: only while drafting is off (k = 0), the one-token guess resume_k checks after the step.
        self.shadow = self.source.propose(1) if self.k == 0 and self.k_max > 0 else []
        k = min(self.k, may_emit - 1)
        return self.source.propose(k, eager=self.eager)[:k] if k > 0 else []
