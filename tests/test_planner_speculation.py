"""The latency law with speculation (kvasir.planner.speculation) and ``kvasir plan --accept``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvasir.cli
from kvasir.core.errors import InputError
from kvasir.core.oracle import coin
from kvasir.planner.speculation import (
    accepted_per_trip,
    best_k,
    estimate_speculation,
    law_tokens_per_s,
    trip_ms,
)

FLEET = Path(__file__).resolve().parent.parent / "examples" / "devices-mixed.toml"


def test_tokens_per_trip_closed_form() -> None:
    assert accepted_per_trip(0.0, 8) == 1.0  # nothing accepted: one sampled token per trip
    assert accepted_per_trip(1.0, 8) == 9.0
    assert accepted_per_trip(0.5, 0) == 1.0
    assert accepted_per_trip(0.8, 8) == pytest.approx(sum(0.8**i for i in range(9)))
    with pytest.raises(InputError):
        accepted_per_trip(1.2, 3)


@pytest.mark.parametrize(("alpha", "k"), [(0.3, 4), (0.8, 8), (0.95, 6)])
def test_tokens_per_trip_match_the_oracles_coins(alpha: float, k: int) -> None:
    """Simulate trips as the oracle drafts them (a coin per output position; the first wrong draft ends a trip and
    the sampled token after it is the truth): the mean tokens per trip is the formula's."""
    pos, trips = 0, 0
    while pos < 60_000:
        accepted = 0
        while accepted < k and coin(1, pos + accepted) < alpha:
            accepted += 1
        pos += accepted + 1
        trips += 1
    assert pos / trips == pytest.approx(accepted_per_trip(alpha, k), rel=0.03)


def test_the_law_and_the_rows() -> None:
    assert law_tokens_per_s(2.0, 20.0, 80.0) == pytest.approx(20.0)  # 2 tokens per 100 ms trip
    # Two accepted rows more through the slowest window; at most 3 + 1 rows of it per trip when hops are short.
    assert trip_ms([5.0, 10.0, 5.0], 60.0, 3, 3.0) == pytest.approx(80.0 + 20.0)
    assert trip_ms([5.0, 10.0, 5.0], 0.0, 3, 1.0) == pytest.approx(40.0)
    # Latency-bound ring: draft as much as the acceptance carries; no acceptance: never draft.
    assert best_k(0.9, [1.0] * 4, 200.0) >= 8
    assert best_k(0.0, [1.0] * 4, 200.0) == 0
    # One window, no hops: a row costs what a trip does, so drafting never pays (row by row).
    assert best_k(0.9, [10.0], 0.0) == 0
    # Compute-bound ring: a window idles while the others compute, so a few rows fit in its idle time.
    assert 1 <= best_k(0.5, [10.0] * 4, 0.0) <= 4
    est = estimate_speculation(0.8, [2.0] * 4, 80.0, 4)
    assert est.g == pytest.approx(accepted_per_trip(0.8, 4))
    assert est.plain_tokens_per_s == pytest.approx(1e3 / 88.0)
    assert est.law_tokens_per_s == pytest.approx(est.g * est.plain_tokens_per_s)
    assert est.tokens_per_s == pytest.approx(1e3 * est.g / (88.0 + 2.0 * (est.g - 1.0)))


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(kvasir.cli, "_COMMAND_MODULES", ("kvasir.commands.plan",))
    return kvasir.cli.main


def test_plan_accept(cli: Any, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(FLEET)]
    assert cli([*base, "--accept", "0.7"]) == 0
    assert "with speculation at acceptance 0.7, K=" in capsys.readouterr().out
    assert cli([*base, "--accept", "0.7", "--speculate", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    spec = doc["speculation"]
    assert spec["k"] == 4 and spec["g"] == pytest.approx(accepted_per_trip(0.7, 4), abs=1e-3)
    assert spec["plain_tokens_per_s"] == pytest.approx(doc["est_tokens_per_s"], rel=1e-3)
    assert cli([*base, "--accept", "1.5"]) == 2
    assert "--accept must be in [0, 1]" in capsys.readouterr().err
    assert cli([*base, "--speculate", "3"]) == 2  # K without an acceptance to estimate with
