"""flake.nix stays in step with scripts/install.sh and pyproject.toml (offline: no nixpkgs is evaluated here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib

import pytest

from tests.conftest import REPO

FLAKE = (REPO / "flake.nix").read_text()
LLAMA_NIX = (REPO / "nix" / "llama-cpp-python.nix").read_text()
INSTALL_SH = (REPO / "scripts" / "install.sh").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def nix_list(name: str) -> list[str]:
    match = re.search(rf"\b{name} = \[(.*?)\];", FLAKE, re.S)
    assert match, f"no list {name} in flake.nix"
    return re.findall(r'"([^"]+)"', match.group(1))


def install_sh_flags(machine: str) -> list[str]:
    r = subprocess.run(
        ["bash", str(REPO / "scripts" / "install.sh"), "--print-cmake-args"],
        env={"PATH": os.environ["PATH"], "KVASIR_UNAME_M": machine, "KVASIR_UNAME_O": "GNU/Linux"},
        capture_output=True,
        text=True,
        check=True,
    )
    return r.stdout.split()


def llama_pin() -> str:
    (spec,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("llama-cpp-python")]
    assert spec.startswith("llama-cpp-python==")
    return str(spec).removeprefix("llama-cpp-python==")


def test_x86_flags_equal_install_sh() -> None:
    assert nix_list("x86Flags") == install_sh_flags("x86_64")


def test_other_builds_are_portable() -> None:
    # install.sh builds natively for the machine it runs on; a Nix store path is shared between machines.
    assert nix_list("portableFlags") == ["-DGGML_NATIVE=OFF"]
    assert install_sh_flags("aarch64") == []


def test_llama_cpp_python_pin_is_the_same_everywhere() -> None:
    version = llama_pin()
    assert f"llama_version={version}\n" in INSTALL_SH
    assert re.search(rf'"{re.escape(version)}" = "sha256-[A-Za-z0-9+/]{{43}}=";', LLAMA_NIX)
    # The flake takes the version from pyproject, not from a copy of it.
    assert version not in FLAKE and 'lib.hasPrefix "llama-cpp-python=="' in FLAKE


def test_dependencies_come_from_pyproject() -> None:
    assert "builtins.fromTOML (builtins.readFile ./pyproject.toml)" in FLAKE
    assert "pyproject.project.dependencies" in FLAKE
    names = [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in PYPROJECT["project"]["dependencies"]]
    assert "llama-cpp-python" in names and "trio" in names
    assert not [n for n in names if f"ps.{n}" in FLAKE or f"pkgs.{n} " in FLAKE]


def test_nixpkgs_is_pinned_and_python_is_the_cached_default() -> None:
    match = re.search(r"inputs\.nixpkgs = \{(.*?)\};", FLAKE, re.S)
    assert match, "nixpkgs input is not an attribute set"
    attrs = dict(re.findall(r'(\w+) = "([^"]+)";', match.group(1)))
    assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", attrs["narHash"])
    assert re.search(r"/(refs/tags/\d\d\.\d\d|[0-9a-f]{40})\.tar\.gz$", attrs["url"]), attrs["url"]
    assert "nixos-unstable" not in FLAKE
    assert not re.search(r"python3\d+", FLAKE)  # only python3 is built and cached by Hydra


@pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="nix is not installed")
@pytest.mark.parametrize("path", ["flake.nix", "nix/llama-cpp-python.nix"])
def test_nix_files_parse(path: str) -> None:
    r = subprocess.run(["nix-instantiate", "--parse", str(REPO / path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


FAKE_LIB = """{
  concatStringsSep = builtins.concatStringsSep;
  optionals = cond: list: if cond then list else [ ];
  getDev = x: x;
  getExe = x: x;
  licenses.mit = "mit";
}"""


@pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="nix is not installed")
def test_llama_recipe_builds_the_pinned_sdist_with_the_flags_it_is_given() -> None:
    """Evaluate nix/llama-cpp-python.nix with stand-ins for nixpkgs (no nixpkgs here): source and cmake arguments."""
    flags = nix_list("x86Flags")
    expr = f"""
      let recipe = import {REPO / "nix" / "llama-cpp-python.nix"} {{
        lib = {FAKE_LIB};
        stdenv = {{ }};
        buildPythonPackage = attrs: attrs;
        fetchPypi = attrs: attrs;
        version = "{llama_pin()}";
        cmakeFlags = [ {" ".join(f'"{f}"' for f in flags)} ];
        cmake = "cmake"; ninja = "ninja"; scikit-build-core = "skb"; pathspec = "ps"; pyproject-metadata = "pm";
        numpy = "np"; typing-extensions = "te"; diskcache = "dc"; jinja2 = "j2";
      }};
      in {{ inherit (recipe) version src dontUseCmakeConfigure; args = recipe.env.SKBUILD_CMAKE_ARGS; }}
    """
    r = subprocess.run(["nix-instantiate", "--eval", "--strict", "--json", "-E", expr], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["args"].split(";") == flags == install_sh_flags("x86_64")
    assert got["src"]["pname"] == "llama_cpp_python" and got["src"]["version"] == got["version"] == llama_pin()
    assert got["dontUseCmakeConfigure"] is True


@pytest.mark.skipif(shutil.which("nix-instantiate") is None, reason="nix is not installed")
def test_flake_outputs_against_a_stub_nixpkgs() -> None:
    """The flake's own logic (not nixpkgs' API): outputs per system, dependencies from pyproject, flags per system."""
    evaluate = REPO / "tests" / "data" / "nixpkgs-stub" / "eval-flake.nix"
    r = subprocess.run(["nix-instantiate", "--eval", "--strict", "--json", evaluate], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    systems = ["aarch64-darwin", "aarch64-linux", "x86_64-linux"]
    assert sorted(got["packages"]) == systems
    assert got["packages"]["aarch64-darwin"] == ["default", "kvasir"]
    assert got["packages"]["x86_64-linux"] == ["cuda", "default", "kvasir"]
    for system in systems:
        assert sorted(got["apps"][system]) == ["default", "node", "relay", "tui"]
        assert all(app["type"] == "app" and app["meta"]["description"] for app in got["apps"][system].values())
        assert got["checks"][system] == ["cli", "package"]
    assert "iproute2" in got["devShells"]["x86_64-linux"] and "iproute2" not in got["devShells"]["aarch64-darwin"]
    names = [re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] for d in PYPROJECT["project"]["dependencies"]]
    assert got["kvasir"]["dependencies"] == names and got["kvasir"]["version"] == PYPROJECT["project"]["version"]
    assert got["llamaVersion"] == llama_pin()
    assert got["llamaArgs"]["x86_64-linux"].split(";") == install_sh_flags("x86_64")
    assert got["llamaArgs"]["aarch64-linux"] == got["llamaArgs"]["aarch64-darwin"] == "-DGGML_NATIVE=OFF"
    assert got["cudaArgs"].startswith(got["llamaArgs"]["x86_64-linux"] + ";-DGGML_CUDA=ON;")
    assert got["ggufWithoutPyside"] is True
    # The capture callback is compiled at build time, so no compiler is put on the runtime PATH (or in the closure).
    assert "kvasir/stage/native/capture.so kvasir/stage/native/capture.c" in got["kvasir"]["preBuild"]
    assert "PATH" not in got["kvasir"]["makeWrapperArgs"]
    # Everything pyproject's package-dir and license name is in the build's source.
    assert {f.rsplit("/", 1)[-1] for f in got["kvasir"]["files"]} >= {"examples", "LICENSE", "relay", "tui", "kvasir"}
    # CUDA libraries find the host's driver (libcuda.so) at run time; the CPU build needs no such hook.
    assert "autoAddDriverRunpath" in got["cudaNativeInputs"] and "autoAddDriverRunpath" not in got["cpuNativeInputs"]
