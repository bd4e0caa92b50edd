"""Per-user directories from kvasir.util.dirs under a monkeypatched environment (XDG, TMPDIR, Termux-like)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from kvasir.control.paths import node_socket_path
from kvasir.core.errors import InputError
from kvasir.shard.cache import default_cache_dir
from kvasir.util.dirs import cache_dir, config_dir, data_dir, runtime_dir

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="XDG layout is the Linux/Termux one")


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fresh HOME with none of the variables these directories follow."""
    for var in ("XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_CONFIG_HOME", "KVASIR_CACHE", "TMPDIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_runtime_dir_under_xdg_runtime_dir(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    xdg = tmp_path / "run"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert runtime_dir() == xdg / "kvasir"
    assert _mode(xdg / "kvasir") == 0o700
    assert node_socket_path(0, 7000) == xdg / "kvasir" / "rank0-7000.sock"


@pytest.mark.parametrize("xdg", [None, "", "relative/run"])
def test_runtime_dir_without_xdg_follows_tmpdir(
    home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, xdg: str | None
) -> None:
    """Termux: no XDG_RUNTIME_DIR, no /tmp, TMPDIR=$PREFIX/tmp. A relative XDG value is ignored (XDG spec)."""
    prefix_tmp = tmp_path / "usr" / "tmp"
    prefix_tmp.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(prefix_tmp))
    if xdg is not None:
        monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    d = runtime_dir()
    assert d == prefix_tmp / f"kvasir-{os.getuid()}"
    assert d.is_dir() and _mode(d) == 0o700
    assert runtime_dir() == d  # idempotent


def test_runtime_dir_refuses_group_access(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    shared = tmp_path / f"kvasir-{os.getuid()}"
    shared.mkdir(mode=0o700)
    shared.chmod(0o755)
    with pytest.raises(InputError, match="mode 0700"):
        runtime_dir()


def test_runtime_dir_refuses_a_symlink(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / f"kvasir-{os.getuid()}").symlink_to(target)
    with pytest.raises(InputError, match="runtime directory"):
        runtime_dir()


def test_runtime_dir_unmakeable(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TMPDIR", str(blocker))
    with pytest.raises(InputError, match="cannot create"):
        runtime_dir()


@linux_only
def test_cache_data_config_default_to_the_xdg_homes(home: Path) -> None:
    assert cache_dir() == default_cache_dir() == home / ".cache" / "kvasir"
    assert data_dir() == home / ".local" / "share" / "kvasir"
    assert config_dir() == home / ".config" / "kvasir"


@linux_only
def test_xdg_variables_move_them(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "f"))
    assert cache_dir() == tmp_path / "c" / "kvasir"
    assert data_dir() == tmp_path / "d" / "kvasir"
    assert config_dir() == tmp_path / "f" / "kvasir"


def test_kvasir_cache_overrides_everything(home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("KVASIR_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == default_cache_dir() == tmp_path / "mine"
