"""The tiny random-weight GGUF generator: llama.cpp loads, tokenizes and runs what it writes."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvasir.testing.tinymodels import (
    ARCHES,
    BENCH_1B_N_VOCAB,
    QUANTS,
    resolve_spec,
    tiny_model_cached,
    write_bench_1b,
    write_tiny_model,
)

llama_cpp = pytest.importorskip("llama_cpp")

TEXT = "Hello world, this is a test."
Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tinymodels")


class _Model:
    """A model and a context through llama.cpp's C API.

    ``use_extra_bufts = False``: on CPUs with AMX, llama.cpp 0.3.36 repacks quantized weights into its
    AMX buffer type and then segfaults in ``llama_decode`` (seen with these files and with the real
    Gemma 3 270M Q4_K_M); the high-level ``llama_cpp.Llama`` offers no way to turn that off.
    """

    def __init__(self, path: Path) -> None:
        mparams = llama_cpp.llama_model_default_params()
        mparams.use_extra_bufts = False
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
        assert self.model, path
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = 256
        cparams.n_batch = 256
        cparams.n_threads = cparams.n_threads_batch = 2
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        assert self.ctx
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))

    def close(self) -> None:
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buf = (llama_cpp.llama_token * (len(data) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, len(buf), True, False)
        assert n >= 0
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> str:
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        out = ctypes.create_string_buffer(64 * len(tokens) + 64)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(tokens), out, len(out), False, False)
        assert n >= 0
        return out.raw[:n].decode()

    def eval(self, tokens: list[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Decode ``tokens`` after what the context holds; return the last token's logits."""
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        assert llama_cpp.llama_decode(self.ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) == 0
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()


@contextmanager
def _load(path: Path) -> Iterator[_Model]:
    model = _Model(path)
    try:
        yield model
    finally:
        model.close()


def _blk_matrices(path: Path) -> dict[str, Q]:
    """Layer weight matrices llama.cpp is expected to quantize (not norms, conv kernels or routers)."""
    out: dict[str, Q] = {}
    for t in gguf.GGUFReader(path).tensors:
        if not t.name.startswith("blk.") or len(t.shape) < 2:
            continue
        if "ssm_conv1d" in t.name or "ffn_gate_inp" in t.name:
            continue
        out[t.name] = Q(t.tensor_type)
    return out


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHES)
def test_loads_tokenizes_and_runs(cache_dir: Path, arch: str, quant: str) -> None:
    path = tiny_model_cached(cache_dir, arch, quant)

    types = set(_blk_matrices(path).values())
    if quant == "f32":
        assert types == {Q.F32}
    elif quant == "q8_0":
        assert types == {Q.Q8_0}
    else:
        assert Q.Q4_K in types
        assert types <= {Q.Q4_K, Q.Q5_K, Q.Q6_K}, types

    with _load(path) as llm:
        assert llm.n_vocab == resolve_spec(arch, quant=quant).n_vocab
        tokens = llm.tokenize(TEXT)
        assert tokens[0] == 1  # BOS
        assert len(tokens) > 2
        assert llm.detokenize(tokens[1:]) == TEXT

        rows = [llm.eval(tokens)]
        generated: list[int] = []
        for _ in range(8):
            generated.append(int(np.argmax(rows[-1])))
            rows.append(llm.eval(generated[-1:]))
        assert all(np.all(np.isfinite(row)) for row in rows)
        assert len(set(generated)) > 1, generated
        assert not np.allclose(rows[0], rows[-1])


def test_cache_reuses_and_keys_by_parameters(tmp_path: Path) -> None:
    a = tiny_model_cached(tmp_path, "llama", "f32", n_layer=2)
    mtime = a.stat().st_mtime_ns
    assert tiny_model_cached(tmp_path, "llama", "f32", n_layer=2) == a
    assert a.stat().st_mtime_ns == mtime
    b = tiny_model_cached(tmp_path, "llama", "f32", n_layer=2, seed=1)
    c = tiny_model_cached(tmp_path, "llama", "f32", n_layer=3)
    assert len({a, b, c}) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (a, b, c))  # no temp files


def test_deterministic_and_seeded(tmp_path: Path) -> None:
    one = write_tiny_model(tmp_path / "one.gguf", "qwen3", n_layer=2)
    two = write_tiny_model(tmp_path / "two.gguf", "qwen3", n_layer=2)
    other = write_tiny_model(tmp_path / "other.gguf", "qwen3", n_layer=2, seed=7)
    assert one.read_bytes() == two.read_bytes()
    assert one.read_bytes() != other.read_bytes()


def test_metadata(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "g.gguf", "gemma3", n_layer=7, n_vocab=300)
    reader = gguf.GGUFReader(path)
    fields = reader.fields
    assert fields["general.architecture"].contents() == "gemma3"
    assert fields["gemma3.block_count"].contents() == 7
    assert fields["gemma3.attention.sliding_window"].contents() > 0
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 300
    assert "tokenizer.chat_template" in fields
    names = {t.name for t in reader.tensors}
    assert "output.weight" not in names  # tied
    assert {"blk.6.post_attention_norm.weight", "blk.6.post_ffw_norm.weight"} <= names

    path = write_tiny_model(tmp_path / "m.gguf", "qwen35moe", n_layer=4)
    fields = gguf.GGUFReader(path).fields
    assert fields["qwen35moe.full_attention_interval"].contents() == 4
    assert fields["qwen35moe.expert_count"].contents() == 4
    assert fields["qwen35moe.expert_used_count"].contents() == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        {"arch": "mistral"},
        {"arch": "llama", "quant": "q2_k"},
        {"arch": "llama", "n_head": 4, "n_head_kv": 3},
        {"arch": "llama", "n_vocab": 100},
        {"arch": "qwen2", "head_dim": 32},
    ],
)
def test_rejects_bad_parameters(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "x.gguf", **kwargs)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVASIR_SLOW"), reason="set KVASIR_SLOW=1 (writes a ~3 GB temp file)")
def test_bench_1b(tmp_path: Path) -> None:
    start = time.monotonic()
    path = write_bench_1b(tmp_path / "bench-1b.gguf")
    assert time.monotonic() - start < 180
    assert Q.Q4_K in set(_blk_matrices(path).values())
    with _load(path) as llm:
        assert llm.n_vocab == BENCH_1B_N_VOCAB
        assert np.all(np.isfinite(llm.eval(llm.tokenize(TEXT))))
