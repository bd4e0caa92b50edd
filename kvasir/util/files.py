"""File output that never leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvasir.core.errors import OutputError


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """Yield a temp path beside ``out``; rename it over ``out`` only if the block succeeds."""
    parent = out.parent
    if not parent.is_dir():
        raise OutputError(f"{out}: directory {parent} does not exist")
    if out.is_dir():
        raise OutputError(f"{out}: is a directory")
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=parent)
    except OSError as exc:
        raise OutputError(f"{out}: cannot write ({exc.strerror})") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, out)
    except OSError as exc:
        raise OutputError(f"{out}: cannot write ({exc.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)
