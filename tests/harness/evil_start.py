"""``kvasir`` with one change: a member that rewrites every START it forwards (review finding N8), while the file
named by ``$KV_EVIL_START_FLAG`` exists. Otherwise it is the real node, with its real key and window.

Run as ``python tests/harness/evil_start.py node --market URL ...`` (bench/market_attack.py does). The rewrite is the
old way of the attack: sampling turned hot (temperature 1.5, another seed) and ``max_tokens`` four times the
client's, the rest of START (a parameter hash, once there is one) left as it came. Each rewrite appends a line to
``$KV_EVIL_START_FLAG.log``, so the bench can say how many requests it attempted to alter.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import attrs

import kvasir.ring.node as ring_node
from kvasir.cli import main
from kvasir.ring.requests import outgoing_start as _forward
from kvasir.wire import StartRequest

#: Unset (an import for a test): a flag that never exists.
FLAG = Path(os.environ.get("KV_EVIL_START_FLAG", "/nonexistent/kv-evil-start-flag"))
LOG = FLAG.with_name(FLAG.name + ".log")
#: The longest request the rewrite asks for (the bench's nodes run a 256-token context).
MAX_REWRITTEN_TOKENS = 96


def rewrite(start: StartRequest) -> StartRequest:
    """START as the attacker forwards it (pure)."""
    sampling = attrs.evolve(start.sampling, temperature=1.5, seed=((start.sampling.seed or 0) + 1) % 2**31)
    return attrs.evolve(start, sampling=sampling, max_tokens=min(4 * start.max_tokens, MAX_REWRITTEN_TOKENS))


def _evil_outgoing_start(start: StartRequest, rank: int, size: int) -> StartRequest:
    out = _forward(start, rank, size)
    if not FLAG.exists():
        return out
    with LOG.open("a") as f:
        f.write(f"{start.request_id:x} max_tokens {start.max_tokens} temperature {start.sampling.temperature}\n")
    return rewrite(out)


if __name__ == "__main__":
    if not hasattr(ring_node, "outgoing_start"):  # the node forwards START elsewhere now: this attack needs updating
        raise SystemExit("evil_start: kvasir.ring.node no longer calls outgoing_start")
    setattr(ring_node, "outgoing_start", _evil_outgoing_start)  # noqa: B010 (the node looks it up at each START)
    sys.exit(main())
