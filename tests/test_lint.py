"""ruff and strict mypy (over kvasir, relay, tui, tests and bench) are part of the test suite, with the tool
versions pinned in constraints/dev.txt."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO


def test_ruff_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_clean() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def installed_layout(repo: Path, view: Path) -> tuple[Path, list[str]]:
    """Where to run mypy, and on which paths. mypy cannot follow setuptools' ``package-dir`` (``relay/`` installed as
    ``kvasir.relay``), so when pyproject maps folders that way the tree is rebuilt as installed, from symlinks, under
    ``view``; otherwise mypy runs in the repository on its configured files."""
    config = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))
    mapped = {
        folder.strip("/"): package
        for package, folder in config["tool"].get("setuptools", {}).get("package-dir", {}).items()
        if package
    }
    if not mapped:
        return repo, []
    files: list[str] = config["tool"]["mypy"]["files"]
    targets = {view / f: repo / f for f in files if f not in mapped}
    targets |= {view.joinpath(*package.split(".")): repo / folder for folder, package in mapped.items()}
    shutil.rmtree(view, ignore_errors=True)

    def place(dst: Path, src: Path) -> None:
        if not any(dst in t.parents for t in targets):
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.symlink_to(src, target_is_directory=src.is_dir())
            return
        dst.mkdir(parents=True, exist_ok=True)
        for child in src.iterdir():
            if dst / child.name not in targets:
                place(dst / child.name, child)

    for dst in sorted(targets, key=lambda t: len(t.parts)):
        place(dst, targets[dst])
    (view / "pyproject.toml").symlink_to(repo / "pyproject.toml")
    top = [t for t in targets if not any(u in t.parents for u in targets)]
    return view, [str(t.relative_to(view)) for t in sorted(top)]


def test_mypy_strict_clean() -> None:
    cwd, paths = installed_layout(REPO, REPO / ".mypy_cache" / "installed-layout")
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(REPO / ".mypy_cache"), *paths],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_sees_the_installed_layout(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name in ("app/__init__.py", "app/core.py", "plug/__init__.py", "tests/__init__.py"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("")
    (repo / "pyproject.toml").write_text('[tool.mypy]\nfiles = ["app", "tests"]\n')
    assert installed_layout(repo, tmp_path / "view") == (repo, [])
    with (repo / "pyproject.toml").open("a") as f:
        f.write('[tool.setuptools.package-dir]\n"app.plug" = "plug"\n')
    view, paths = installed_layout(repo, tmp_path / "view")
    assert paths == ["app", "tests"]
    assert (view / "app" / "plug").resolve() == repo / "plug"
    assert (view / "app" / "core.py").resolve() == repo / "app" / "core.py"
    assert not (view / "app").is_symlink() and not (view / "plug").exists()


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]).lower()


def test_every_test_tool_is_pinned() -> None:
    """A test-extra requirement is pinned exactly, in the extra or in constraints/dev.txt (scripts/install.sh test
    installs under it), so a new ruff, mypy or Textual release cannot fail the suite without a code change."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    lines = (REPO / "constraints" / "dev.txt").read_text(encoding="utf-8").splitlines()
    pins = {_name(line): line for line in (raw.split("#")[0].strip() for raw in lines) if line}
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+!]+", pin) for pin in pins.values()), pins
    unpinned = [r for r in extra["test"] if "==" not in r and _name(r) not in pins]
    assert not unpinned, f"pin these in constraints/dev.txt: {unpinned}"


def test_the_wheel_lists_every_package_and_installs_only_kvasir() -> None:
    """pyproject's explicit package list (needed for package-dir) covers every package folder, and every name in it
    is under ``kvasir``: relay/ and tui/ install as kvasir.relay and kvasir.tui, never as top-level names."""
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"kvasir": "kvasir", **{name: path for name, path in setup["package-dir"].items() if name}}
    found = set()
    for package, folder in folders.items():
        for init in (REPO / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / folder)
            found.add(".".join([package, *rel.parts]))
    listed = set(setup["packages"])
    assert listed == found, f"missing: {sorted(found - listed)}, stale: {sorted(listed - found)}"
    assert all(name == "kvasir" or name.startswith("kvasir.") for name in listed)


#: No class grows past this many lines (a god object again), and the ring node's module stays the thin dispatcher.
CLASS_LINE_LIMIT = 400
NODE_MODULE = ("kvasir/ring/node.py", 450)
#: Classes still over the limit while they are being split: ``path:Class``. A name here that is no longer over the
#: limit fails too, so the set cannot go stale.
OVERSIZED_EXEMPT: frozenset[str] = frozenset()


def oversized_classes(repo: Path, folders: tuple[str, ...], limit: int) -> dict[str, int]:
    """``path:Class`` (nested: ``Outer.Inner``) → lines, for every class in ``folders`` longer than ``limit``."""
    import ast

    found: dict[str, int] = {}

    def walk(node: ast.AST, path: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                if lines > limit:
                    found[f"{path}:{name}"] = lines
                walk(child, path, f"{name}.")
            else:
                walk(child, path, prefix)

    for folder in folders:
        for file in sorted((repo / folder).rglob("*.py")):
            walk(ast.parse(file.read_text(encoding="utf-8")), file.relative_to(repo).as_posix(), "")
    return found


def test_no_class_over_the_line_limit_and_the_node_stays_thin() -> None:
    found = oversized_classes(REPO, ("kvasir", "relay", "tui"), CLASS_LINE_LIMIT)
    grown = {name: n for name, n in found.items() if name not in OVERSIZED_EXEMPT}
    assert not grown, f"classes over {CLASS_LINE_LIMIT} lines (split them by feature): {grown}"
    stale = sorted(OVERSIZED_EXEMPT - found.keys())
    assert not stale, f"no longer over {CLASS_LINE_LIMIT} lines: drop them from OVERSIZED_EXEMPT: {stale}"
    path, limit = NODE_MODULE
    lines = len((REPO / path).read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{path} has {lines} lines (at most {limit}): its features belong beside it"


def test_the_class_size_check_sees_nested_and_long_classes(tmp_path: Path) -> None:
    def body(indent: int) -> str:
        return "\n".join(f"{' ' * indent}x{i} = {i}" for i in range(6))

    (tmp_path / "pkg").mkdir()
    big = f"class Small:\n    x = 1\n\nclass Big:\n{body(4)}\n    class Inner:\n{body(8)}\n"
    (tmp_path / "pkg" / "m.py").write_text(big)
    (tmp_path / "pkg" / "other.py").write_text(f"def f():\n    class Local:\n{body(8)}\n")
    found = oversized_classes(tmp_path, ("pkg",), 5)
    assert found == {"pkg/m.py:Big": 14, "pkg/m.py:Big.Inner": 7, "pkg/other.py:Local": 7}
