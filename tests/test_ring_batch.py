"""Batched decode across a real ring: node processes on loopback running the real Gemma 3 270M, several requests at
once. Without ``--batch`` every answer equals the whole model's exactly (one sequence per llama_decode); with
``--batch 8`` steps really share decodes and every answer is a valid completion of the same length, but its bits
are not promised (llama.cpp's numbers depend on the micro-batch): how many answers differ is reported, not asserted.
Fast orderings: test_ring_batch_flow.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvasir.control.client import ControlClient
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.wire import SamplingParams
from tests.conftest import run_cli
from tests.ringutil import ring_generate, running_ring

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colours are",
    "List the planets of the solar system:",
]
TOKENS = 16
WINDOWS = [(0, 6), (6, 12), (12, 18)]


def concurrent_answers(sockets: list[Path]) -> list[dict[str, Any]]:
    """Every prompt at once, entering at every rank in turn."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(ring_generate, sockets[i % len(sockets)], p, TOKENS) for i, p in enumerate(PROMPTS)]
        return [f.result() for f in futures]


@pytest.mark.slow
def test_gemma_ring_batch_off_is_exact_and_batch_on_answers(gemma_path: Path, cache_dir: Path) -> None:
    with Stage.load(StageConfig(gemma_path, n_ctx=512, n_seq_max=1, n_threads=2)) as stage:
        pipe = LocalPipeline([stage])
        want = [pipe.generate(stage.vocab.tokenize(p), SamplingParams.GREEDY, TOKENS).tokens for p in PROMPTS]
        n_vocab = stage.info.n_vocab
    with running_ring(gemma_path, WINDOWS, cache_dir) as ring:
        got = concurrent_answers(ring.sockets)
        assert [g["tokens"] for g in got] == want  # the exact mode: concurrency changes nothing
        with ControlClient(ring.sockets[0]) as c:
            assert c.status()["requests"]["decode_batches"] == 0
    with running_ring(gemma_path, WINDOWS, cache_dir, extra_args=("--batch", "8")) as ring:
        got = concurrent_answers(ring.sockets)
        differ = 0
        for g, w in zip(got, want, strict=True):
            assert g["reason"] == "max_tokens" and g["generated_tokens"] == TOKENS, g
            assert len(g["tokens"]) == TOKENS and all(0 <= t < n_vocab for t in g["tokens"])
            differ += g["tokens"] != w
        counters = []
        for sock in ring.sockets:
            with ControlClient(sock) as c:
                counters.append(c.status()["requests"])
        # Steps really shared decodes at every rank: fewer batches than steps.
        for r in counters:
            assert 0 < r["decode_batches"] < r["batched_steps"] <= len(PROMPTS) * (TOKENS - 1), r
        print(f"batch 8: {differ}/{len(PROMPTS)} answers differ from the exact ones; {counters}")
        # A request alone in a batching ring is computed alone (batches of one): exact again.
        assert ring_generate(ring.sockets[1], PROMPTS[0], TOKENS)["tokens"] == want[0]
        deadline = time.monotonic() + 10
        while not all(free_sequences(sock) == 8 for sock in ring.sockets):  # every sequence is given back
            assert time.monotonic() < deadline, [free_sequences(sock) for sock in ring.sockets]
            time.sleep(0.1)


def free_sequences(sock: Path) -> int:
    with ControlClient(sock) as c:
        n: int = c.status()["requests"]["free_sequences"]
        return n


def test_ring_up_batch_passes_the_flag_and_a_lone_prompt_stays_exact(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """`ring up --batch N --prompt` on a tiny llama: the nodes batch (a lone request: batches of one) and the answer
    is `generate`'s; an out-of-range N is refused."""
    model = tiny_model("llama", "q8_0")
    common = ["--prompt", "one two three four", "--max-tokens", "16", "--threads", "1", "--json", "--ctx", "256"]
    want = run_cli("generate", str(model), *common)
    assert want.returncode == 0, want.stderr
    got = run_cli("ring", "up", str(model), "--splits", "0,3,6", *common, "--batch", "4", timeout=300)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["tokens"] == json.loads(want.stdout)["tokens"]
    assert run_cli("ring", "up", "--batch", "0", str(model), "--prompt", "x").returncode != 0
