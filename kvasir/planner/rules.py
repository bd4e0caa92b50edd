"""Where an architecture may be cut, and what a window costs besides its own layers.

Every supported architecture may be cut at every layer boundary (docs/stage-gguf.md: chained stage files are
bit-exact for every split tried, 1-layer windows included). What differs is the price of some windows: the
hybrid Qwen3.5 cache (``qwen35``, ``qwen35moe``) needs at least one full-attention and one recurrent layer in
every stage, so a window lacking a kind is padded with one identity copy of a layer of that kind (zeroed output
projections). The copy weighs as much as the real layer, runs like one, and an attention copy keeps a KV cache,
so the planner charges it in memory and time.
"""

from __future__ import annotations

from kvasir.core.errors import UnsupportedArchitecture
from kvasir.planner.profile import LayerKind, ModelProfile
from kvasir.shard.arch import SUPPORTED

# The slicer's window rules are the planner's: one table of archs (kvasir/shard/arch.py).
SUPPORTED_ARCHS: frozenset[str] = frozenset(SUPPORTED)
# Archs whose stages need one layer of each kind present (identity padding otherwise).
HYBRID_ARCHS: frozenset[str] = frozenset(name for name, rules in SUPPORTED.items() if rules.needs_both_kinds)


def check_arch(profile: ModelProfile) -> None:
    if profile.arch not in SUPPORTED_ARCHS:
        raise UnsupportedArchitecture(
            f"no window rules for architecture {profile.arch!r} (supported: {', '.join(sorted(SUPPORTED_ARCHS))})"
        )


def allowed_boundaries(profile: ModelProfile) -> frozenset[int]:
    """Layer indices ``b`` (0 < b < n_layers) where one window may end and the next begin.

    Every boundary, for every supported architecture; hybrid windows pay for padding instead (see
    :func:`padding_layers`). Raises :class:`UnsupportedArchitecture` for an arch without rules.
    """
    check_arch(profile)
    return frozenset(range(1, profile.n_layers))


def padding_layers(profile: ModelProfile, start: int, stop: int) -> tuple[int, ...]:
    """Layers whose identity copies pad the window ``[start, stop)``, one per missing kind.

    The stage slicer may copy any real layer of the missing kind; the planner budgets the largest, so the plan
    stays within memory whichever it picks.
    """
    if profile.arch not in HYBRID_ARCHS:
        return ()
    present = {profile.layers[i].kind for i in range(start, stop)}
    pads: list[int] = []
    kinds: tuple[LayerKind, ...] = ("attention", "recurrent")
    for kind in kinds:
        if kind in present:
            continue
        candidates = [i for i, layer in enumerate(profile.layers) if layer.kind == kind]
        if candidates:  # a kind the model lacks altogether needs no padding
            pads.append(max(candidates, key=lambda i: (profile.layers[i].bytes, -i)))
    return tuple(pads)
