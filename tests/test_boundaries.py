"""Where third-party libraries may be imported: each has one home, so swapping or faking it touches one place.

llama.cpp only under ``kvasir/stage`` (every other layer goes through the stage), Textual only in the TUI, SQLite only
in the market server, h11 only in ``kvasir/net``; ``trio.testing`` only in the public testing kit
(``kvasir/testing``), never in code a node runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

#: module -> the folders (relative to the checkout) that may import it.
HOMES: dict[str, tuple[str, ...]] = {
    "llama_cpp": ("kvasir/stage",),
    "textual": ("tui",),
    "sqlite3": ("kvasir/market/server",),
    "h11": ("kvasir/net",),
    "trio.testing": ("kvasir/testing",),
}


def imports(path: Path) -> list[tuple[str, int]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.module, node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
    return out


def homeless(root: Path) -> list[str]:
    problems = []
    for folder in ("kvasir", "relay", "tui"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            for name, line in imports(path):
                for module, homes in HOMES.items():
                    if (name == module or name.startswith(module + ".")) and not rel.startswith(homes):
                        problem = f"{rel}:{line} imports {module} (allowed only in {', '.join(homes)})"
                        if problem not in problems:
                            problems.append(problem)
    return problems


def test_third_party_libraries_stay_in_their_homes() -> None:
    assert not homeless(REPO), "\n".join(homeless(REPO))


@pytest.mark.parametrize(
    ("rel", "source"),
    [
        ("kvasir/ring/x.py", "import trio.testing\n"),
        ("kvasir/ring/x.py", "from trio import testing\n"),
        ("kvasir/verify/x.py", "def f():\n    import llama_cpp\n"),
        ("kvasir/api/x.py", "from textual.app import App\n"),
    ],
)
def test_the_check_catches_an_import_out_of_its_home(tmp_path: Path, rel: str, source: str) -> None:
    target = tmp_path / rel
    target.parent.mkdir(parents=True)
    target.write_text(source)
    (tmp_path / "kvasir" / "stage").mkdir(exist_ok=True)
    (tmp_path / "kvasir" / "stage" / "ok.py").write_text("import llama_cpp\n")
    (tmp_path / "relay").mkdir()
    (tmp_path / "tui").mkdir()
    assert [p.split(":")[0] for p in homeless(tmp_path)] == [rel]
