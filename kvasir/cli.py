"""The ``kvasir`` command line.

Each subcommand lives in its own module and registers itself through ``add_parser(subparsers)`` returning nothing;
the parser's ``run`` default is a callable ``run(args) -> int``. A :class:`~kvasir.core.errors.KvasirError` or an
``OSError`` becomes one line on stderr and exit code 2, never a traceback, also out of a trio nursery; Ctrl-C exits
130 (:func:`kvasir.util.cli.run_main`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from collections.abc import Sequence

from kvasir import __version__
from kvasir.util.cli import run_main

# Modules that define subcommands; imported lazily so `kvasir --help` does not load llama.cpp.
_COMMAND_MODULES = (
    "kvasir.commands.id",
    "kvasir.commands.inspect",
    "kvasir.commands.slice",
    "kvasir.commands.generate",
    "kvasir.commands.node",
    "kvasir.commands.ring",
    "kvasir.commands.status",
    "kvasir.commands.plan",
    "kvasir.commands.tui",
    "kvasir.commands.market",
    "kvasir.commands.fetch",
    "kvasir.commands.config",
    "kvasir.commands.audit",
    "kvasir.relay.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvasir",
        description="Run one large language model across a ring of ordinary devices, with no central master.",
        epilog="Start with `kvasir ring up --prompt TEXT`; see README.md and docs/.",
    )
    parser.add_argument("--version", action="version", version=f"kvasir {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_main(f"kvasir {args.command}", functools.partial(args.run, args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
