"""ruff and strict mypy (over kvasir, relay, tui, tests and bench) are part of the test suite, with the tool
versions pinned in constraints/dev.txt."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

from tests.conftest import REPO


def test_ruff_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_clean() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


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
