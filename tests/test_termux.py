"""Android (Termux) support, simulated here: ``sys.platform == "android"`` with the patched llama-cpp-python loader.

Termux's Python 3.13 reports ``sys.platform == "android"`` (PEP 738); llama-cpp-python 0.3.36's loader refuses that
platform, and ``scripts/install.sh`` patches it at build time (``scripts/patch_llama_android.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO

SCRIPTS = REPO / "scripts"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


patcher = _load(SCRIPTS / "patch_llama_android.py", "patch_llama_android")


def cmake_args(machine: str, os_name: str, **env: str) -> list[str]:
    r = subprocess.run(
        ["bash", str(SCRIPTS / "install.sh"), "--print-cmake-args"],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/"), "KVASIR_UNAME_M": machine}
        | {"KVASIR_UNAME_O": os_name, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return r.stdout.split()


def test_install_sh_turns_openmp_off_only_on_android() -> None:
    assert cmake_args("aarch64", "Android") == ["-DGGML_OPENMP=OFF"]
    assert cmake_args("aarch64", "GNU/Linux", TERMUX_VERSION="0.118.1") == ["-DGGML_OPENMP=OFF"]
    assert cmake_args("aarch64", "GNU/Linux") == []
    x86 = cmake_args("x86_64", "GNU/Linux")
    assert "-DGGML_NATIVE=OFF" in x86 and "-DGGML_BMI2=ON" in x86 and "-DGGML_OPENMP=OFF" not in x86
    assert cmake_args("x86_64", "GNU/Linux", CMAKE_ARGS="-DGGML_CUDA=on")[0] == "-DGGML_CUDA=on"


@pytest.fixture(scope="module")
def llama_cpp_dir() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed")
    return Path(spec.origin).parent


def android_copy(llama_cpp_dir: Path, dest: Path) -> Path:
    """llama_cpp as it is installed (its files linked, not copied), with the loader copied so it can be patched."""
    pkg = dest / "llama_cpp"
    pkg.mkdir(parents=True)
    for entry in llama_cpp_dir.iterdir():
        if entry.name not in ("_ctypes_extensions.py", "__pycache__"):
            (pkg / entry.name).symlink_to(entry)
    (pkg / "_ctypes_extensions.py").write_bytes((llama_cpp_dir / "_ctypes_extensions.py").read_bytes())
    return dest


def test_the_unpatched_loader_refuses_android_and_the_patched_one_loads(
    llama_cpp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = android_copy(llama_cpp_dir, tmp_path)
    loader = root / "llama_cpp" / "_ctypes_extensions.py"
    monkeypatch.setattr(sys, "platform", "android")
    with pytest.raises(RuntimeError, match="Unsupported platform"):
        _load(loader, "unpatched_loader").load_shared_library("llama", llama_cpp_dir / "lib")
    assert patcher.patch(root) is True
    assert patcher.patch(root) is False  # idempotent
    lib = _load(loader, "patched_loader").load_shared_library("llama", llama_cpp_dir / "lib")
    assert hasattr(lib, "llama_backend_init")


def test_the_patch_refuses_a_loader_it_does_not_know(tmp_path: Path) -> None:
    (tmp_path / "llama_cpp").mkdir()
    (tmp_path / "llama_cpp" / "_ctypes_extensions.py").write_text("def load_shared_library(): pass\n")
    with pytest.raises(SystemExit, match="not patched"):
        patcher.patch(tmp_path)


ANDROID_MAIN = """
import sys
sys.platform = "android"  # what Termux's Python 3.13 reports, before anything reads it
sys.path.insert(0, sys.argv.pop(1))
import llama_cpp
assert llama_cpp.__file__.startswith(sys.path[0]), llama_cpp.__file__
from kvasir.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_split_generation_runs_as_on_android(
    llama_cpp_dir: Path, tmp_path: Path, tiny_model: Callable[..., Path]
) -> None:
    root = android_copy(llama_cpp_dir, tmp_path / "site")
    patcher.patch(root)
    model = tiny_model("llama", "q8_0")
    args = ["generate", str(model), "--prompt", "Hello world", "--max-tokens=8", "--threads=1", "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def run(*cmd: str) -> dict[str, object]:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out: dict[str, object] = json.loads(r.stdout)
        return out

    android = run(sys.executable, "-c", ANDROID_MAIN, str(root), *args, "--splits", "0,3,6")
    assert android["tokens"] == run(sys.executable, "-m", "kvasir", *args)["tokens"]


def test_termux_setup_refuses_to_run_outside_termux() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TERMUX_VERSION"}
    r = subprocess.run(["bash", str(SCRIPTS / "termux-setup.sh")], env=env, capture_output=True, text=True)
    assert r.returncode == 2 and "not Termux" in r.stderr


TIED_CHILD = """
import os, signal, sys
from pathlib import Path
sys.platform = "android"  # what Termux's Python reports, before kvasir reads it
from kvasir.local.launcher import spawn
child = spawn([sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ), Path(sys.argv[1]), tied=True)
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # as Android's phantom-process killer ends `kvasir ring up`
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its new parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux's /proc (and prctl) underneath")
def test_a_tied_node_dies_with_a_killed_ring_up_on_android(tmp_path: Path) -> None:
    """Bionic has Linux's PR_SET_PDEATHSIG: `kill -9` of `ring up` on a phone must not leave its nodes running."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run(
        [sys.executable, "-c", TIED_CHILD, str(tmp_path / "child.log")], env=env, capture_output=True, text=True
    )
    assert r.returncode == -9, r.stderr
    child = int(r.stdout)
    try:
        deadline = time.monotonic() + 20
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(child), "the node outlived the ring up that started it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
