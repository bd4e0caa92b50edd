"""``python -m kvasir.relay ...``: the ``kvasir relay`` subcommand without the rest of the CLI."""

from __future__ import annotations

import argparse
import functools
import sys

from kvasir.relay import cli
from kvasir.util.cli import run_main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvasir.relay")
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["relay", *(sys.argv[1:] if argv is None else argv)])
    return run_main("relay", functools.partial(args.run, args))


if __name__ == "__main__":
    sys.exit(main())
