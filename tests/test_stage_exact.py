"""The chain of stage windows computes exactly what the whole model computes: equal greedy tokens and
bit-identical logits at every step, for every architecture, quantization and many splits."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from kvasir.shard.cache import parse_splits, stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline

TEXT = "The ring passes the hidden state from one stage to the next, and the last one samples a token. " * 20


def prompt_of(pipe: LocalPipeline, n: int) -> list[int]:
    toks = pipe.stages[0].vocab.tokenize(TEXT)
    assert len(toks) >= n
    return toks[:n]


@contextlib.contextmanager
def pipeline(paths: Sequence[Path], n_seq_max: int = 2) -> Iterator[LocalPipeline]:
    with contextlib.ExitStack() as stack:
        stages = [
            stack.enter_context(Stage.load(StageConfig(p, n_ctx=512, n_seq_max=n_seq_max, n_batch=256, n_threads=2)))
            for p in paths
        ]
        yield LocalPipeline(stages)


def greedy_trace(
    pipe: LocalPipeline, prompt: list[int], n_new: int, seq: int = 0
) -> tuple[list[int], list[np.ndarray]]:
    pipe.prefill(seq, prompt)
    logits = [pipe.last.logits()]
    tokens: list[int] = []
    for i in range(n_new):
        tokens.append(int(np.argmax(logits[-1])))
        pipe.step(seq, len(prompt) + i, [tokens[-1]])
        logits.append(pipe.last.logits())
    pipe.free(seq)
    return tokens, logits


def assert_identical(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x.shape == y.shape
        if not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
            diff = float(np.max(np.abs(x - y)))
            pytest.fail(f"logits differ at step {step} (max abs diff {diff})")


ARCH_SPLITS = {
    "llama": ["0,1,2,3,4,5,6", "0,1,4,6", "0,5,6"],
    "qwen2": ["0,1,2,3,4,5,6", "0,3,6"],
    "qwen3": ["0,1,2,3,4,5,6", "0,2,5,6"],
    # gemma3 (global layer every 6th: layer 5): cuts inside the sliding period, a global-only window [5,6).
    "gemma3": ["0,1,2,3,4,5,6", "0,3,6", "0,4,5,6", "0,2,5,6"],
    # hybrid (full attention every 4th layer: 3): 1-layer windows get an identity layer of the missing kind.
    "qwen35": ["0,1,2,3,4,5,6", "0,3,6", "0,4,6"],
    "qwen35moe": ["0,1,2,3,4,5,6", "0,2,5,6"],
}


@pytest.mark.parametrize("quant", ["f32", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("arch", sorted(ARCH_SPLITS))
def test_chained_windows_are_bit_exact(arch: str, quant: str, tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model(arch, quant)
    with pipeline([model]) as whole:
        prompts = [prompt_of(whole, n) for n in (1, 7, 200)]
        expected = [greedy_trace(whole, p, 6) for p in prompts]
    for splits in ARCH_SPLITS[arch]:
        with pipeline(stage_files(model, parse_splits(splits, 6), cache_dir)) as ring:
            for prompt, (want_tokens, want_logits) in zip(prompts, expected, strict=True):
                tokens, logits = greedy_trace(ring, prompt, 6)
                assert tokens == want_tokens, f"splits {splits}, prompt of {len(prompt)}"
                assert_identical(logits, want_logits)


def test_two_sequences_interleaved_in_one_context(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("gemma3", "q8_0")
    with pipeline([model]) as whole:
        a, b = prompt_of(whole, 37), prompt_of(whole, 90)[5:]
        solo_a, solo_b = greedy_trace(whole, a, 8), greedy_trace(whole, b, 8)
    with pipeline(stage_files(model, parse_splits("0,2,4,6", 6), cache_dir)) as ring:
        ring.prefill(0, a)
        la = [ring.last.logits()]
        ring.prefill(1, b)
        lb = [ring.last.logits()]
        ta: list[int] = []
        tb: list[int] = []
        for i in range(8):
            ta.append(int(np.argmax(la[-1])))
            ring.step(0, len(a) + i, [ta[-1]])
            la.append(ring.last.logits())
            tb.append(int(np.argmax(lb[-1])))
            ring.step(1, len(b) + i, [tb[-1]])
            lb.append(ring.last.logits())
        assert (ta, tb) == (solo_a[0], solo_b[0])
        assert_identical(la, solo_a[1])
        assert_identical(lb, solo_b[1])


def test_free_one_sequence_keeps_the_other(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("llama", "f32")
    with pipeline([model]) as whole:
        a = prompt_of(whole, 20)
        solo = greedy_trace(whole, a, 5)
    with pipeline(stage_files(model, parse_splits("0,3,6", 6), cache_dir)) as ring:
        ring.prefill(1, prompt_of(ring, 30))
        ring.prefill(0, a)
        ring.free(1)  # drop sequence 1 while sequence 0 is mid-generation
        logits = [ring.last.logits()]
        tokens = []
        for i in range(5):
            tokens.append(int(np.argmax(logits[-1])))
            ring.step(0, len(a) + i, [tokens[-1]])
            logits.append(ring.last.logits())
        assert tokens == solo[0]
        assert_identical(logits, solo[1])


@pytest.mark.slow
def test_gemma_every_one_layer_window_is_bit_exact(gemma_path: Path, cache_dir: Path) -> None:
    """Gemma 3 270M as 18 one-layer stages, including the global-only window [17, 18)."""
    with pipeline([gemma_path], n_seq_max=1) as whole:
        prompt = whole.stages[0].vocab.tokenize("The capital of France is")
        want = greedy_trace(whole, prompt, 6)
    with pipeline(stage_files(gemma_path, [(i, i + 1) for i in range(18)], cache_dir), n_seq_max=1) as ring:
        got = greedy_trace(ring, prompt, 6)
    assert got[0] == want[0]
    assert_identical(got[1], want[1])


@pytest.mark.slow
@pytest.mark.parametrize("splits", ["0,6,12,18", "0,1,17,18", "0,5,11,18"])
def test_gemma_splits_are_bit_exact_on_long_prompts(gemma_path: Path, cache_dir: Path, splits: str) -> None:
    with pipeline([gemma_path], n_seq_max=1) as whole:
        prompt = whole.stages[0].vocab.tokenize(TEXT)[:180]
        want = greedy_trace(whole, prompt, 4)
    with pipeline(stage_files(gemma_path, parse_splits(splits, 18), cache_dir), n_seq_max=1) as ring:
        got = greedy_trace(ring, prompt, 4)
    assert got[0] == want[0]
    assert_identical(got[1], want[1])
