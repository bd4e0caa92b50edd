"""``kvasir config show [--json] [FLAGS]`` and ``kvasir config path``: the effective configuration and its file.

``show`` prints every setting with its value and where it came from (default, file, env, flag); its flags are the
ones ``kvasir node`` takes for the same keys, to preview what a command line would use. Commands read their defaults
through :func:`fill_from_config`. The keys and variables: :mod:`kvasir.core.config`, docs/operations.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvasir.commands.common import print_json
from kvasir.core.config import (
    INT_KEYS,
    KEYS,
    PATH_KEYS,
    Config,
    config_path,
    default_identity_path,
    env_name,
    flag_name,
    load_config,
)


def fill_from_config(args: argparse.Namespace, keys: Iterable[str]) -> Config:
    """Set each of ``keys`` on ``args`` to its effective value: the flag when given (not None), else the environment,
    the file, the default. The flags' argparse defaults must be None for this to see them unset."""
    keys = tuple(keys)
    config = load_config({key: getattr(args, key) for key in keys})
    for key in keys:
        setattr(args, key, config[key])
    return config


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="show the effective configuration (file, environment, flags)")
    config_sub = p.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    show = config_sub.add_parser("show", help="every setting, its value and its source (default/file/env/flag)")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    flags = show.add_argument_group("flags to preview (as `kvasir node` takes them)")
    for key in KEYS:
        kind: Any = int if key in INT_KEYS else Path if key in PATH_KEYS else str
        flags.add_argument(flag_name(key), dest=key, type=kind, default=None, help=f"${env_name(key)}")
    show.set_defaults(run=run_show)
    path = config_sub.add_parser("path", help="print the configuration file's path (whether or not it exists)")
    path.set_defaults(run=run_path)


def _shown(key: str, value: object, *, note: bool = True) -> object:
    if value is None and key == "identity":  # the rule `kvasir id` and a keyed node follow
        return f"{default_identity_path()}" + (" (created on first use)" if note else "")
    return str(value) if isinstance(value, Path) else value


def run_show(args: argparse.Namespace) -> int:
    config = load_config({key: getattr(args, key) for key in KEYS})
    if args.json:
        print_json(
            {
                "path": str(config.path),
                "file_found": config.file_found,
                "settings": {
                    key: {"value": _shown(key, s.value, note=False), "source": s.source}
                    for key, s in config.settings.items()
                },
            }
        )
        return 0
    print(f"# {config.path}" + ("" if config.file_found else " (not found: defaults)"))
    width = max(map(len, KEYS))
    for key, s in config.settings.items():
        value = _shown(key, s.value)
        print(f"{key:<{width}}  {'-' if value is None else value}  [{s.source}]")
    return 0


def run_path(args: argparse.Namespace) -> int:
    print(config_path())  # not parsed: the way to find a file that does not load
    return 0
