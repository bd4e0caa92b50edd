"""inspect and slice: stage file contents, window rules, and clear errors on bad input."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvasir.core.errors import ShapeError, UnsupportedArchitecture, WindowError
from kvasir.shard.arch import layer_kinds
from kvasir.shard.gguf_file import ModelInfo, describe
from kvasir.shard.gguf_io import read_gguf
from kvasir.shard.slice import plan_layout, slice_model
from kvasir.stage.engine import Stage, StageConfig
from tests.conftest import run_cli


def info(arch: str, n_layer: int, nextn: int = 0) -> ModelInfo:
    return ModelInfo("m.gguf", arch, n_layer, 64, 100, 0, (1,) * n_layer, 0, True, None, None, nextn)


def test_gemma3_pattern_follows_the_layer_not_its_new_index() -> None:
    kinds = layer_kinds("gemma3", {"gemma3.attention.sliding_window": 512}, 18)
    assert kinds is not None and [i for i, swa in enumerate(kinds) if not swa] == [5, 11, 17]
    layout = plan_layout(info("gemma3", 18), {"gemma3.attention.sliding_window": 512}, 4, 7)
    assert layout.kinds == (True, False, True)  # layer 5 stays global as the stage's layer 1
    only_global = plan_layout(info("gemma3", 18), {"gemma3.attention.sliding_window": 512}, 17, 18)
    assert only_global.drop_sliding_window and only_global.kinds is None


def test_hybrid_window_of_one_kind_gets_an_identity_layer() -> None:
    meta = {"qwen35.full_attention_interval": 4}
    one = plan_layout(info("qwen35", 8), meta, 0, 1)  # layer 0 is recurrent
    assert one.layer_sources == (0, 3) and one.pad_positions == (1,) and one.kinds == (True, False)
    att = plan_layout(info("qwen35", 8), meta, 3, 4)  # layer 3 is full attention
    assert att.layer_sources == (3, 2) and att.kinds == (False, True)
    mixed = plan_layout(info("qwen35", 8), meta, 2, 5)
    assert mixed.pad_positions == () and mixed.kinds == (True, False, True)


def test_last_window_keeps_mtp_blocks() -> None:
    layout = plan_layout(info("qwen35moe", 9, nextn=1), {}, 4, 8)
    assert layout.last and layout.layer_sources == (4, 5, 6, 7, 8)


def test_windows_must_be_non_empty_and_inside() -> None:
    for a, b in [(3, 3), (5, 2), (-1, 2), (0, 7)]:
        with pytest.raises(WindowError):
            plan_layout(info("llama", 6), {}, a, b)
    with pytest.raises(UnsupportedArchitecture, match="supported: "):
        plan_layout(info("falcon", 6), {}, 0, 1)


def test_stage_files_hold_exactly_their_window(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "q8_0")
    src = read_gguf(model)
    first = slice_model(model, 0, 2, tmp_path / "a.gguf")
    mid = slice_model(model, 2, 4, tmp_path / "b.gguf")
    last = slice_model(model, 4, 6, tmp_path / "c.gguf")
    for res, (a, b) in [(first, (0, 2)), (mid, (2, 4)), (last, (4, 6))]:
        gg = read_gguf(res.path)
        blocks = {t.name for t in gg.tensors if t.name.startswith("blk.")}
        want = {
            t.name.replace(f"blk.{i}.", f"blk.{i - a}.", 1)
            for i in range(a, b)
            for t in src.tensors
            if t.name.startswith(f"blk.{i}.")
        }
        assert blocks == want
        assert gg.get("llama.block_count") == b - a
        assert (gg.get("kvasir.stage.layer_start"), gg.get("kvasir.stage.layer_end")) == (a, b)
        assert res.stage_bytes < res.model_bytes
    mid_gg = read_gguf(mid.path)
    assert mid_gg.get("tokenizer.ggml.model") == "none" and mid_gg.get("llama.vocab_size") == 1
    assert next(t for t in mid_gg.tensors if t.name == "token_embd.weight").shape == (64, 1)
    assert "output.weight" not in {t.name for t in mid_gg.tensors}
    assert mid_gg.get("kvasir.tokenizer.ggml.tokens") == src.get("tokenizer.ggml.tokens")
    last_gg = read_gguf(last.path)
    assert last_gg.get("tokenizer.ggml.model") == src.get("tokenizer.ggml.model")
    assert "output.weight" in {t.name for t in last_gg.tensors}
    # The first stage carries the real embedding matrix as a raw block, byte for byte.
    emb = next(t for t in src.tensors if t.name == "token_embd.weight")
    raw = first.path.read_bytes()[-emb.nbytes :]
    assert raw == model.read_bytes()[emb.offset : emb.offset + emb.nbytes]


def test_inspect_json(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model("gemma3", "f32")
    r = run_cli("inspect", str(model), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    d = describe(model)
    assert out["architecture"] == "gemma3" and out["layers"] == 6 and out["hidden_size"] == d.n_embd
    assert out["vocab_size"] == d.n_vocab > 0 and out["windows_supported"] is True
    assert sum(out["bytes_per_layer"]) + out["bytes_outside_layers"] <= out["file_bytes"]


def test_slice_cli_prints_stage_against_model_bytes(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("qwen3", "f32")
    r = run_cli("slice", str(model), "--layers", "2:4", "-o", str(tmp_path / "s.gguf"))
    assert r.returncode == 0, r.stderr
    assert "layers 2:4" in r.stdout and "%" in r.stdout
    assert describe(tmp_path / "s.gguf").stage_window == (2, 4)


def _unsupported(tmp_path: Path) -> Path:
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
    w.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_clean_failure(r: object, out_dir: Path, fragment: str) -> None:
    assert r.returncode == 2  # type: ignore[attr-defined]
    err = r.stderr.strip()  # type: ignore[attr-defined]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err
    assert not list(out_dir.glob("*.part")) and not (out_dir / "out.gguf").exists()


def test_bad_input_gets_one_line_and_exit_2(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "f32")
    data = model.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    out = str(tmp_path / "out.gguf")
    cases = [
        (("slice", str(tmp_path / "missing.gguf"), "--layers", "0:1", "-o", out), "no such file"),
        (("slice", str(truncated), "--layers", "0:1", "-o", out), "truncated"),
        (("slice", str(corrupt), "--layers", "0:1", "-o", out), "GGUF"),
        (("slice", str(model), "--layers", "4:9", "-o", out), "outside"),
        (("slice", str(model), "--layers", "3:3", "-o", out), "empty"),
        (("slice", str(model), "--layers", "x", "-o", out), "expected A:B"),
        (("slice", str(_unsupported(tmp_path)), "--layers", "0:1", "-o", out), "unsupported architecture 'falcon'"),
        (("slice", str(model), "--layers", "0:1", "-o", str(tmp_path / "nodir" / "x.gguf")), "does not exist"),
        (("inspect", str(corrupt)), "GGUF"),
        (("generate", str(model), "--splits", "0,9", "--prompt", "hi"), "splits"),
        (("generate", str(model), "--prompt", "hi", "--temperature", "-1"), "temperature"),
    ]
    for args, fragment in cases:
        _assert_clean_failure(run_cli(*args), tmp_path, fragment)


def test_unwritable_output_leaves_nothing(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "f32")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    # Root writes anywhere a mode allows nothing, but not into /proc.
    target = Path("/proc/out.gguf") if os.geteuid() == 0 else ro / "out.gguf"
    try:
        r = run_cli("slice", str(model), "--layers", "0:2", "-o", str(target))
        _assert_clean_failure(r, ro, "cannot write")
        assert not target.exists()
    finally:
        ro.chmod(0o700)


def test_output_over_a_directory_is_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    (tmp_path / "out.gguf").mkdir()
    r = run_cli("slice", str(tiny_model("llama", "f32")), "--layers", "0:2", "-o", str(tmp_path / "out.gguf"))
    assert r.returncode == 2 and "is a directory" in r.stderr and not list(tmp_path.glob("*.part"))


def test_hidden_state_of_wrong_width_is_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "f32")
    path = slice_model(model, 2, 4, tmp_path / "mid.gguf").path
    with Stage.load(StageConfig(path, n_ctx=64, n_seq_max=1, n_threads=1)) as stage:
        width = stage.info.n_embd
        with pytest.raises(ShapeError, match=f"expected \\(n, {width}\\)"):
            stage.forward(0, 0, hidden=np.zeros((3, width + 1), np.float32))
        out = stage.forward(0, 0, hidden=np.ones((3, width), np.float32))
        assert out is not None and out.shape == (3, width) and np.isfinite(out).all()
