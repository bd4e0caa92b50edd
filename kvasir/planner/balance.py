"""Balanced stages: contiguous windows whose slowest stage is as fast as it can be.

Under concurrent requests the stages of a ring pipeline, so throughput is bounded by the slowest stage, and the edges
are not like the middle: rank 0 also embeds the token, the last rank also runs the output head (``n_vocab × n_embd``,
262k rows on Gemma 3) and samples. An even split of the layers leaves the last rank the bottleneck. Given a cost per
layer plus the edge costs, :func:`balanced_windows` returns the split that minimises the bottleneck stage, exactly
(a dynamic programme, not a heuristic); among the splits that reach it, the one with the smallest sum of squared
stage costs (the others as even as the bottleneck allows). The costs come from measurement
(:mod:`kvasir.local.calibrate`) or from the byte estimate here (:func:`estimated_costs`), the planner's cost model.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection
from typing import Literal

import attrs

from kvasir.core.errors import InputError, WindowError
from kvasir.core.schema import register_record
from kvasir.planner.estimate import LOGITS_BYTES_PER_VOCAB
from kvasir.planner.profile import ModelProfile

CostSource = Literal["measured", "estimate"]
Window = tuple[int, int]
#: The estimate's nominal memory bandwidth: only the ratios of the costs matter to a split, not their unit.
NOMINAL_GBS = 10.0
# Two stage costs this close are one value: float sums of the same layers in another order differ in the last bits.
_REL_TOL = 1e-9


@attrs.frozen
class StageCosts:
    """What one decoded token costs a stage, in milliseconds, by part.

    A stage's cost is ``stage_ms`` (the fixed price of a decode call) plus its layers' ``layer_ms``, plus
    ``embed_ms`` on rank 0 and ``head_ms`` (output norm, head matmul, logits, sampling) on the last rank.
    """

    layer_ms: tuple[float, ...]
    embed_ms: float = 0.0
    head_ms: float = 0.0
    stage_ms: float = 0.0
    source: CostSource = "estimate"
    #: Where measured: threads per stage and the model's sha256 (empty for an estimate).
    threads: int = 0
    model_sha256: str = ""

    def __attrs_post_init__(self) -> None:
        if not self.layer_ms:
            raise InputError("stage costs need at least one layer")
        values = (*self.layer_ms, self.embed_ms, self.head_ms, self.stage_ms)
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise InputError("stage costs must be finite and >= 0")

    @property
    def n_layers(self) -> int:
        return len(self.layer_ms)

    def window_ms(self, start: int, stop: int) -> float:
        """One token's cost on the stage that runs layers ``[start, stop)``."""
        cost = self.stage_ms + math.fsum(self.layer_ms[start:stop])
        if start == 0:
            cost += self.embed_ms
        if stop == self.n_layers:
            cost += self.head_ms
        return cost

    def bottleneck_ms(self, windows: Collection[Window]) -> float:
        return max(self.window_ms(a, b) for a, b in windows)


register_record(StageCosts, forbid_extra=True)


def estimated_costs(profile: ModelProfile, *, mem_bandwidth_gbs: float = NOMINAL_GBS) -> StageCosts:
    """The planner's byte model as stage costs: decode streams every byte a token reads once.

    A layer costs its active bytes; the head its whole matrix (the ``n_vocab × n_embd`` matmul, as stored) plus the
    logits and the sampler's pass over them; the embedding one row of ``token_embd``. No fixed per-stage cost: it is
    the same on every stage and moves no cut.
    """
    if mem_bandwidth_gbs <= 0:
        raise InputError("memory bandwidth must be > 0")

    def ms(n_bytes: float) -> float:
        return n_bytes / (mem_bandwidth_gbs * 1e9) * 1e3

    row = profile.embd_bytes / profile.vocab_size if profile.vocab_size else 0.0
    return StageCosts(
        layer_ms=tuple(ms(layer.active_bytes) for layer in profile.layers),
        embed_ms=ms(row),
        head_ms=ms(profile.head_bytes + profile.vocab_size * LOGITS_BYTES_PER_VOCAB),
    )


def balanced_windows(costs: StageCosts, n_stages: int, *, allowed: Collection[int] | None = None) -> list[Window]:
    """Contiguous windows over ``costs``' layers for ``n_stages`` stages, minimising the slowest stage."""
    return min_bottleneck_windows(costs.n_layers, n_stages, costs.window_ms, allowed=allowed)


def min_bottleneck_windows(
    n_layers: int,
    n_stages: int,
    window_cost: Callable[[int, int], float],
    *,
    allowed: Collection[int] | None = None,
) -> list[Window]:
    """``n_stages`` non-empty contiguous windows covering ``[0, n_layers)`` whose largest ``window_cost(a, b)`` is the
    least possible, cutting only at ``allowed`` (default: every boundary). Ties: least sum of squared costs.

    Two dynamic programmes over (stages used, boundary), O(S·L²) each: the first finds the least bottleneck ``B``,
    the second the most even split among those whose every window costs at most ``B``.
    """
    if not 1 <= n_stages <= n_layers:
        raise WindowError(f"cannot split {n_layers} layers into {n_stages} stages")
    if allowed is None:
        cuts = list(range(n_layers + 1))
    else:
        cuts = sorted({0, n_layers} | {b for b in allowed if 0 < b < n_layers})
    if len(cuts) - 1 < n_stages:
        raise WindowError(f"only {len(cuts) - 1} windows can be cut from {n_layers} layers, not {n_stages}")
    cost = {(a, b): window_cost(a, b) for a, b in itertools.combinations(cuts, 2)}
    inf = math.inf

    # worst[s][b]: least bottleneck of s windows covering [0, b).
    worst: list[dict[int, float]] = [{0: 0.0}]
    for s in range(1, n_stages + 1):
        row: dict[int, float] = {}
        for b in cuts[s:]:
            row[b] = min((max(worst[s - 1][a], cost[a, b]) for a in cuts if a < b and a in worst[s - 1]), default=inf)
        worst.append(row)
    bottleneck = worst[n_stages][n_layers]
    cap = bottleneck * (1 + _REL_TOL) + 1e-12

    # even[s][b]: least sum of squared costs of s windows covering [0, b), none above the cap; back-pointers in prev.
    even: list[dict[int, float]] = [{0: 0.0}]
    prev: list[dict[int, int]] = [{}]
    for s in range(1, n_stages + 1):
        row, back = {}, {}
        for b in cuts[s:]:
            for a in cuts:
                if a >= b or a not in even[s - 1] or cost[a, b] > cap:
                    continue
                value = even[s - 1][a] + cost[a, b] ** 2
                if value < row.get(b, inf):
                    row[b], back[b] = value, a
        even.append(row)
        prev.append(back)
    windows: list[Window] = []
    b = n_layers
    for s in range(n_stages, 0, -1):
        a = prev[s][b]
        windows.append((a, b))
        b = a
    return windows[::-1]
