"""The static rank manifest (TOML) that describes a ring: the model's identity, the ordered windows, each rank's
address. ``docs/protocol.md`` § Rank manifest gives the format.

```toml
[model]
sha256 = "a5fd…"          # identity of the whole GGUF; every node checks its neighbours against it
layers = 18
name = "gemma-3-270m"     # optional, shown by the API and the TUI
secret = "hex…"           # optional, keyless rings only: keys v1 relay edge tokens
operator = "ed25519:…"    # optional, keyed rings: the key that signs this ring's relay edge grants

[[rank]]
layers = [0, 6]
listen = "127.0.0.1:7100" # where this rank accepts its predecessor (its successor dials the next rank's)
stage = "stage-0.gguf"    # optional: this rank's stage file (else cut from --model)
key = "ed25519:…"         # this rank's node key (`kvasir id`): links then authenticate and encrypt (protocol v2)
grants = ["…", "…"]       # optional: the operator's signed relay edge grants for this rank's two edges

[[rank.standby]]          # optional, any number: a node that holds the same window, loaded and idle until needed
listen = "127.0.0.1:7110" # where it accepts the predecessor that fails over to it
key = "ed25519:…"         # its own node key (keyed rings: required; keyless rings: none)
grants = ["…", "…"]       # optional: its own relay edge grants (its edge in, and the edges to its successor's holders)
```

A ring whose ranks all name a key runs protocol v2 links only (docs/protocol.md § Link security); a manifest
without keys runs unauthenticated v1 links in clear, for a private network only (docs/security.md).
"""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import tomli_w

from kvasir.core.errors import InputError, WindowError
from kvasir.core.identity import PublicKey
from kvasir.core.schema import FieldError, register_record, structure, unstructure
from kvasir.core.validators import int_in
from kvasir.util.addr import format_hostport, parse_hostport
from kvasir.util.files import atomic_output

LINK_KINDS = ("direct", "relay")


@attrs.frozen
class StandbyEntry:
    """A node that holds a rank's window too, loaded and linked to nothing until the rank's predecessor, finding the
    primary gone, dials it (docs/architecture.md § Failover)."""

    host: str
    port: int
    #: Its own node key (keyed rings); None in a keyless ring.
    key: PublicKey | None = None
    #: Its own relay edge grants (held by ``key``): downstream on its own edge in, upstream to the successor's holders.
    grants: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return format_hostport(self.host, self.port)


@attrs.frozen
class RankEntry:
    rank: int
    start: int
    end: int
    host: str
    port: int
    stage: str | None = None
    #: "direct" (TCP) or "relay": how this rank's predecessor reaches it.
    link: str = "direct"
    #: The node key that holds this rank; None in a keyless (v1, unauthenticated) ring.
    key: PublicKey | None = None
    #: Signed relay edge grants (relay/grant.py text form) held by ``key``: public, useless to anyone else.
    grants: tuple[str, ...] = ()
    #: Standby holders of this window, in the order the predecessor tries them when the primary does not answer.
    standby: tuple[StandbyEntry, ...] = ()

    @property
    def address(self) -> str:
        return format_hostport(self.host, self.port)

    def holders(self) -> tuple[RankEntry, ...]:
        """Every node that may hold this window, as the entry a predecessor dials: this one, then each standby."""
        return (
            self,
            *(
                attrs.evolve(self, host=s.host, port=s.port, key=s.key, grants=s.grants, standby=())
                for s in self.standby
            ),
        )

    def keys(self) -> frozenset[PublicKey]:
        """The keys of every holder of this window (empty in a keyless ring)."""
        return frozenset(k for k in (self.key, *(s.key for s in self.standby)) if k is not None)


@attrs.frozen
class Manifest:
    model_sha256: str
    n_layers: int
    ranks: tuple[RankEntry, ...]
    model_name: str = "model"
    secret: str | None = None
    relay: str | None = None
    #: The key that signs this ring's relay edge grants (keyed rings); relays that trust it admit the ring.
    operator: PublicKey | None = None
    #: A standby's view (:meth:`as_standby`): the manifest as written, whose ring id and relay edges stay the ring's.
    base: Manifest | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def successor(self, rank: int) -> RankEntry:
        return self.ranks[(rank + 1) % self.size]

    @property
    def secured(self) -> bool:
        """Every rank names its key: links authenticate by those keys and are encrypted."""
        return all(r.key is not None for r in self.ranks)

    def with_keys(self, keys: Sequence[PublicKey]) -> Manifest:
        """This manifest with rank k held by ``keys[k]``."""
        if len(keys) != self.size:
            raise InputError(f"{len(keys)} keys for {self.size} ranks")
        return attrs.evolve(self, ranks=tuple(attrs.evolve(r, key=k) for r, k in zip(self.ranks, keys, strict=True)))

    @property
    def ring_id(self) -> str:
        """64 hex digits naming a keyed ring: sha256 over the model and the ranks' keys in order.

        Edge grants are bound to it, so a grant of one ring is worthless on another; it does not depend on the
        grants themselves, so it can be computed before they are added. Standbys' keys are not in it (a standby's
        view of the ring has the same id: its grants name the ring as written).
        """
        if self.base is not None:
            return self.base.ring_id
        if not self.secured:
            raise InputError("only a ring whose ranks all name a key has a ring id")
        text = "\n".join(["kvasir-ring/v2", self.model_sha256, *(str(r.key) for r in self.ranks)])
        return hashlib.sha256(text.encode("ascii")).hexdigest()

    def with_grants(self, operator: PublicKey, grants: Sequence[Sequence[str]]) -> Manifest:
        """This manifest with ``operator`` and rank k holding ``grants[k]``."""
        if len(grants) != self.size:
            raise InputError(f"grants for {len(grants)} ranks, the ring has {self.size}")
        ranks = tuple(attrs.evolve(r, grants=tuple(g)) for r, g in zip(self.ranks, grants, strict=True))
        return attrs.evolve(self, operator=operator, ranks=ranks)

    def rank(self, k: int) -> RankEntry:
        if not 0 <= k < self.size:
            raise InputError(f"rank {k} is not in the manifest (ranks 0..{self.size - 1})")
        return self.ranks[k]

    def as_standby(self, rank: int, index: int) -> Manifest:
        """The ring as standby ``index`` of ``rank`` runs it: that rank's entry names the standby's address and key,
        and its standby list the primary and the other standbys (the holders this node must defer to)."""
        entry = self.rank(rank)
        if not 0 <= index < len(entry.standby):
            raise InputError(f"rank {rank} has {len(entry.standby)} standby node(s) in the manifest, not {index + 1}")
        me = entry.standby[index]
        primary = StandbyEntry(entry.host, entry.port, entry.key, entry.grants)
        others = (primary, *entry.standby[:index], *entry.standby[index + 1 :])
        swapped = attrs.evolve(entry, host=me.host, port=me.port, key=me.key, grants=me.grants, standby=others)
        ranks = tuple(swapped if r.rank == rank else r for r in self.ranks)
        return attrs.evolve(self, ranks=ranks, base=self.base or self)

    def to_toml(self) -> str:
        operator = None if self.operator is None else self.operator.to_text()
        model = _ModelTable(self.model_sha256, self.n_layers, self.model_name, self.secret, self.relay, operator)
        ranks = tuple(
            _RankTable(
                r.start,
                r.end,
                r.address,
                r.stage,
                r.link,
                _key_text(r.key),
                r.grants or None,
                tuple(_StandbyTable(s.address, _key_text(s.key), s.grants or None) for s in r.standby) or None,
            )
            for r in self.ranks
        )
        return tomli_w.dumps(unstructure(_ManifestFile(model, ranks)))

    def write(self, path: Path) -> None:
        with atomic_output(path) as tmp:
            tmp.write_text(self.to_toml())


def _key_text(key: PublicKey | None) -> str | None:
    return None if key is None else key.to_text()


# The TOML file's own shape; parse_manifest turns it into a Manifest.


def _sha256(_: object, __: attrs.Attribute[str], value: str) -> None:
    if not value or len(value) > 128:
        raise FieldError("sha256", "must be a non-empty string of at most 128 characters")


def _link(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value not in LINK_KINDS:
        raise FieldError("link", f"must be {' or '.join(map(repr, LINK_KINDS))}, not {value!r}")


@attrs.frozen
class _ModelTable:
    sha256: str = attrs.field(validator=_sha256)
    layers: int = attrs.field(validator=int_in(1, reason="must be a positive integer"))
    name: str = "model"
    secret: str | None = None
    relay: str | None = None
    operator: str | None = None


@attrs.frozen
class _StandbyTable:
    listen: str
    key: str | None = None
    grants: tuple[str, ...] | None = None


@attrs.frozen
class _RankTable:
    start: int
    end: int
    listen: str
    stage: str | None = None
    link: str = attrs.field(default="direct", validator=_link)
    key: str | None = None
    grants: tuple[str, ...] | None = None
    standby: tuple[_StandbyTable, ...] | None = None


@attrs.frozen
class _ManifestFile:
    model: _ModelTable
    rank: tuple[_RankTable, ...] = attrs.field(validator=attrs.validators.min_len(1))


register_record(_ModelTable, omit_if_none=("secret", "relay", "operator"))
register_record(_StandbyTable, omit_if_none=("key", "grants"))
register_record(_RankTable, window=True, omit_if_none=("stage", "key", "grants", "standby"))
register_record(_ManifestFile)


def check_windows(windows: Sequence[tuple[int, int]], n_layers: int) -> None:
    """Windows must be non-empty, contiguous, in order, and cover [0, n_layers) exactly (pure)."""
    if not windows:
        raise WindowError("a ring needs at least one rank")
    expect = 0
    for i, (a, b) in enumerate(windows):
        if a != expect or b <= a:
            raise WindowError(f"rank {i}: window [{a}, {b}) does not continue from layer {expect}")
        expect = b
    if expect != n_layers:
        raise WindowError(f"windows end at layer {expect}, the model has {n_layers}")


def parse_manifest(data: dict[str, Any], where: str = "manifest") -> Manifest:
    if not isinstance(data.get("rank"), list) or not data["rank"]:
        raise InputError(f"{where}: needs at least one [[rank]]")
    shape = structure(data, _ManifestFile, where=where)
    ranks = []
    for i, r in enumerate(shape.rank):
        host, port = parse_hostport(r.listen, what=f"{where}: rank[{i}].listen")
        key = _parse_key(r.key, f"{where}: rank[{i}].key")
        standby = tuple(
            StandbyEntry(
                *parse_hostport(s.listen, what=f"{where}: rank[{i}].standby[{j}].listen"),
                _parse_key(s.key, f"{where}: rank[{i}].standby[{j}].key"),
                s.grants or (),
            )
            for j, s in enumerate(r.standby or ())
        )
        if len({r.listen, *(s.address for s in standby)}) < 1 + len(standby):
            raise InputError(f"{where}: rank[{i}]: two holders of the window listen on the same address")
        ranks.append(RankEntry(i, r.start, r.end, host, port, r.stage, r.link, key, r.grants or (), standby))
    keyed = sum(r.key is not None for r in ranks)
    if 0 < keyed < len(ranks):
        raise InputError(f"{where}: {keyed} of {len(ranks)} ranks name a key; name one for every rank, or none")
    standby_keys = [s.key for r in ranks for s in r.standby]
    if any((k is None) == bool(keyed) for k in standby_keys):
        need = "every standby names its key" if keyed else "no standby names a key"
        raise InputError(f"{where}: {need} in a {'keyed' if keyed else 'keyless'} ring")
    if keyed and len({r.key for r in ranks} | set(standby_keys)) < len(ranks) + len(standby_keys):
        raise InputError(f"{where}: two nodes (ranks or standbys) name the same key")
    check_windows([(r.start, r.end) for r in ranks], shape.model.layers)
    m = shape.model
    try:
        operator = None if m.operator is None else PublicKey.from_text(m.operator)
    except InputError as exc:
        raise InputError(f"{where}: model.operator: {exc}") from None
    if (operator is not None or any(r.grants for r in ranks)) and not keyed:
        raise InputError(f"{where}: an operator and edge grants need every rank to name its key")
    if any(h.grants for r in ranks for h in r.holders()) and operator is None:
        raise InputError(f"{where}: edge grants need the operator that signed them (model.operator)")
    return Manifest(m.sha256, m.layers, tuple(ranks), m.name, m.secret, m.relay, operator)


def _parse_key(text: str | None, where: str) -> PublicKey | None:
    try:
        return None if text is None else PublicKey.from_text(text)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def load_manifest(path: Path) -> Manifest:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such manifest") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: invalid TOML ({exc})") from None
    return parse_manifest(data, str(path))
