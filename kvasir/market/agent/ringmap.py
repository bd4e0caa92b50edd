"""The rank manifest a self-enrolled node runs with, built from the market's coverage map (pure)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import attrs

from kvasir.core.errors import InputError
from kvasir.core.identity import PublicKey
from kvasir.market.records import CoverageEntry
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.util.addr import parse_hostport

#: Address of a window nobody serves yet (the node's dial loop waits on it).
UNKNOWN_HOST, UNKNOWN_PORT = "0.0.0.0", 0


def manifest_from_coverage(
    windows: Sequence[CoverageEntry],
    rank: int,
    host: str,
    port: int,
    *,
    name: str = "model",
    relay: str | None = None,
    secret: str | None = None,
    host_ok: Callable[[str], bool] = lambda _: True,
    own_key: PublicKey | None = None,
) -> Manifest:
    """The rank manifest a node runs with, built from its model's coverage map (pure).

    Its own rank gets ``host:port``; other ranks the endpoint of their serving holder, or an unknown address
    (0.0.0.0:0) the node waits on until a holder appears. An endpoint whose host ``host_ok`` refuses, or that does
    not parse, counts as unknown. Ranks carry their holder's key when the map shows it (``own_key`` for this
    node's own rank), which the links pin (protocol v2).
    """
    ranks = []
    for w in sorted(windows, key=lambda e: e.rank):
        link = "relay" if relay is not None else "direct"
        h, p = UNKNOWN_HOST, UNKNOWN_PORT
        key = None
        if w.serving and w.holder_key is not None:
            try:
                key = PublicKey.from_text(w.holder_key)
            except InputError:
                key = None
        if w.rank == rank:
            h, p, key = host, port, own_key
        elif w.serving and w.endpoint is not None and not w.endpoint.startswith("relay:"):
            try:
                eh, ep = parse_hostport(w.endpoint, what="endpoint")
            except InputError:
                eh, ep = UNKNOWN_HOST, UNKNOWN_PORT
            if host_ok(eh):
                h, p = eh, ep
        ranks.append(RankEntry(w.rank, w.start, w.end, h, p, None, link, key))
    first = windows[0]
    return Manifest(
        model_sha256=first.model,
        n_layers=max(w.end for w in windows),
        ranks=tuple(ranks),
        model_name=name,
        secret=secret,
        relay=relay,
    )


def with_port(ranks: tuple[RankEntry, ...], rank: int, port: int) -> tuple[RankEntry, ...]:
    return tuple(attrs.evolve(r, port=port) if r.rank == rank else r for r in ranks)


def keep_known(fresh: Manifest, current: Manifest, lapsed: Collection[int]) -> Manifest:
    """``fresh`` (from the coverage map), except that the ``lapsed`` ranks (no serving holder on the map) keep the
    address and key ``current`` has for them: a window shown uncovered only says that its lease lapsed (the holder
    may be serving still, cut off from the market), so the node keeps its link there until the map shows a serving
    holder again."""
    known = {r.rank: r for r in current.ranks}
    ranks = []
    for r in fresh.ranks:
        old = known.get(r.rank)
        if r.rank in lapsed and old is not None and (old.start, old.end) == (r.start, r.end):
            r = attrs.evolve(r, host=old.host, port=old.port, key=old.key)
        ranks.append(r)
    return attrs.evolve(fresh, ranks=tuple(ranks))
