"""Per-user directories: runtime (control sockets), cache, data and config.

Cache, data and config come from platformdirs (``~/.cache/kvasir``, ``~/.local/share/kvasir``, ``~/.config/kvasir``
on Linux and Termux, honouring the ``XDG_*_HOME`` variables; ``~/Library/...`` on macOS). Everything is read when
called, never at import, so a caller (or a test) can set the environment first.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import platformdirs

from kvasir.core.errors import InputError

APP = "kvasir"


def _dirs() -> platformdirs.PlatformDirs:
    return platformdirs.PlatformDirs(APP, appauthor=False)


def cache_dir() -> Path:
    """``$KVASIR_CACHE``, else the platform's user cache directory (``~/.cache/kvasir`` on Linux)."""
    env = os.environ.get("KVASIR_CACHE")
    return Path(env) if env else _dirs().user_cache_path


def data_dir() -> Path:
    return _dirs().user_data_path


def config_dir() -> Path:
    return _dirs().user_config_path


def runtime_dir() -> Path:
    """Where control sockets live: created 0700 and checked to be ours (a socket there accepts prompts).

    ``$XDG_RUNTIME_DIR/kvasir`` when the login has one; otherwise ``kvasir-$UID`` in the temporary directory, which
    follows ``$TMPDIR`` (Termux has no ``/tmp`` and sets ``TMPDIR=$PREFIX/tmp``; macOS gives each user its own).
    platformdirs' own fallback differs across 4.x releases (older ones return ``/run/user/<uid>`` unchecked), and a
    socket path must stay short (108 bytes), so the rule is spelled out here.
    """
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        d = Path(xdg) / APP
    else:
        d = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / f"{APP}-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.lstat()
    except OSError as exc:
        raise InputError(f"{d}: cannot create the runtime directory ({exc.strerror})") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise InputError(f"{d}: runtime directory must be a directory owned by you with mode 0700")
    return d
