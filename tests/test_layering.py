"""The import graph shows the data path: each layer imports only its own layer and the layers below it, and no two
packages import each other (directly or round a longer loop); of each pair in ``APART`` the first never imports the
second. Read from the source tree's AST, lazy and ``TYPE_CHECKING`` imports included: a function-local import is still a
dependency.

To place a new package, add it to ``LAYERS``; a module that matches no entry fails ``test_every_module_has_a_layer``.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parent.parent

#: Lowest layer first. An entry ``a.b.*`` is the package ``a.b`` and everything below it; a plain ``a.b`` is that one
#: module. Each entry is one unit of the package-cycle check; an entry that holds no module fails.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # kvasir.core.codes (the wire's error codes, no imports) and kvasir.core.errors (the error tree, which carries
    # them) are units of their own: util raises Kvasir's errors, and core uses util.
    # examples/ is data (installed as kvasir.examples): it imports nothing of Kvasir's.
    (
        "foundation",
        (
            "kvasir",
            "kvasir.core.errors",
            "kvasir.core.codes",
            "kvasir.core.*",
            "kvasir.util.*",
            "kvasir.examples",
        ),
    ),
    ("shard", ("kvasir.shard.*",)),
    # The planner and the shipped profiles read GGUF metadata only.
    ("stage", ("kvasir.stage.*", "kvasir.planner.*", "kvasir.profiles.*")),
    ("wire", ("kvasir.wire.*",)),
    # Commitments, audits and probes: re-run windows (stage) on wire payloads; the ring records receipts with it.
    ("verify", ("kvasir.verify.*",)),
    ("ring", ("kvasir.ring.*",)),
    (
        "services",
        (
            "kvasir.relay.*",
            "kvasir.market.*",
            "kvasir.market.server.*",
            "kvasir.market.agent.*",
            "kvasir.control.*",
            "kvasir.api.*",
            "kvasir.net.*",
        ),
    ),
    (
        "front",
        (
            "kvasir.commands.*",
            "kvasir.tui.*",
            "kvasir.cli",
            "kvasir.__main__",
            # `kvasir relay` (it can run a market beside the relay): a command, though it lives with the relay.
            "kvasir.relay.cli",
            "kvasir.relay.__main__",
            "kvasir.local.*",  # process harness for `ring up`, tests and benches
            "kvasir.demo",
            "kvasir.testing.*",
        ),
    ),
)

#: Inside "services" every unit is a peer of the others; these are the only sideways imports allowed (unit ->
#: unit). The API speaks HTTP through net; the market's halves share its records (kvasir.market.*) and the relay's
#: grants; the server serves HTTP through net. Anything else (the API reaching into the market's store, say) fails.
SERVICES_SIDEWAYS: frozenset[tuple[str, str]] = frozenset(
    {
        ("kvasir.api.*", "kvasir.net.*"),
        ("kvasir.market.agent.*", "kvasir.market.*"),
        ("kvasir.market.agent.*", "kvasir.relay.*"),
        ("kvasir.market.server.*", "kvasir.market.*"),
        ("kvasir.market.server.*", "kvasir.net.*"),
        ("kvasir.market.server.*", "kvasir.relay.*"),
    }
)

#: Peers in one layer that stay apart: the first must not import the second (the market's server half knows nothing
#: of the node agent that drives a Stage and a Node).
APART: tuple[tuple[str, str], ...] = (("kvasir.market.server.*", "kvasir.market.agent.*"),)


@attrs.frozen
class Edge:
    """One import statement from ``src`` (a module) to ``dst`` (a module), at ``path:line``."""

    path: str
    line: int
    src: str
    dst: str


@attrs.frozen
class Report:
    upward: tuple[str, ...]
    apart: tuple[str, ...]
    cycles: tuple[str, ...]
    unplaced: tuple[str, ...]


def source_roots(repo: Path) -> dict[str, Path]:
    """Top-level import name -> folder, from pyproject's setuptools config (``packages.find`` include patterns and
    ``package-dir``), so the test follows ``relay/`` when it becomes ``kvasir.relay``."""
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    packages = setuptools.get("packages", {})
    listed = packages if isinstance(packages, list) else packages.get("find", {}).get("include", [])
    roots = {p.rstrip("*."): repo / p.rstrip("*.") for p in listed if "." not in p.rstrip("*.")}
    for package, folder in setuptools.get("package-dir", {}).items():
        if package:
            by_folder = {v: k for k, v in roots.items()}
            roots.pop(by_folder.get(repo / folder, ""), None)
            roots[package] = repo / folder
    return {name: folder for name, folder in roots.items() if (folder / "__init__.py").is_file()}


def module_files(roots: Mapping[str, Path]) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` under the roots (a package's ``__init__.py`` is the package)."""
    out: dict[str, Path] = {}
    for name, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def _imports(module: str, path: Path, known: Mapping[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative imports resolved, ``from p import m`` read as
    the module ``p.m`` when that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if sub in known else base


def import_edges(repo: Path, roots: Mapping[str, Path]) -> list[Edge]:
    """Every import from a module under the roots to another module under the roots."""
    known = module_files(roots)
    edges: dict[Edge, None] = {}  # ordered set: `from m import a, b` is one edge
    for module, path in known.items():
        for line, target in _imports(module, path, known):
            if target.split(".")[0] in {name.split(".")[0] for name in roots}:
                edges[Edge(str(path.relative_to(repo)), line, module, target)] = None
    return list(edges)


def placement(module: str, layers: Iterable[tuple[str, tuple[str, ...]]]) -> tuple[int, str, str] | None:
    """(layer index, layer name, entry) of the most specific entry that holds the module, or None."""
    best: tuple[int, str, str] | None = None
    for index, (name, entries) in enumerate(layers):
        for entry in entries:
            package = entry.removesuffix(".*")
            hit = module == package or (entry.endswith(".*") and module.startswith(package + "."))
            if hit and (best is None or len(package) > len(best[2].removesuffix(".*"))):
                best = (index, name, entry)
    return best


def _cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: list[str] = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(
    repo: Path, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS, apart: tuple[tuple[str, str], ...] = APART
) -> Report:
    roots = source_roots(repo)
    unplaced = sorted(
        f"{path.relative_to(repo)} ({module})"
        for module, path in module_files(roots).items()
        if placement(module, layers) is None
    )
    upward: list[str] = []
    crossing: list[str] = []
    graph: dict[str, set[str]] = {}
    by_units: dict[tuple[str, str], list[Edge]] = {}
    for edge in import_edges(repo, roots):
        src, dst = placement(edge.src, layers), placement(edge.dst, layers)
        if src is None or dst is None:
            if dst is None:
                unplaced.append(f"{edge.path}:{edge.line} imports {edge.dst}, which has no layer")
            continue
        if dst[0] > src[0]:
            upward.append(f"{edge.path}:{edge.line} {edge.src} -> {edge.dst} ({src[1]} -> {dst[1]})")
        if (src[2], dst[2]) in apart:
            crossing.append(f"{edge.path}:{edge.line} {edge.src} -> {edge.dst} ({src[2]} must not import {dst[2]})")
        if src[2] != dst[2]:
            graph.setdefault(src[2], set()).add(dst[2])
            by_units.setdefault((src[2], dst[2]), []).append(edge)
    cycles = []
    for component in _cycles(graph):
        pairs = [
            f"  {a} -> {b}: " + ", ".join(f"{e.path}:{e.line}" for e in es)
            for (a, b), es in sorted(by_units.items())
            if a in component and b in component
        ]
        cycles.append("\n".join([f"cycle through {', '.join(component)}:", *pairs]))
    return Report(tuple(upward), tuple(crossing), tuple(cycles), tuple(sorted(unplaced)))


def stale_entries(repo: Path, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> list[str]:
    """Entries of ``layers`` that hold no module: a moved or deleted package leaves one behind."""
    modules = module_files(source_roots(repo))
    return [
        entry
        for _, entries in layers
        for entry in entries
        if not any(placement(module, (("", (entry,)),)) for module in modules)
    ]


def sideways(repo: Path, allowed: frozenset[tuple[str, str]] = SERVICES_SIDEWAYS, layer: str = "services") -> list[str]:
    """Imports between two units of ``layer`` that ``allowed`` does not list."""
    out = []
    for edge in import_edges(repo, source_roots(repo)):
        src, dst = placement(edge.src, LAYERS), placement(edge.dst, LAYERS)
        if src and dst and src[1] == dst[1] == layer and src[2] != dst[2] and (src[2], dst[2]) not in allowed:
            out.append(f"{edge.path}:{edge.line} {edge.src} -> {edge.dst} ({src[2]} -> {dst[2]} is not listed)")
    return out


# ---------------------------------------------------------------------------------------------------- the real tree


def test_the_tree_is_read() -> None:
    """Guards the checker against reading nothing: every top-level package folder is a source root, and the graph
    holds the edges everyone knows about."""
    roots = source_roots(REPO)
    folders = {p.parent for p in REPO.glob("*/__init__.py")} - {REPO / "tests"}
    assert folders <= set(roots.values()), f"package folders not read: {folders - set(roots.values())}"
    edges = {(e.src, e.dst) for e in import_edges(REPO, roots)}
    assert ("kvasir.__main__", "kvasir.cli") in edges and ("kvasir.cli", "kvasir.util.cli") in edges
    assert len(module_files(roots)) > 80


def test_every_layer_entry_names_something() -> None:
    stale = stale_entries(REPO)
    assert not stale, f"LAYERS entries that hold no module (remove them): {stale}"


def test_services_import_each_other_only_along_listed_edges() -> None:
    found = sideways(REPO)
    assert not found, "sideways imports inside services (list them in SERVICES_SIDEWAYS if meant):\n" + "\n".join(found)


def test_the_sideways_check_sees_an_unlisted_edge() -> None:
    assert sideways(REPO, allowed=SERVICES_SIDEWAYS - {("kvasir.api.*", "kvasir.net.*")})
    assert stale_entries(REPO, (("x", ("kvasir.no_such_package.*", "kvasir.cli")),)) == ["kvasir.no_such_package.*"]


def test_every_module_has_a_layer() -> None:
    unplaced = check(REPO).unplaced
    assert not unplaced, "add these to LAYERS in tests/test_layering.py:\n" + "\n".join(unplaced)


def test_no_upward_imports() -> None:
    upward = check(REPO).upward
    assert not upward, f"{len(upward)} imports go up the layers (file:line, from -> to):\n" + "\n".join(upward)


def test_apart_halves_stay_apart() -> None:
    apart = check(REPO).apart
    assert not apart, "\n".join(apart)


def test_no_package_cycles() -> None:
    cycles = check(REPO).cycles
    assert not cycles, "package cycles:\n" + "\n".join(cycles)


# ---------------------------------------------------------------------------------------------------- the checker


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    (root / "pyproject.toml").write_text('[tool.setuptools.packages.find]\ninclude = ["app*", "extra*"]\n')
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


SYNTHETIC: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("low", ("app", "app.base.*")),
    ("mid", ("app.mid.*", "app.peer.*")),
    ("high", ("app.top", "extra.*")),
)


def test_checker_finds_upward_lazy_relative_and_from_imports(tmp_path: Path) -> None:
    repo = _tree(
        tmp_path,
        {
            "app/__init__.py": "",
            "app/top.py": "from app.mid import x\n",
            "app/base/__init__.py": "",
            "app/base/a.py": "def f() -> None:\n    from app.mid import b\n",  # lazy, names a module
            "app/base/c.py": "from .. import top\n",  # relative, names a module
            "app/base/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import extra.thing\n",
            "app/mid/__init__.py": "x = 1\n",
            "app/mid/b.py": "from ..base import a\n",  # downward: fine
            "extra/__init__.py": "",
            "extra/thing.py": "import app.base.a\n",
        },
    )
    report = check(repo, SYNTHETIC)
    assert report.upward == (
        "app/base/a.py:2 app.base.a -> app.mid.b (low -> mid)",
        "app/base/c.py:1 app.base.c -> app.top (low -> high)",
        "app/base/d.py:3 app.base.d -> extra.thing (low -> high)",
    )
    assert report.unplaced == ()


def test_checker_finds_cycles_between_peers_and_unplaced_modules(tmp_path: Path) -> None:
    repo = _tree(
        tmp_path,
        {
            "app/__init__.py": "",
            "app/mid/__init__.py": "from app.peer import p\n",
            "app/peer/__init__.py": "",
            "app/peer/p.py": "import app.mid\nimport app.stray\n",
            "app/stray.py": "",
        },
    )
    report = check(repo, SYNTHETIC, (("app.peer.*", "app.mid.*"),))
    assert report.upward == ()
    assert report.apart == ("app/peer/p.py:1 app.peer.p -> app.mid (app.peer.* must not import app.mid.*)",)
    assert report.cycles == (
        "cycle through app.mid.*, app.peer.*:\n"
        "  app.mid.* -> app.peer.*: app/mid/__init__.py:1\n"
        "  app.peer.* -> app.mid.*: app/peer/p.py:1",
    )
    assert report.unplaced == ("app/peer/p.py:2 imports app.stray, which has no layer", "app/stray.py (app.stray)")


def test_checker_follows_package_dir(tmp_path: Path) -> None:
    repo = _tree(tmp_path, {"app/__init__.py": "", "app/base/__init__.py": "", "sub/__init__.py": "import app.top\n"})
    with (repo / "pyproject.toml").open("a") as f:
        f.write('[tool.setuptools.package-dir]\n"app.base.sub" = "sub"\n')
    assert source_roots(repo) == {"app": repo / "app", "app.base.sub": repo / "sub"}
    assert check(repo, SYNTHETIC).upward == ("sub/__init__.py:1 app.base.sub -> app.top (low -> high)",)
