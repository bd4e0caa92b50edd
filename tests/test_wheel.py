"""The wheel is whole: built from a copy of the tree, installed into a fresh venv, it runs a split generation.

The venv uses ``--system-site-packages`` so llama-cpp-python and the other dependencies come from this machine, and
the wheel goes in with ``--no-deps``. Everything runs outside the repository, without ``PYTHONPATH``, so the checkout
cannot be imported by accident (checked: ``kvasir.__file__`` must lie in the venv).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.stage import capture

REPO = Path(__file__).resolve().parent.parent
COPY_IGNORE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".venv", "tests", "bench", "*.gguf"
)


def _setuptools_version() -> tuple[int, ...]:
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(x) for x in version.split(".")[:2] if x.isdigit())


def build_wheel(out: Path) -> Path:
    """``pip wheel`` of a clean copy of the tree (a build leaves build/ and *.egg-info behind in its source)."""
    src = out / "src"
    shutil.copytree(REPO, src, ignore=COPY_IGNORE)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(src)]
    # Offline when this environment can build wheels itself (setuptools' own bdist_wheel since 70.1, or the `wheel`
    # package); otherwise pip fetches build-system.requires (setuptools>=68) into an isolated build environment.
    if _setuptools_version() >= (70, 1) or importlib.util.find_spec("wheel") is not None:
        cmd.insert(4, "--no-build-isolation")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("kvasir-*.whl")
    return wheel


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


def test_native_library_without_source_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kvasir.stage"):
        assert capture._native_library(tmp_path, tmp_path / "missing.c") is None
    assert "Python callback" in caplog.text
    assert not (tmp_path / "native").exists()


def test_native_library_without_compiler_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "capture.c"
    source.write_bytes(capture._SOURCE.read_bytes() + b"\n/* unique to this test */\n")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert capture._native_library(tmp_path / "cache", source) is None
    monkeypatch.setenv("CC", "false")  # a compiler that runs and fails
    capture._loaded.clear()
    assert capture._native_library(tmp_path / "cache2", source) is None
    assert not list((tmp_path / "cache2").glob("native/*.so"))


@pytest.mark.slow
def test_wheel_installs_and_runs_a_split_generation(tmp_path: Path, tiny_model: Callable[..., Path]) -> None:
    pytest.importorskip("llama_cpp")
    wheel = build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert "kvasir/stage/native/capture.c" in names
    assert any(n.startswith("kvasir/profiles/") and n.endswith(".toml") for n in names)
    assert not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = clean_env(KVASIR_CACHE=str(tmp_path / "cache"))
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    where = subprocess.run(
        [str(py), "-c", "import kvasir; print(kvasir.__file__)"], cwd=work, env=env, capture_output=True, text=True
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr

    model = tiny_model("llama", "q8_0")

    def generate(*args: str) -> dict[str, object]:
        r = subprocess.run(
            [str(venv / "bin" / "kvasir"), "generate", str(model), "--prompt=Hello world", "--json", *args],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        out: dict[str, object] = json.loads(r.stdout)
        return out

    split = generate("--splits=0,2,4,6", "--threads=1", "--max-tokens=8")
    assert split["tokens"] == generate("--threads=1", "--max-tokens=8")["tokens"]
    # The non-last stages used the C callback compiled from the wheel's capture.c (when this machine has a compiler).
    if shutil.which(os.environ.get("CC", "cc")):
        assert list((tmp_path / "cache").glob("native/capture-*.so"))
