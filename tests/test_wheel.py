"""The wheel is whole: built from a copy of the tree, installed with its dependencies into a fresh venv, it runs.

The venv has no system site packages: every dependency comes from the wheel's own metadata (PyPI), except the pinned
llama-cpp-python, which comes from the wheel scripts/install.sh built and cached (`pip --find-links`), as a user's
install gets it. So an import the metadata does not declare fails here, as it would for a user. Everything runs
outside the repository, without ``PYTHONPATH``, so the checkout cannot be imported by accident (checked:
``kvasir.__file__`` must lie in the venv). The same venv then runs as Termux's Python does (``sys.platform ==
"android"``, the patched loader).
"""

from __future__ import annotations

import hashlib
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
from tests.test_termux import ANDROID_MAIN, android_copy, patcher

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


def venv_site_packages(venv: Path) -> Path:
    (site,) = venv.glob("lib/python3*/site-packages")
    return site


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


def cached_llama_wheel() -> Path | None:
    """The llama-cpp-python wheel scripts/install.sh built for this machine's flags (its cache key), if any."""
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh"), "--print-cmake-args"], capture_output=True, text=True, check=True
    )
    key = hashlib.sha256(r.stdout.removesuffix("\n").encode()).hexdigest()[:12]
    root = Path(os.environ.get("KVASIR_WHEEL_DIR") or Path.home() / ".cache" / "kvasir" / "wheels")
    return next(iter(sorted((root / key).glob("llama_cpp_python-0.3.36-*.whl"))), None)


def test_a_library_built_with_the_package_needs_no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flake.nix compiles native/capture.so beside the source at build time; run time then never calls a compiler."""
    source = tmp_path / "capture.c"
    source.write_bytes(capture._SOURCE.read_bytes() + b"\n/* prebuilt by this test */\n")
    r = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(tmp_path / "capture.so"), str(source)])
    if r.returncode != 0:
        pytest.skip("no C compiler here to stand in for the package build")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    lib = capture._native_library(tmp_path / "cache", source)
    assert lib is not None and hasattr(lib, "kvasir_capture_eval")
    assert not (tmp_path / "cache").exists()  # nothing compiled or cached at run time


@pytest.mark.slow
def test_wheel_installs_with_its_dependencies_and_runs(tmp_path: Path, tiny_model: Callable[..., Path]) -> None:
    pytest.importorskip("llama_cpp")
    llama_wheel = cached_llama_wheel()
    if llama_wheel is None:
        pytest.skip("no cached llama-cpp-python wheel (scripts/install.sh builds one)")
    wheel = build_wheel(tmp_path / "dist")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert "kvasir/stage/native/capture.c" in names
    assert any(n.startswith("kvasir/profiles/") and n.endswith(".toml") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    assert "kvasir/examples/devices-mixed.toml" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = clean_env(KVASIR_CACHE=str(tmp_path / "cache"))
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--find-links", str(llama_wheel.parent), str(wheel)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    version = subprocess.run(
        [str(venv / "bin" / "kvasir"), "--version"], cwd=work, env=env, capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.strip() == f"kvasir {importlib.metadata.version('kvasir')}", (
        version.stdout + version.stderr
    )
    where = subprocess.run(
        [str(py), "-c", "import kvasir; print(kvasir.__file__)"], cwd=work, env=env, capture_output=True, text=True
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr

    model = tiny_model("llama", "q8_0")

    def kvasir(*args: str, android: Path | None = None) -> dict[str, object]:
        cmd = [str(venv / "bin" / "kvasir")] if android is None else [str(py), "-c", ANDROID_MAIN, str(android)]
        r = subprocess.run(
            [*cmd, *args, "--json"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr
        out: dict[str, object] = json.loads(r.stdout)
        return out

    def generate(*args: str, android: Path | None = None) -> dict[str, object]:
        return kvasir("generate", str(model), "--prompt=Hello world", "--threads=1", "--max-tokens=8", *args,
                      android=android)  # fmt: skip

    whole = generate()["tokens"]
    assert generate("--splits=0,2,4,6")["tokens"] == whole
    ring = kvasir("ring", "up", str(model), "--stages=2", "--threads=1", "--prompt=Hello world", "--max-tokens=8")
    assert ring["tokens"] == whole

    # As on Termux: sys.platform == "android", the venv's llama_cpp with scripts/install.sh's loader patch.
    site = venv_site_packages(venv)
    android = android_copy(site / "llama_cpp", tmp_path / "android")
    patcher.patch(android)
    assert generate("--splits=0,3,6", android=android)["tokens"] == whole
    ring = kvasir("ring", "up", str(model), "--stages=2", "--threads=1", "--prompt=Hello world", "--max-tokens=8",
                  android=android)  # fmt: skip
    assert ring["tokens"] == whole
    # The non-last stages used the C callback compiled from the wheel's capture.c (when this machine has a compiler).
    if shutil.which(os.environ.get("CC", "cc")):
        assert list((tmp_path / "cache").glob("native/capture-*.so"))
