"""The enrollment policy (kvasir.market.agent.policy.decide): pure, so checked on generated coverage maps."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from kvasir.market.agent.policy import NOTHING_FITS, Claim, OwnState, Release, Wait, decide, window_key
from kvasir.market.records import CoverageEntry

SHA, OTHER = "ab" * 32, "cd" * 32
ME = "me"


def entry(model: str, rank: int, size: int, reward: float, holder: str | None = None) -> CoverageEntry:
    start = rank * 2
    return CoverageEntry(model, rank, start, start + 2, 1.0, reward, size, "00" * 32, holder)


@st.composite
def maps(draw: st.DrawFn) -> list[CoverageEntry]:
    out = []
    for model in draw(st.lists(st.sampled_from([SHA, OTHER]), min_size=1, max_size=2, unique=True)):
        for rank in range(draw(st.integers(1, 5))):
            out.append(
                entry(
                    model,
                    rank,
                    draw(st.integers(1, 10_000)),
                    draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])),
                    draw(st.sampled_from([None, None, "x", "y"])),
                )
            )
    return out


@given(maps(), st.integers(0, 12_000), st.integers(0, 2**32), st.data())
def test_holding_nothing_claims_the_best_open_window_or_waits(
    coverage: list[CoverageEntry], budget: int, seed: int, data: st.DataObject
) -> None:
    avoid = frozenset(data.draw(st.sets(st.sampled_from([window_key(w) for w in coverage]))))
    own = OwnState(ME, avoid=avoid)
    decision = decide(coverage, own, budget, random.Random(seed))
    eligible = [w for w in coverage if not w.covered and w.bytes <= budget and window_key(w) not in avoid]
    if not eligible:
        assert decision == Wait(NOTHING_FITS)
        return
    assert isinstance(decision, Claim) and decision.window in eligible
    best = max(w.reward / w.bytes for w in eligible)
    assert decision.window.reward / decision.window.bytes >= best * (1 - 1e-9)
    assert decide(coverage, own, budget, random.Random(seed)) == decision  # the injected draw decides ties


def test_ties_spread_nodes_over_the_windows() -> None:
    coverage = [entry(SHA, r, 1000, 1.0) for r in range(4)]
    picks = set()
    for seed in range(40):
        decision = decide(coverage, OwnState(ME), 10_000, random.Random(seed))
        assert isinstance(decision, Claim)
        picks.add(decision.window.rank)
    assert picks == {0, 1, 2, 3}


def test_an_avoided_window_is_left_to_others_until_it_is_the_only_one_not_avoided() -> None:
    coverage = [entry(SHA, 0, 1000, 5.0), entry(SHA, 1, 1000, 1.0)]
    best = OwnState(ME, avoid=frozenset({window_key(coverage[0])}))
    assert decide(coverage, best, 10_000, random.Random(0)) == Claim(coverage[1])
    both = OwnState(ME, avoid=frozenset(map(window_key, coverage)))
    assert decide(coverage, both, 10_000, random.Random(0)) == Wait(NOTHING_FITS)


@given(maps(), st.integers(0, 2**32), st.data())
def test_holding_a_window_releases_it_only_when_the_map_says_it_is_not_ours(
    coverage: list[CoverageEntry], seed: int, data: st.DataObject
) -> None:
    held = data.draw(st.sampled_from(coverage))
    own = OwnState(ME, holding=window_key(held))
    decision = decide(coverage, own, 0, random.Random(seed))  # the budget plays no part while holding
    if held.holder in (None, ME):
        assert decision == Wait("serving")
    else:
        assert decision == Release(f"window {held.start}:{held.end} is held by node {held.holder}")


def test_a_window_gone_from_the_manifest_is_released_and_a_map_of_other_models_says_nothing() -> None:
    mine = entry(SHA, 1, 1000, 1.0, holder=ME)
    own = OwnState(ME, holding=window_key(mine))
    reshaped = [entry(SHA, 0, 1000, 1.0), CoverageEntry(SHA, 1, 2, 6, 1.0, 1.0, 1000, "00" * 32)]
    assert decide(reshaped, own, 10_000, random.Random(0)) == Release("window 2:4 is gone from the manifest")
    assert decide([entry(OTHER, 0, 1000, 1.0)], own, 10_000, random.Random(0)) == Wait("serving")
    assert decide([], own, 10_000, random.Random(0)) == Wait("serving")
    assert decide([mine], own, 10_000, random.Random(0)) == Wait("serving")
