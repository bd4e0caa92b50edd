"""MTP (nextn) layers: inspect reports them, slice gives them to the last window, the last rank drafts with them.

The fixture is the tiny random-weight qwen35moe with one MTP block (``n_nextn=1``): its drafts are noise (acceptance
says nothing about a real model), so these tests check the machinery and exactness, never acceptance.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.shard.gguf_file import describe
from kvasir.shard.gguf_io import read_gguf
from kvasir.shard.slice import slice_model
from kvasir.stage.engine import Stage, StageConfig
from tests.conftest import run_cli

N_MAIN = 8
MTP_DIMS = {"n_layer": N_MAIN, "n_nextn": 1}


@pytest.fixture(scope="module")
def mtp_model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("qwen35moe", "q8_0", **MTP_DIMS)


def _nextn_tensors(path: Path) -> set[str]:
    return {t.name for t in read_gguf(path).tensors if ".nextn." in t.name}


def test_fixture_carries_one_mtp_block(mtp_model: Path) -> None:
    info = describe(mtp_model)
    assert (info.n_layer, info.nextn_layers, info.n_main) == (N_MAIN + 1, 1, N_MAIN)
    assert _nextn_tensors(mtp_model) == {
        f"blk.{N_MAIN}.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")
    }


def test_inspect_says_whether_a_model_has_mtp_layers(mtp_model: Path, tiny_model: Callable[..., Path]) -> None:
    r = run_cli("inspect", str(mtp_model))
    assert r.returncode == 0, r.stderr
    assert f"{N_MAIN} (+1 MTP)" in r.stdout and "MTP layers" in r.stdout
    assert json.loads(run_cli("inspect", str(mtp_model), "--json").stdout)["nextn_layers"] == 1
    plain = run_cli("inspect", str(tiny_model("qwen35moe", "q8_0")))
    assert "MTP layers" in plain.stdout and "none" in plain.stdout


def test_only_the_last_window_carries_the_mtp_block(mtp_model: Path, tmp_path: Path) -> None:
    src = read_gguf(mtp_model)
    stages = [slice_model(mtp_model, a, b, tmp_path / f"{a}.gguf") for a, b in [(0, 3), (3, 5), (5, N_MAIN)]]
    for res in stages[:-1]:
        gg = read_gguf(res.path)
        assert not _nextn_tensors(res.path) and gg.get("qwen35moe.nextn_predict_layers") == 0
        assert describe(res.path).nextn_layers == 0
    last = stages[-1].path
    gg = read_gguf(last)
    n_stage = N_MAIN - 5  # the window's layers, then the MTP block renumbered after them
    assert gg.get("qwen35moe.nextn_predict_layers") == 1 and gg.get("qwen35moe.block_count") == n_stage + 1
    src_mtp = {t.name.replace(f"blk.{N_MAIN}.", f"blk.{n_stage}.", 1): t.nbytes for t in src.tensors}
    stage_mtp = {t.name: t.nbytes for t in gg.tensors if t.name.startswith(f"blk.{n_stage}.")}
    assert stage_mtp and all(src_mtp[name] == n for name, n in stage_mtp.items())
    assert len(stage_mtp) == sum(t.name.startswith(f"blk.{N_MAIN}.") for t in src.tensors)
    # The MTP block embeds its input token with the model's token embedding: the last window carries all of it.
    emb = {t.name: t.shape for t in gg.tensors}["token_embd.weight"]
    assert emb == next(t.shape for t in src.tensors if t.name == "token_embd.weight")
    # The explicit layer-kind array marks the MTP block as full attention (not recurrent).
    assert list(gg.get("qwen35moe.attention.recurrent_layers"))[-1] is False
    info = describe(last)
    assert info.stage_window == (5, N_MAIN) and info.nextn_layers == 1
    r = run_cli("inspect", str(last))
    assert "this last window carries them" in r.stdout
    with Stage.load(StageConfig(last, n_ctx=64, n_seq_max=1, n_threads=1)) as stage:
        assert stage.info.last and stage.info.start == 5
