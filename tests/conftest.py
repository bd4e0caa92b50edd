"""Shared fixtures: real GGUF models (generated tiny ones and the Gemma 3 270M demo) and the CLI runner.

Model files are cached under ``$KVASIR_CACHE`` (default ``~/.cache/kvasir``) keyed by every parameter that
determines their bytes, so repeated runs reuse them; nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.demo import demo_model_path
from kvasir.shard.cache import default_cache_dir
from kvasir.testing.tinymodels import tiny_model_cached

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return default_cache_dir()


@pytest.fixture(scope="session")
def gemma_path(cache_dir: Path) -> Path:
    return demo_model_path(cache_dir)


@pytest.fixture(scope="session")
def tiny_model(cache_dir: Path) -> Callable[..., Path]:
    def make(arch: str, quant: str = "f32", **dims: int) -> Path:
        return tiny_model_cached(cache_dir / "tiny", arch, quant, **dims)

    return make


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``kvasir ARGS`` in a fresh interpreter, as a user would."""
    env = dict(os.environ)
    return subprocess.run(
        [sys.executable, "-m", "kvasir", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
