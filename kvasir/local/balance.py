"""``ring up``'s split: stage costs measured on this machine (or estimated from the file), then balanced windows.

Calibration runs four real stages of the model, one after another in this process with the nodes' thread count,
and times one decode step of each (median of ``steps``): ``[0, 1)`` (embedding + layer 0), ``[1, 2)``, ``[1, 1+m)``
and ``[n-1, n)`` (last layer + head + greedy sampling). Layer costs are taken proportional to each layer's active
bytes; the two middle windows give the cost per byte and the fixed cost of a decode call, the edge windows what the
embedding and the head add. The result is cached per model sha256, threads and GPU layers under the cache dir
(``calibration/``, written atomically), so it is measured once. See docs/planner.md ("Balanced stages").
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

from kvasir.core.errors import InputError
from kvasir.core.sampling import SamplingParams
from kvasir.core.schema import SchemaError, structure, unstructure
from kvasir.planner.balance import StageCosts, Window, balanced_windows, estimated_costs
from kvasir.planner.profile import profile_from_gguf
from kvasir.shard.cache import even_splits, model_sha256, stage_files
from kvasir.shard.gguf_file import describe
from kvasir.stage.engine import Stage, StageConfig
from kvasir.util.files import atomic_output

SplitMode = Literal["even", "balanced"]
SPLIT_MODES: tuple[SplitMode, ...] = ("even", "balanced")
#: Decode steps timed per stage (after an 8-token prefill); the median is kept.
CALIBRATION_STEPS = 24
#: The longer middle window has at most this many layers (its stage file is cut and cached like any other).
MIDDLE_LAYERS = 8
_PREFILL = 8


def split_windows(
    model: Path,
    cache_dir: Path,
    n_stages: int,
    *,
    split: SplitMode = "balanced",
    calibrate: bool = True,
    recalibrate: bool = False,
    threads: int,
    gpu_layers: int = 0,
) -> list[Window]:
    """The windows ``ring up`` starts: even, or balanced by measured (else estimated) stage costs; ``recalibrate``
    measures again instead of reading the cache."""
    n_main = describe(model).n_main
    if split == "even":
        return even_splits(n_main, n_stages)
    costs = ring_costs(
        model, cache_dir, threads=threads, gpu_layers=gpu_layers, calibrate=calibrate, recalibrate=recalibrate
    )
    return balanced_windows(costs, n_stages)


def ring_costs(
    model: Path,
    cache_dir: Path,
    *,
    threads: int,
    gpu_layers: int = 0,
    calibrate: bool = True,
    recalibrate: bool = False,
) -> StageCosts:
    """Measured stage costs when ``calibrate`` and the model has the 4 layers calibration needs, else the estimate."""
    n_main = describe(model).n_main
    if calibrate and n_main >= 4:
        return measured_costs(model, cache_dir, threads=threads, gpu_layers=gpu_layers, refresh=recalibrate)
    return _main_layers(estimated_costs(profile_from_gguf(model)), n_main)


def calibration_path(cache_dir: Path, sha256: str, threads: int, gpu_layers: int) -> Path:
    return cache_dir / "calibration" / f"{sha256[:32]}-t{threads}-g{gpu_layers}.json"


def measured_costs(
    model: Path,
    cache_dir: Path,
    *,
    threads: int,
    gpu_layers: int = 0,
    steps: int = CALIBRATION_STEPS,
    refresh: bool = False,
) -> StageCosts:
    """This machine's stage costs for ``model`` at ``threads`` threads per stage: cached, else measured now."""
    sha = model_sha256(model, cache_dir)
    path = calibration_path(cache_dir, sha, threads, gpu_layers)
    if not refresh and path.is_file():
        try:
            cached = structure(json.loads(path.read_text()), StageCosts, where=str(path))
            if cached.model_sha256 == sha and cached.threads == threads:
                return cached
        except (OSError, ValueError, SchemaError):
            pass  # unreadable or from another version: measure again
    print(f"calibrating stage costs of {model.name} ({threads} threads; once per model)", file=sys.stderr)
    costs = calibrate(model, cache_dir, threads=threads, gpu_layers=gpu_layers, steps=steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp:
        tmp.write_text(json.dumps(unstructure(costs), indent=1))
    return costs


def calibrate(model: Path, cache_dir: Path, *, threads: int, gpu_layers: int = 0, steps: int) -> StageCosts:
    """Measure now (uncached); see the module docstring for the four windows and the fit."""
    n = describe(model).n_main
    if n < 4:
        raise InputError(f"calibration needs at least 4 layers, {model.name} has {n}")
    m = min(n - 2, MIDDLE_LAYERS)
    windows = [(0, 1), (1, 2), (1, 1 + m), (n - 1, n)]
    times = _time_windows(stage_files(model, windows, cache_dir), steps, threads, gpu_layers)
    t_first, t_one, t_mid, t_last = times
    active = [layer.active_bytes for layer in profile_from_gguf(model).layers[:n]]
    extra = sum(active[2 : 1 + m])  # what [1, 1+m) reads beyond [1, 2)
    per_byte = max(t_mid - t_one, 0.0) / extra if extra else 0.0
    fixed = max(t_one - per_byte * active[1], 0.0)
    return StageCosts(
        layer_ms=tuple(per_byte * b for b in active),
        embed_ms=max(t_first - fixed - per_byte * active[0], 0.0),
        head_ms=max(t_last - fixed - per_byte * active[n - 1], 0.0),
        stage_ms=fixed,
        source="measured",
        threads=threads,
        model_sha256=model_sha256(model, cache_dir),
    )


def _time_windows(paths: list[Path], steps: int, threads: int, gpu_layers: int) -> list[float]:
    """Median ms of one decode step per stage (forward; on the last stage forward + greedy sample), the stages
    taking turns each step so that a noisy neighbour slows them alike."""
    n_ctx = _PREFILL + steps + 1
    stages: list[Stage] = []
    try:
        for path in paths:
            config = StageConfig(
                path, n_ctx=n_ctx, n_seq_max=1, n_batch=_PREFILL, n_threads=threads, n_gpu_layers=gpu_layers
            )
            stages.append(Stage.load(config))
        first, *rest = stages
        assert first.info.first and stages[-1].info.last
        sampler = stages[-1].new_sampler(SamplingParams.GREEDY)
        try:
            tokens = first.vocab.tokenize("Calibration: the quick brown fox jumps over the lazy dog")[:_PREFILL]
            tokens += [tokens[-1]] * (_PREFILL - len(tokens))
            hidden = first.forward(0, 0, tokens=tokens)
            for stage in rest:
                stage.forward(0, 0, hidden=hidden)
            token = tokens[-1]
            samples: list[list[float]] = [[] for _ in stages]
            for step in range(steps):
                pos = _PREFILL + step
                t0 = time.perf_counter()
                row = first.forward(0, pos, tokens=[token])
                samples[0].append(time.perf_counter() - t0)
                assert row is not None
                for k, stage in enumerate(rest, start=1):
                    t0 = time.perf_counter()
                    stage.forward(0, pos, hidden=row)
                    if stage.info.last:
                        token = stage.sample(sampler)
                    samples[k].append(time.perf_counter() - t0)
        finally:
            sampler.close()
        return [statistics.median(s) * 1e3 for s in samples]
    finally:
        for stage in stages:
            stage.close()


def _main_layers(costs: StageCosts, n_main: int) -> StageCosts:
    """The first ``n_main`` layers' costs (a profile also lists blocks the ring does not run, e.g. an MTP block)."""
    if costs.n_layers == n_main:
        return costs
    return StageCosts(costs.layer_ms[:n_main], costs.embed_ms, costs.head_ms, costs.stage_ms, costs.source)
