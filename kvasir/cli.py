"""The ``kvasir`` command line.

Each subcommand lives in its own module and registers itself through ``add_parser(subparsers)`` returning nothing;
the parser's ``run`` default is a callable ``run(args) -> int``. Any :class:`~kvasir.errors.KvasirError` becomes one
line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvasir.errors import KvasirError

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
    "relay.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvasir",
        description="Run one large language model across a ring of ordinary devices, with no central master.",
        epilog="Start with `kvasir ring up --prompt TEXT`; see README.md and docs/.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.run(args)
    except KvasirError as exc:
        print(f"kvasir {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"kvasir {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
