"""A byte progress bar on stderr for the slow file work (cutting a stage, downloading a window), shown only when
stderr is a terminal: tests, logs and services get no bar and no escape codes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: ``progress(done, total)`` in bytes.
ProgressFn = Callable[[int, int], None]


@contextmanager
def byte_bar(description: str) -> Iterator[ProgressFn | None]:
    """A transient rich bar while the block runs, its update function yielded; None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress("{task.description}", *columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
