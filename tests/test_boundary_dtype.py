"""f16/bf16 boundaries: a ring can send them; the divergence from f32 on real hidden states is measured."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvasir.shard.cache import stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.wire import Boundary, BoundaryDType, measure_divergence


def test_real_hidden_states_survive_f16_and_bf16(gemma_path: Path, cache_dir: Path) -> None:
    paths = stage_files(gemma_path, [(0, 9), (9, 18)], cache_dir)
    with Stage.load(StageConfig(paths[0], n_ctx=128, n_seq_max=1, n_threads=2)) as first:
        hidden = first.forward(0, 0, tokens=first.vocab.tokenize("The capital of France is Paris, a city"))
    assert hidden is not None
    # Gemma's residual stream exceeds f16's range (±65504) on the BOS row: f16 cannot carry it at all.
    f16 = measure_divergence(hidden, BoundaryDType.F16)
    assert f16.overflowed and float(np.abs(hidden).max()) > 65504
    # bf16 keeps the range and loses precision: at most 2**-8 relative per value.
    frame = Boundary.from_array(7, 0, hidden, dtype=BoundaryDType.BF16, final=True)
    back = Boundary.from_wire(frame.to_wire()).to_array()
    assert len(frame.payload) == hidden.size * 2
    d = measure_divergence(hidden, BoundaryDType.BF16)
    assert not d.overflowed and d.max_rel <= 2**-8, d
    assert np.max(np.abs(back - hidden)) <= d.max_abs + 1e-6
    exact = Boundary.from_wire(Boundary.from_array(7, 0, hidden, final=True).to_wire()).to_array()
    assert np.array_equal(exact.view(np.uint32), hidden.view(np.uint32))
