"""The planner: contiguous layer windows over a ring of devices, minimising decode time per token.

For one cyclic device order the problem is a shortest path: windows go to devices in ring order, any device
may be skipped, and the cost is the sum of each rank's compute time plus each hop (the ring closes with the
token hop from the last rank to rank 0). :func:`_solve_order` is a dynamic programme over (layer boundary,
device) for every rotation of the order; :func:`plan` runs it over a few candidate orders. With additive link
latencies and the slower end's bandwidth per hop (see ``estimate.hop_ms``), the latency total depends only on
which devices are used, and the bandwidth term is smallest when the ring visits devices sorted by link
bandwidth, so a handful of sorted orders covers what ordering can win; small fleets try every order.

Each partial plan carries a second number beside its time: its busiest rank's compute (or link's transfer) per token,
the bound on throughput once requests pipeline. Equally fast plans are told apart by it (the balanced split, head
included, wins), and ``objective="throughput"`` minimises it first (docs/planner.md, "Balanced stages").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal

from kvasir.core.errors import InputError
from kvasir.planner.devices import Device, check_unique
from kvasir.planner.estimate import (
    DEFAULT_N_CTX,
    RESERVE_BYTES,
    TOKEN_FRAME_BYTES,
    RankManifest,
    UnusedDevice,
    WindowCost,
    boundary_bytes,
    compute_ms,
    estimate,
    hop_ms,
    transfer_ms,
    window_cost,
)
from kvasir.planner.profile import ModelProfile
from kvasir.planner.rules import allowed_boundaries

# Fleets up to this size try every cyclic order ((n-1)! of them).
EXHAUSTIVE_ORDER_LIMIT = 5
_GB = 1e9

Assignment = tuple[tuple[Device, int, int], ...]
Objective = Literal["latency", "throughput"]
OBJECTIVES: tuple[Objective, ...] = ("latency", "throughput")
#: (ms per token, bottleneck ms): one request's decode time, and the busiest rank's or link's time per token.
Score = tuple[float, float]


def plan(
    profile: ModelProfile,
    devices: Sequence[Device],
    *,
    order: Sequence[str] | None = None,
    n_ctx: int = DEFAULT_N_CTX,
    n_seq: int = 1,
    objective: Objective = "latency",
) -> RankManifest:
    """The fastest plan whose every rank fits its device's memory.

    ``objective``: ``latency`` (default) minimises the estimated decode time of one request per token, and among
    equally fast plans takes the one whose busiest rank is least busy (the head and the embedding included);
    ``throughput`` minimises that bottleneck first (what bounds the total tokens/s of many requests in flight),
    then the time per token.

    ``order`` fixes the cyclic ring order by device name (every device once); the planner still picks rank 0
    and may leave devices out. Without it the planner tries several orders. Raises :class:`InputError` when no
    plan fits, and :class:`~kvasir.core.errors.UnsupportedArchitecture` for an arch without window rules.
    """
    if not devices:
        raise InputError("no devices to plan for")
    if n_ctx < 1 or n_seq < 1:
        raise InputError("n_ctx and n_seq must be >= 1")
    if objective not in OBJECTIVES:
        raise InputError(f"objective must be one of {', '.join(OBJECTIVES)}, not {objective!r}")
    check_unique(devices)
    allowed = allowed_boundaries(profile)
    by_name = {d.name: d for d in devices}
    if order is not None:
        if sorted(order) != sorted(by_name):
            raise InputError(f"order must name every device exactly once: {', '.join(by_name)}")
        candidates = [tuple(by_name[name] for name in order)]
    else:
        candidates = _candidate_orders(tuple(devices))

    costs = _window_costs(profile, allowed, n_ctx=n_ctx, n_seq=n_seq)
    best: tuple[Score, Assignment] | None = None
    for ring in candidates:
        found = _solve_order(profile, ring, costs, objective)
        if found is not None and (best is None or _better(found, best, objective)):
            best = found
    if best is None:
        raise InputError(_no_fit_reason(profile, devices, costs))
    used = {device.name for device, _, _ in best[1]}
    manifest = estimate(profile, best[1], n_ctx=n_ctx, n_seq=n_seq)
    unused = tuple(UnusedDevice(d, _unused_reason(profile, d, manifest, costs)) for d in devices if d.name not in used)
    return estimate(profile, best[1], n_ctx=n_ctx, n_seq=n_seq, unused=unused, objective=objective)


def _better(a: tuple[Score, Assignment], b: tuple[Score, Assignment], objective: Objective) -> bool:
    """The better score wins; within float noise, fewer ranks (fewer things to go wrong)."""
    if _less(a[0], b[0], objective) or _less(b[0], a[0], objective):
        return _less(a[0], b[0], objective)
    return len(a[1]) < len(b[1])


def _candidate_orders(devices: tuple[Device, ...]) -> list[tuple[Device, ...]]:
    orders: list[tuple[Device, ...]] = [devices]
    if len(devices) <= EXHAUSTIVE_ORDER_LIMIT:
        # Rotations are tried by the solver, so fixing the first device loses nothing.
        orders += [(devices[0], *rest) for rest in itertools.permutations(devices[1:])]
    else:
        by_link = sorted(devices, key=lambda d: (-d.link_bandwidth_mbps, d.link_latency_ms, d.name))
        orders += [
            tuple(by_link),
            tuple(reversed(by_link)),
            tuple(sorted(devices, key=lambda d: (-d.mem_bandwidth_gbs, d.name))),
            tuple(sorted(devices, key=lambda d: (-d.memory_gb, d.name))),
        ]
    unique: dict[tuple[str, ...], tuple[Device, ...]] = {}
    for o in orders:
        unique.setdefault(tuple(d.name for d in o), o)
    return list(unique.values())


def _window_costs(
    profile: ModelProfile, allowed: frozenset[int], *, n_ctx: int, n_seq: int
) -> dict[tuple[int, int], WindowCost]:
    """Every window that starts and ends on allowed cuts."""
    n = profile.n_layers
    cuts = sorted({0, n} | allowed)
    return {
        (a, b): window_cost(profile, a, b, n_ctx=n_ctx, n_seq=n_seq)
        for ia, a in enumerate(cuts)
        for b in cuts[ia + 1 :]
    }


def _solve_order(
    profile: ModelProfile,
    ring: Sequence[Device],
    costs: dict[tuple[int, int], WindowCost],
    objective: Objective = "latency",
) -> tuple[Score, Assignment] | None:
    """Best plan over every rotation of ``ring`` (each rotation fixes rank 0), or None when nothing fits."""
    best: tuple[Score, Assignment] | None = None
    for shift in range(len(ring)):
        rotated = tuple(ring[shift:]) + tuple(ring[:shift])
        found = _solve_rotation(profile, rotated, costs, objective)
        if found is not None and (best is None or _better(found, best, objective)):
            best = found
    return best


def _solve_rotation(
    profile: ModelProfile,
    devs: tuple[Device, ...],
    costs: dict[tuple[int, int], WindowCost],
    objective: Objective = "latency",
) -> tuple[Score, Assignment] | None:
    """DP for a fixed device sequence whose first device is rank 0; later devices may be skipped.

    ``f[b][j]``: best score of layers ``[0, b)`` with device ``j`` the last used, its window ending at ``b``.
    ``g[a][j]``: best ``f[a][i] + hop(i, j)`` over earlier devices ``i``, i.e. the score of handing layer
    ``a`` to device ``j``. Both keep back-pointers. A score is (ms per token, bottleneck ms): a step adds its
    time to the first and raises the second to its own busy time; ``objective`` says which is compared first.
    """
    n, m = profile.n_layers, len(devs)
    inf: Score = (math.inf, math.inf)
    boundary = boundary_bytes(profile)
    hop = [[hop_ms(devs[i], devs[j], boundary) for j in range(m)] for i in range(m)]
    busy = [[transfer_ms(devs[i], devs[j], boundary) for j in range(m)] for i in range(m)]
    budget = [d.memory_bytes for d in devs]
    cuts = sorted({a for a, _ in costs} | {n})
    f = {b: [inf] * m for b in cuts}
    f_from: dict[tuple[int, int], tuple[int, int]] = {}  # (b, j) -> (a, i); i == -1 for rank 0
    g = {a: [inf] * m for a in cuts}
    g_from: dict[tuple[int, int], int] = {}
    for b in cuts[1:]:
        for j in range(m):
            if j == 0:
                cost = costs[0, b]
                if cost.memory_bytes <= budget[0]:
                    t = compute_ms(devs[0], cost.active_bytes)
                    f[b][0] = (t, t)
                    f_from[b, 0] = (0, -1)
                continue
            for a in cuts:
                if a == 0 or a >= b or g[a][j] == inf:
                    continue
                cost = costs[a, b]
                if cost.memory_bytes > budget[j]:
                    continue
                value = _step(g[a][j], compute_ms(devs[j], cost.active_bytes))
                if _less(value, f[b][j], objective):
                    f[b][j] = value
                    f_from[b, j] = (a, g_from[a, j])
        if b == n:
            break
        for j in range(1, m):
            for i in range(j):
                if f[b][i] == inf:
                    continue
                value = _step(f[b][i], hop[i][j], busy[i][j])
                if _less(value, g[b][j], objective):
                    g[b][j] = value
                    g_from[b, j] = i

    best, best_j = inf, -1
    for j in range(m):
        if f[n][j] == inf:
            continue
        closing = TOKEN_FRAME_BYTES
        total = (
            _step(f[n][j], hop_ms(devs[j], devs[0], closing), transfer_ms(devs[j], devs[0], closing)) if j else f[n][j]
        )
        if best_j < 0 or _less(total, best, objective):
            best, best_j = total, j
    if best_j < 0:
        return None
    windows: list[tuple[Device, int, int]] = []
    b, j = n, best_j
    while j >= 0:
        a, i = f_from[b, j]
        windows.append((devs[j], a, b))
        b, j = a, i
    return best, tuple(reversed(windows))


def _step(score: Score, ms: float, busy_ms: float | None = None) -> Score:
    """``score`` after one more step taking ``ms`` of the token's time and occupying its resource ``busy_ms``
    (a rank's compute: all of it; a hop: the transfer, not the latency)."""
    return score[0] + ms, max(score[1], ms if busy_ms is None else busy_ms)


def _less(a: Score, b: Score, objective: Objective) -> bool:
    """``a`` strictly better than ``b``; values within float noise of each other are equal."""
    order = (0, 1) if objective == "latency" else (1, 0)
    for k in order:
        if not math.isclose(a[k], b[k], rel_tol=1e-12, abs_tol=1e-12):
            return a[k] < b[k]
    return False


def _gb(n: float) -> str:
    return f"{n / _GB:.1f} GB"


def _no_fit_reason(profile: ModelProfile, devices: Sequence[Device], costs: dict[tuple[int, int], WindowCost]) -> str:
    offered = sum(d.memory_bytes for d in devices)
    whole = costs[0, profile.n_layers].memory_bytes
    if offered < whole:
        return (
            f"no plan fits: total memory short by {_gb(whole - offered)} "
            f"({profile.name} needs at least {_gb(whole)}, the devices offer {_gb(offered)})"
        )
    largest = max(d.memory_bytes for d in devices)
    smallest = min(c.memory_bytes for c in costs.values())
    if smallest > largest:
        return f"no plan fits: the smallest window needs {_gb(smallest)}, the largest device budget is {_gb(largest)}"
    return (
        f"no plan fits: {profile.name} needs {_gb(whole)} on one rank and about {_gb(RESERVE_BYTES)} more per extra "
        f"rank, plus padding; no contiguous split fits the budgets ({_gb(offered)} in all)"
    )


def _unused_reason(
    profile: ModelProfile, device: Device, manifest: RankManifest, costs: dict[tuple[int, int], WindowCost]
) -> str:
    smallest = min(c.memory_bytes for c in costs.values())
    if smallest > device.memory_bytes:
        return f"too little memory: its smallest window needs {_gb(smallest)}, budget {_gb(device.memory_bytes)}"
    ring = [w.device for w in manifest.windows]
    boundary = boundary_bytes(profile)
    added = math.inf
    for k, prev in enumerate(ring):
        nxt = ring[(k + 1) % len(ring)]
        closing = k == len(ring) - 1
        old = hop_ms(prev, nxt, TOKEN_FRAME_BYTES if closing else boundary)
        new = hop_ms(prev, device, boundary) + hop_ms(device, nxt, TOKEN_FRAME_BYTES if closing else boundary)
        added = min(added, new - old)
    link = f"joining adds ≥ {added:.2f} ms of hops per token"
    # A used device at least as fast with room for another layer would take any layer this one could.
    min_layer = min(layer.bytes for layer in profile.layers)
    roomy = [
        w.device
        for w in manifest.windows
        if w.device.mem_bandwidth_gbs >= device.mem_bandwidth_gbs
        and w.device.memory_bytes - w.memory_bytes >= min_layer
    ]
    if roomy:
        faster = max(roomy, key=lambda d: d.mem_bandwidth_gbs)
        than = "slower memory" if faster.mem_bandwidth_gbs > device.mem_bandwidth_gbs else "memory no faster"
        return (
            f"not needed: {than} ({device.mem_bandwidth_gbs:g} GB/s) than {faster.name} "
            f"({faster.mem_bandwidth_gbs:g} GB/s, which has room); {link}"
        )
    return f"not needed: the ring is faster without it ({link})"
