"""``kvasir id [--identity FILE] [--json]``: this node's public key and fingerprint (created on first use)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvasir.commands.common import print_json
from kvasir.commands.config import fill_from_config
from kvasir.core.config import default_identity_path as default_identity_path  # node.py imports it from here
from kvasir.core.identity import Identity, named_identity


def add_identity_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--identity",
        type=Path,
        default=None,
        metavar="FILE",
        help="this node's Ed25519 key file (default: the per-user data dir, created with mode 0600 on first use; a "
        "named FILE must exist unless --create-identity is given)",
    )
    p.add_argument(
        "--create-identity",
        action="store_true",
        help="create the --identity FILE (mode 0600) when it does not exist yet",
    )


def identity_from_args(args: argparse.Namespace) -> Identity:
    """The key named by ``--identity`` (which must exist unless ``--create-identity``), else the default one."""
    return named_identity(args.identity, default_identity_path(), create=getattr(args, "create_identity", False))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("id", help="print this node's public key and id (creates the key on first use)")
    add_identity_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    fill_from_config(args, ["identity"])  # the key `kvasir node` uses: --identity, $KVASIR_IDENTITY, config.toml
    path = args.identity or default_identity_path()
    identity = identity_from_args(args)
    if args.json:
        print_json({"key": identity.public.to_text(), "node_id": identity.node_id, "file": str(path)})
    else:
        print(f"key      {identity.public.to_text()}")
        print(f"node id  {identity.node_id}")
        print(f"file     {path}")
    return 0
