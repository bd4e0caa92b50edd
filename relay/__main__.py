"""``python -m relay ...``: the ``kvasir relay`` subcommand without the rest of the CLI."""

from __future__ import annotations

import argparse
import sys

from kvasir.errors import KvasirError
from relay import cli


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay")
    sub = parser.add_subparsers(dest="command")
    cli.add_parser(sub)
    args = parser.parse_args(["relay", *(sys.argv[1:] if argv is None else argv)])
    try:
        code: int = args.run(args)
    except KvasirError as exc:
        print(f"relay: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
