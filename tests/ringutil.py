"""Helpers for tests that run real rings of node processes on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvasir.control.client import ControlClient
from kvasir.local.launcher import LocalRing, remove_run_dir, start_ring
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import GenerationResult, LocalPipeline
from kvasir.wire import SamplingParams


@contextlib.contextmanager
def running_ring(
    model: Path, windows: Sequence[tuple[int, int]], cache_dir: Path, **kwargs: Any
) -> Iterator[LocalRing]:
    ring = start_ring(model, windows, cache_dir, threads=1, ctx=512, **kwargs)
    try:
        ring.wait_ready(timeout=120)
        yield ring
    finally:
        ring.stop()
        if "run_dir" not in kwargs:  # its own temporary one: the nodes' keys must not pile up in /tmp
            remove_run_dir(ring.run_dir)


def ring_generate(sock: Path, prompt: str, max_tokens: int = 12, **params: Any) -> dict[str, Any]:
    """Tokens and end message of one request through the control socket of ``sock``'s node."""
    with ControlClient(sock, timeout=120) as c:
        return c.complete(prompt=prompt, max_tokens=max_tokens, **params)


def whole_model(model: Path, prompt: str, max_tokens: int = 12) -> GenerationResult:
    """Greedy generation of the whole model in one llama.cpp context (the reference)."""
    with Stage.load(StageConfig(model, n_ctx=512, n_seq_max=1, n_threads=2)) as stage:
        pipe = LocalPipeline([stage])
        prompt_tokens = stage.vocab.tokenize(prompt)
        return pipe.generate(prompt_tokens, SamplingParams(temperature=0.0), max_tokens)


def whole_model_tokens(model: Path, prompt: str, max_tokens: int = 12) -> list[int]:
    return whole_model(model, prompt, max_tokens).tokens
