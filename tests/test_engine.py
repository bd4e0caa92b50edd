"""The stage engine's contract beyond exactness: threads, sampling, vocab, and `kvasir generate`."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import trio

from kvasir.shard.cache import parse_splits, stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.wire import SamplingParams
from tests.conftest import run_cli


async def test_compute_runs_without_holding_the_gil(gemma_path: Path) -> None:
    """While llama.cpp computes in a worker thread, the trio loop keeps running."""
    stage = await trio.to_thread.run_sync(
        lambda: Stage.load(StageConfig(gemma_path, n_ctx=512, n_seq_max=1, n_threads=1))
    )
    try:
        prompt = stage.vocab.tokenize("All work and no play makes Jack a dull boy. " * 30)[:300]
        ticks = 0
        done = trio.Event()

        async def compute() -> None:
            await stage.run(functools.partial(stage.forward, 0, 0, tokens=prompt))
            done.set()

        async with trio.open_nursery() as nursery:
            t0 = time.perf_counter()
            nursery.start_soon(compute)
            while not done.is_set():
                await trio.sleep(0.001)
                ticks += 1
            elapsed = time.perf_counter() - t0
        # The loop ticked throughout the prefill (a held GIL would leave it at a handful).
        assert elapsed > 0.05 and ticks > elapsed / 0.01, (ticks, elapsed)
    finally:
        stage.close()


def test_stage_reports_its_backend_and_window(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("qwen2", "f32")
    path = stage_files(model, parse_splits("0,2,6", 6), cache_dir)[1]
    with Stage.load(StageConfig(path, n_ctx=64, n_seq_max=1, n_threads=1)) as stage:
        info = stage.info
        assert (info.start, info.end, info.first, info.last) == (2, 6, False, True)
        assert info.backend == "CPU" and info.n_threads == 1
        assert info.model_sha256 and len(info.model_sha256) == 64


def test_sampling_is_seeded_and_varies(gemma_path: Path) -> None:
    with Stage.load(StageConfig(gemma_path, n_ctx=256, n_seq_max=1, n_threads=2)) as stage:
        pipe = LocalPipeline([stage])
        prompt = stage.vocab.tokenize("Once upon a time")

        def run(seed: int, **kw: int) -> list[int]:
            return pipe.generate(prompt, SamplingParams(temperature=1.0, seed=seed, **kw), 12).tokens

        assert run(7) == run(7)
        assert len({tuple(run(s)) for s in (1, 2, 3, 4)}) > 1
        greedy = pipe.generate(prompt, SamplingParams(temperature=0.0), 12).tokens
        assert run(5, top_k=1) == greedy  # top-k 1 is greedy whatever the temperature
        rep = pipe.generate(prompt, SamplingParams(temperature=0.0, repeat_penalty=1.5), 12).tokens
        assert rep != greedy or len(set(greedy)) == len(greedy)


def test_generate_cli_json_matches_across_splits(gemma_path: Path) -> None:
    outs = []
    for extra in ([], ["--splits", "0,6,12,18"], ["--splits", "9"]):
        r = run_cli(
            "generate", str(gemma_path), "--prompt", "The capital of France is", "--max-tokens", "8", "--json", *extra
        )
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
    assert outs[0]["tokens"] == outs[1]["tokens"] == outs[2]["tokens"] and len(outs[0]["tokens"]) == 8
    for o in outs:
        assert set(o) >= {"tokens", "text", "prefill_ms", "decode_ms_per_token"} and o["text"]


def test_generate_chat_and_stop_at_eog(tiny_model: Callable[..., Path], gemma_path: Path) -> None:
    r = run_cli("generate", str(gemma_path), "--chat", "--prompt", "Say hi.", "--max-tokens", "40", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"].strip() and out["stop_reason"] in ("eog", "max_tokens")
    with Stage.load(StageConfig(gemma_path, n_ctx=256, n_seq_max=1, n_threads=2)) as stage:
        vocab = stage.vocab
        assert stage.chat_template() is None  # Gemma 3 270M carries no template: llama.cpp's built-in "gemma"
        tokens = vocab.chat_tokens([("user", "Say hi.")], None)
        assert tokens[:2] == [vocab.bos, vocab.tokenize("<start_of_turn>", add_special=False, parse_special=True)[0]]
        assert tokens.count(vocab.bos) == 1
        assert stage.vocab.is_eog(stage.vocab.tokenize("<end_of_turn>", add_special=False, parse_special=True)[0])


def test_native_and_python_capture_agree(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    """The C eval callback and its Python fallback copy out the same boundary, bit for bit."""
    path = stage_files(tiny_model("gemma3", "q8_0"), parse_splits("0,4,6", 6), cache_dir)[0]
    outs = []
    for native in (True, False):
        config = StageConfig(path, n_ctx=128, n_seq_max=1, n_threads=1, native_capture=native)
        with Stage.load(config) as stage:
            assert type(stage._capture).__name__ == ("NativeCapture" if native else "PythonCapture")
            prompt = stage.vocab.tokenize("one two three four five six seven")
            first = stage.forward(0, 0, tokens=prompt)
            step = stage.forward(0, len(prompt), tokens=[prompt[1]])
            assert first is not None and step is not None
            outs.append((first, step))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert a.view("u4").tobytes() == b.view("u4").tobytes()


def test_longest_piece_bounds_every_token(gemma_path: Path) -> None:
    """The API's pre-tokenization bound holds on a real 262k vocabulary: no token's text is longer."""
    with Stage.load(StageConfig(gemma_path, n_ctx=256, n_seq_max=1, n_threads=2)) as stage:
        vocab = stage.vocab
        longest = vocab.longest_piece()
        assert 1 < longest < 256
        text = "     \t\t\n\n" * 20 + "Antidisestablishmentarianism " * 5 + "=" * 64 + "ლ" * 10
        tokens = vocab.tokenize(text, add_special=False)
        assert len(text.encode()) / longest <= len(tokens)
        assert max(len(vocab.piece(t)) for t in tokens) <= longest


def test_greedy_argmax_equals_llama_greedy_sampler(gemma_path: Path) -> None:
    """Greedy sampling reads the logits row with numpy's argmax; llama.cpp's greedy sampler picks the same token on
    every row of a real prompt (ties: both take the first maximum)."""
    with Stage.load(StageConfig(gemma_path, n_ctx=256, n_seq_max=1, n_threads=2)) as stage:
        prompt = stage.vocab.tokenize("The quick brown fox jumps over the lazy dog. " * 4)
        fast = stage.new_sampler(SamplingParams(temperature=0.0))
        chain = stage.new_sampler(SamplingParams(temperature=0.0))
        chain._argmax = False  # the llama.cpp sampler chain (greedy)
        assert fast._argmax
        picks: list[tuple[int, int]] = []

        def both(row: int) -> bool:  # after each row of a verify batch, its logits current
            picks.append((stage.sample(fast), stage.sample(chain)))
            return False

        stage.forward_verify(0, 0, tokens=prompt, until=both)
        assert len(picks) == len(prompt)
        assert all(a == b for a, b in picks), picks
        assert len({a for a, _ in picks}) > 3  # real, varied rows
        with_penalty = stage.new_sampler(SamplingParams(temperature=0.0, repeat_penalty=1.3))
        assert not with_penalty._argmax  # penalties need the chain's history
