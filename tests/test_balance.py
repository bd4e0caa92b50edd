"""Balanced stages: the min-bottleneck split against brute force, the head-heavy case, the byte estimate, calibration
on the real Gemma 3 270M, the planner's throughput objective, and a balanced ring that still answers bit-exactly."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir.core.errors import InputError, WindowError
from kvasir.core.schema import structure
from kvasir.local import balance as local_balance
from kvasir.local.balance import calibration_path, measured_costs, ring_costs, split_windows
from kvasir.planner import Device, LayerProfile, ModelProfile, estimate, plan, profile_from_gguf
from kvasir.planner.balance import StageCosts, balanced_windows, estimated_costs, min_bottleneck_windows
from kvasir.shard.cache import even_splits, model_sha256
from tests.conftest import run_cli
from tests.ringutil import ring_generate, running_ring, whole_model_tokens

PROMPT = "The three primary colors are"


def all_splits(n: int, k: int) -> list[list[tuple[int, int]]]:
    return [list(itertools.pairwise((0, *cuts, n))) for cuts in itertools.combinations(range(1, n), k - 1)]


# ------------------------------------------------------------------------------------------------ the pure split


def test_head_heavy_last_stage_gets_fewer_layers() -> None:
    costs = StageCosts(layer_ms=(1.0,) * 18, head_ms=6.0)
    windows = balanced_windows(costs, 3)
    assert windows == [(0, 8), (8, 16), (16, 18)]
    assert costs.bottleneck_ms(windows) == 8.0
    assert costs.bottleneck_ms(even_splits(18, 3)) == 12.0


def test_a_head_heavier_than_a_stage_leaves_the_last_rank_one_layer() -> None:
    costs = StageCosts(layer_ms=(1.0,) * 18, head_ms=30.0, embed_ms=2.0, stage_ms=0.5)
    windows = balanced_windows(costs, 4)
    assert windows[-1] == (17, 18)
    # The other stages share the rest as evenly as whole layers allow (the embedding counts on rank 0).
    loads = [costs.window_ms(a, b) for a, b in windows[:-1]]
    assert max(loads) - min(loads) <= 1.0 and sum(b - a for a, b in windows[:-1]) == 17


def test_embedding_heavy_first_stage_gets_fewer_layers() -> None:
    costs = StageCosts(layer_ms=(1.0,) * 12, embed_ms=4.0)
    assert balanced_windows(costs, 2) == [(0, 4), (4, 12)]


def test_uniform_costs_split_evenly() -> None:
    for n, s in [(18, 3), (18, 4), (7, 7), (5, 1)]:
        costs = StageCosts(layer_ms=(2.0,) * n)
        windows = balanced_windows(costs, s)
        assert sorted(b - a for a, b in windows) == sorted(b - a for a, b in even_splits(n, s))


@settings(max_examples=80, deadline=None)
@given(
    layers=st.lists(st.floats(0.0, 10.0), min_size=1, max_size=9),
    head=st.floats(0.0, 40.0),
    embed=st.floats(0.0, 10.0),
    fixed=st.floats(0.0, 2.0),
    data=st.data(),
)
def test_bottleneck_matches_brute_force(
    layers: list[float], head: float, embed: float, fixed: float, data: st.DataObject
) -> None:
    costs = StageCosts(layer_ms=tuple(layers), head_ms=head, embed_ms=embed, stage_ms=fixed)
    n = len(layers)
    s = data.draw(st.integers(1, n))
    windows = balanced_windows(costs, s)
    assert len(windows) == s and windows[0][0] == 0 and windows[-1][1] == n
    assert all(a < b for a, b in windows) and all(x[1] == y[0] for x, y in itertools.pairwise(windows))
    best = min(costs.bottleneck_ms(w) for w in all_splits(n, s))
    assert math.isclose(costs.bottleneck_ms(windows), best, rel_tol=1e-9, abs_tol=1e-9)
    # Among the splits reaching the bottleneck, the most even one (least sum of squares).
    tied = [w for w in all_splits(n, s) if costs.bottleneck_ms(w) <= best * (1 + 1e-9) + 1e-12]
    squares = min(sum(costs.window_ms(a, b) ** 2 for a, b in w) for w in tied)
    assert math.isclose(sum(costs.window_ms(a, b) ** 2 for a, b in windows), squares, rel_tol=1e-9, abs_tol=1e-9)


def test_allowed_cuts_are_respected() -> None:
    costs = StageCosts(layer_ms=(1.0,) * 8, head_ms=3.0)
    assert balanced_windows(costs, 2) == [(0, 5), (5, 8)]
    assert balanced_windows(costs, 2, allowed={2, 4, 6}) == [(0, 6), (6, 8)]  # 6 vs 2 + 3 (not 4 vs 4 + 3)
    with pytest.raises(WindowError):
        min_bottleneck_windows(8, 3, costs.window_ms, allowed={4})


def test_bad_inputs() -> None:
    with pytest.raises(WindowError):
        balanced_windows(StageCosts(layer_ms=(1.0, 1.0)), 3)
    with pytest.raises(WindowError):
        balanced_windows(StageCosts(layer_ms=(1.0, 1.0)), 0)
    with pytest.raises(InputError):
        StageCosts(layer_ms=())
    with pytest.raises(InputError):
        StageCosts(layer_ms=(1.0,), head_ms=-1.0)
    with pytest.raises(InputError):
        StageCosts(layer_ms=(math.nan,))


# ---------------------------------------------------------------------------------------- the estimate on Gemma


def test_estimate_charges_the_head_matmul(gemma_path: Path) -> None:
    profile = profile_from_gguf(gemma_path)
    costs = estimated_costs(profile)
    assert costs.source == "estimate" and costs.n_layers == 18
    # Gemma 3 270M: the tied 262144 x 640 head outweighs all 18 layers together.
    assert profile.vocab_size * profile.n_embd == 262144 * 640
    assert costs.head_ms > sum(costs.layer_ms) > 0
    assert costs.embed_ms < min(costs.layer_ms)
    windows = balanced_windows(costs, 3)
    assert windows[-1] == (17, 18)
    assert costs.bottleneck_ms(windows) < costs.bottleneck_ms(even_splits(18, 3))


# ------------------------------------------------------------------------------------- calibration, really timed


def test_calibration_measures_the_head_and_is_cached(
    gemma_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    costs = measured_costs(gemma_path, cache_dir, threads=1, steps=8, refresh=True)
    assert costs.source == "measured" and costs.threads == 1
    assert costs.model_sha256 == model_sha256(gemma_path, cache_dir)
    assert costs.n_layers == 18 and min(costs.layer_ms) > 0
    # The real fact the split is for: the head costs the last rank several layers' worth.
    assert costs.head_ms > 5 * max(costs.layer_ms)
    path = calibration_path(cache_dir, costs.model_sha256, 1, 0)
    assert structure(json.loads(path.read_text()), StageCosts, where=str(path)) == costs

    def no_measuring(*_: object, **__: object) -> StageCosts:
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(local_balance, "calibrate", no_measuring)
    assert measured_costs(gemma_path, cache_dir, threads=1) == costs
    assert ring_costs(gemma_path, cache_dir, threads=1) == costs
    assert ring_costs(gemma_path, cache_dir, threads=1, calibrate=False).source == "estimate"
    good = path.read_text()
    path.write_text("{not json")  # a damaged cache is measured again, not trusted
    try:
        with pytest.raises(AssertionError, match="measured again"):
            measured_costs(gemma_path, cache_dir, threads=1)
    finally:
        path.write_text(good)  # leave the shared cache as it was
    # --recalibrate: measured again although the cache is good, and the new costs decide the split.
    uneven = attrs.evolve(costs, layer_ms=(0.1,) * 9 + (5.0,) * 9, head_ms=0.0)
    monkeypatch.setattr(local_balance, "calibrate", lambda *_, **__: uneven)
    try:
        assert split_windows(gemma_path, cache_dir, 2, recalibrate=True, threads=1) == [(0, 13), (13, 18)]
        assert measured_costs(gemma_path, cache_dir, threads=1) == uneven
    finally:
        path.write_text(good)
    assert split_windows(gemma_path, cache_dir, 3, split="even", threads=1) == even_splits(18, 3)


# ------------------------------------------------------------------------------------------ the planner, alike


def cpu(name: str, memory_gb: float = 100.0, bw: float = 100.0) -> Device:
    return Device(
        name=name, kind="cpu", memory_gb=memory_gb, mem_bandwidth_gbs=bw, link_latency_ms=0.1, link_bandwidth_mbps=1e3
    )


def test_planner_latency_ties_go_to_the_balanced_split() -> None:
    """On identical devices every 2-rank split costs one request the same; the planner takes the balanced one."""
    profile = ModelProfile(
        name="head-heavy",
        arch="llama",
        n_embd=64,
        vocab_size=1000,
        layers=tuple(LayerProfile(bytes=100_000_000, active_bytes=100_000_000) for _ in range(7)),
        embd_bytes=300_000_000,
        head_bytes=300_000_000,
    )
    devices = [cpu("a", memory_gb=1.5), cpu("b", memory_gb=1.5)]  # the whole model needs 1.8 GB: two ranks
    manifest = plan(profile, devices)
    windows = [(w.start, w.stop) for w in manifest.windows]
    assert windows == [(0, 5), (5, 7)]  # 500 MB read on each rank, the head's 300 MB included
    assert windows == balanced_windows(estimated_costs(profile), 2)
    even = estimate(profile, [(d, a, b) for d, (a, b) in zip(devices, even_splits(7, 2), strict=True)])
    assert even.ms_per_token == pytest.approx(manifest.ms_per_token)
    assert manifest.bottleneck_ms == pytest.approx(5.0) and even.bottleneck_ms == pytest.approx(6.0)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(10_000_000, 500_000_000), min_size=2, max_size=6),
    head=st.integers(0, 1_000_000_000),
    bws=st.lists(st.floats(5.0, 200.0), min_size=2, max_size=3),
)
def test_planner_throughput_objective_minimises_the_bottleneck(sizes: list[int], head: int, bws: list[float]) -> None:
    profile = ModelProfile(
        name="t",
        arch="llama",
        n_embd=64,
        vocab_size=1000,
        layers=tuple(LayerProfile(bytes=s, active_bytes=s) for s in sizes),
        embd_bytes=1000,
        head_bytes=head,
    )
    devices = [cpu(f"d{i}", bw=bw) for i, bw in enumerate(bws)]
    order = [d.name for d in devices]
    manifest = plan(profile, devices, order=order, objective="throughput")
    best = math.inf
    for shift in range(len(devices)):
        ring = devices[shift:] + devices[:shift]
        for k in range(1, len(ring) + 1):
            for rest in itertools.combinations(ring[1:], k - 1):
                for split in all_splits(len(sizes), k):
                    used = [ring[0], *rest]
                    m = estimate(profile, [(d, a, b) for d, (a, b) in zip(used, split, strict=True)])
                    best = min(best, m.bottleneck_ms)
    assert math.isclose(manifest.bottleneck_ms, best, rel_tol=1e-9, abs_tol=1e-9)
    assert manifest.bottleneck_ms <= plan(profile, devices, order=order).bottleneck_ms * (1 + 1e-9)


def test_plan_cli_objective(capsys: pytest.CaptureFixture[str]) -> None:
    import kvasir.cli

    fleet = Path(__file__).resolve().parent.parent / "examples" / "devices-mixed.toml"
    args = ["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(fleet), "--json"]
    assert kvasir.cli.main([*args, "--objective", "throughput"]) == 0
    loaded = json.loads(capsys.readouterr().out)
    assert kvasir.cli.main(args) == 0
    latency = json.loads(capsys.readouterr().out)
    assert loaded["objective"] == "throughput" and latency["objective"] == "latency"
    assert loaded["bottleneck_ms"] <= latency["bottleneck_ms"]
    assert loaded["ms_per_token"] >= latency["ms_per_token"]


# ---------------------------------------------------------------------------- a balanced ring is still bit-exact


def test_balanced_ring_gives_the_whole_models_tokens(gemma_path: Path, cache_dir: Path) -> None:
    windows = balanced_windows(estimated_costs(profile_from_gguf(gemma_path)), 3)
    assert windows != even_splits(18, 3)
    with running_ring(gemma_path, windows, cache_dir) as ring:
        got = ring_generate(ring.sockets[0], PROMPT, max_tokens=12)
    assert got["tokens"] == whole_model_tokens(gemma_path, PROMPT, 12)


def test_ring_up_balances_by_default_and_stays_exact(gemma_path: Path) -> None:
    r = run_cli(
        "ring", "up", str(gemma_path), "--stages=3", "--threads=1", "--ctx=512", "--prompt", PROMPT,
        "--max-tokens=12", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stderr.splitlines() if x.startswith("balanced split: layers "))
    assert line.endswith(" 17:18"), line  # the last rank keeps one layer beside the head
    assert json.loads(r.stdout)["tokens"] == whole_model_tokens(gemma_path, PROMPT, 12)
