"""Command-line plumbing shared by ``kvasir`` and ``python -m kvasir.relay``: errors as one line, trio entry points.

A command that fails on purpose (a :class:`~kvasir.core.errors.KvasirError`) or meets the operating system (an
``OSError``: address in use, permission denied, no such file) prints one line on stderr and exits 2, also when the
error comes out of a trio nursery wrapped in an exception group. Ctrl-C exits 130 without a word. Anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import trio

from kvasir.core.errors import KvasirError

T = TypeVar("T")

#: Exit status of a command that failed with a reported error.
EXIT_ERROR = 2
#: Exit status after Ctrl-C (128 + SIGINT), as shells report it.
EXIT_INTERRUPTED = 130


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def reportable(exc: BaseException) -> BaseException | None:
    """The error to report for ``exc``: itself or, inside an exception group, the lone leaf or else the first
    KvasirError/OSError leaf (a KeyboardInterrupt anywhere wins). None: a bug, to be raised as it is."""
    leaves = list(_leaves(exc))
    if len(leaves) == 1:
        return leaves[0]
    for kinds in (KeyboardInterrupt, (KvasirError, OSError)):
        for leaf in leaves:
            if isinstance(leaf, kinds):
                return leaf
    return None


def run_trio(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``trio.run(fn, *args)``, raising a failure bare rather than in an exception group (see :func:`reportable`)."""
    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as group:
        leaf = reportable(group)
        if leaf is None:
            raise
        raise leaf from None


async def serve_announced(service: Callable[..., Awaitable[object]], announce: Callable[[Any], None]) -> None:
    """Run a ``task_status`` service until cancelled; ``announce`` what it reports once it is up (its port)."""
    async with trio.open_nursery() as nursery:
        announce(await nursery.start(service))


def error_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}: {exc.filename}" if exc.filename is not None else exc.strerror
    return str(exc) or type(exc).__name__


def run_main(prog: str, command: Callable[[], int]) -> int:
    """Run ``command`` (an argparse subcommand, returning its exit status) with the one-line error contract."""
    try:
        return command()
    except (KvasirError, OSError, KeyboardInterrupt, BaseExceptionGroup) as exc:
        leaf = reportable(exc)
        if isinstance(leaf, KeyboardInterrupt):
            return EXIT_INTERRUPTED
        if not isinstance(leaf, KvasirError | OSError):
            raise
        print(f"{prog}: error: {error_line(leaf)}", file=sys.stderr)
        return EXIT_ERROR
