"""``kvasir id [--identity FILE] [--json]``: this node's public key and fingerprint (created on first use)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import platformdirs

from kvasir.commands.common import print_json
from kvasir.core.identity import IDENTITY_FILE, load_or_create_identity


def default_identity_path() -> Path:
    """The identity file in the per-user data directory (Linux: ~/.local/share/kvasir/identity.pem)."""
    return Path(platformdirs.user_data_dir("kvasir", appauthor=False)) / IDENTITY_FILE


def add_identity_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--identity",
        type=Path,
        default=None,
        metavar="FILE",
        help="this node's Ed25519 key file (default: the per-user data dir; created with mode 0600 on first use)",
    )


def add_parser(sub: Any) -> None:
    p = sub.add_parser("id", help="print this node's public key and id (creates the key on first use)")
    add_identity_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    path = args.identity or default_identity_path()
    identity = load_or_create_identity(path)
    if args.json:
        print_json({"key": identity.public.to_text(), "node_id": identity.node_id, "file": str(path)})
    else:
        print(f"key      {identity.public.to_text()}")
        print(f"node id  {identity.node_id}")
        print(f"file     {path}")
    return 0
