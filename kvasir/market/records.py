"""The market's API bodies: frozen records with strict ``from_wire`` (JSON → record) and ``to_wire`` (record → JSON).

``from_wire`` raises :class:`~kvasir.errors.InputError` naming the bad field; the service answers it with 400 and
stores nothing. docs/protocol.md § Market API is the reference for every field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from kvasir.errors import InputError

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_NODE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
MAX_LEASE_S = 3600.0
MIN_LEASE_S = 0.5
MAX_WINDOWS = 4096
MAX_SOURCES = 16
MAX_TEXT = 512
LeaseState = Literal["fetching", "serving"]
LEASE_STATES: tuple[LeaseState, ...] = ("fetching", "serving")


# ---------------------------------------------------------------------------------------------- field checks


def _obj(data: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise InputError(f"{where}: expected a JSON object")
    return data


def _int(d: Mapping[str, Any], key: str, where: str, *, low: int = 0, default: int | None = None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InputError(f"{where}: '{key}' must be an integer >= {low}")
    return v


def _num(d: Mapping[str, Any], key: str, where: str, *, low: float, high: float, default: float | None = None) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not low <= v <= high:
        raise InputError(f"{where}: '{key}' must be a number in [{low}, {high}]")
    return float(v)


def _str(d: Mapping[str, Any], key: str, where: str, *, default: str | None = None, optional: bool = False) -> Any:
    v = d.get(key, default)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > MAX_TEXT:
        raise InputError(f"{where}: '{key}' must be a non-empty string of at most {MAX_TEXT} characters")
    return v


def sha256_field(d: Mapping[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not _SHA256.match(v):
        raise InputError(f"{where}: '{key}' must be a sha256 in lowercase hex")
    return v


def node_id_field(d: Mapping[str, Any], where: str) -> str:
    v = d.get("node_id")
    if not isinstance(v, str) or not _NODE_ID.match(v):
        raise InputError(f"{where}: 'node_id' must be 1-64 characters of [A-Za-z0-9._-]")
    return v


def layers_field(d: Mapping[str, Any], where: str) -> tuple[int, int]:
    v = d.get("layers")
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)):
        raise InputError(f"{where}: 'layers' must be [start, end]")
    a, b = v
    if not 0 <= a < b:
        raise InputError(f"{where}: 'layers' [{a}, {b}] is not a non-empty window")
    return a, b


def endpoint_field(d: Mapping[str, Any], where: str) -> str | None:
    """``host:port`` of a direct link, or ``relay:<ws-url>`` for a node reached through a relay edge."""
    v = d.get("endpoint")
    if v is None:
        return None
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise InputError(f"{where}: 'endpoint' must be 'host:port' or 'relay:ws(s)://…'")
    if v.startswith("relay:"):
        if not v[6:].startswith(("ws://", "wss://")):
            raise InputError(f"{where}: a relay endpoint is 'relay:ws://…' or 'relay:wss://…'")
        return v
    host, _, port = v.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InputError(f"{where}: 'endpoint' must be 'host:port' or 'relay:ws(s)://…'")
    return v


# ---------------------------------------------------------------------------------------------- models


@attrs.frozen
class StageHash:
    """The stage file ``kvasir slice`` writes for one window: its sha256 and size."""

    start: int
    end: int
    sha256: str
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {"layers": [self.start, self.end], "sha256": self.sha256, "bytes": self.bytes}

    @classmethod
    def from_wire(cls, data: Any, where: str = "stage") -> StageHash:
        d = _obj(data, where)
        a, b = layers_field(d, where)
        return cls(a, b, sha256_field(d, "sha256", where), _int(d, "bytes", where, low=1))


@attrs.frozen
class ModelRecord:
    """A model on offer: its identity, where to download it, its byte profile and its windows' stage hashes."""

    sha256: str
    name: str
    n_layers: int
    file_bytes: int
    #: Bytes of the GGUF header (metadata and tensor infos, up to the aligned data offset).
    header_bytes: int
    #: URLs serving the whole GGUF with HTTP Range support.
    sources: tuple[str, ...]
    layer_bytes: tuple[int, ...]
    outside_bytes: int
    stages: tuple[StageHash, ...]

    def stage(self, start: int, end: int) -> StageHash | None:
        return next((s for s in self.stages if (s.start, s.end) == (start, end)), None)

    def to_wire(self) -> dict[str, Any]:
        return {
            "sha256": self.sha256,
            "name": self.name,
            "layers": self.n_layers,
            "file_bytes": self.file_bytes,
            "header_bytes": self.header_bytes,
            "sources": list(self.sources),
            "layer_bytes": list(self.layer_bytes),
            "outside_bytes": self.outside_bytes,
            "stages": [s.to_wire() for s in self.stages],
        }

    @classmethod
    def from_wire(cls, data: Any, where: str = "model") -> ModelRecord:
        d = _obj(data, where)
        n_layers = _int(d, "layers", where, low=1)
        file_bytes = _int(d, "file_bytes", where, low=1)
        header_bytes = _int(d, "header_bytes", where, low=24)
        if header_bytes > file_bytes:
            raise InputError(f"{where}: 'header_bytes' exceeds 'file_bytes'")
        sources = d.get("sources")
        if not isinstance(sources, list) or not 1 <= len(sources) <= MAX_SOURCES:
            raise InputError(f"{where}: 'sources' must be a list of 1-{MAX_SOURCES} URLs")
        for url in sources:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_TEXT:
                raise InputError(f"{where}: every source must be an http:// or https:// URL")
        lb = d.get("layer_bytes")
        if not isinstance(lb, list) or len(lb) != n_layers or not all(_is_count(x) for x in lb):
            raise InputError(f"{where}: 'layer_bytes' must list {n_layers} byte counts")
        raw_stages = d.get("stages", [])
        if not isinstance(raw_stages, list) or len(raw_stages) > MAX_WINDOWS:
            raise InputError(f"{where}: 'stages' must be a list")
        stages = tuple(StageHash.from_wire(s, f"{where}: stages[{i}]") for i, s in enumerate(raw_stages))
        if any(s.end > n_layers for s in stages):
            raise InputError(f"{where}: a stage window ends past layer {n_layers}")
        if len({(s.start, s.end) for s in stages}) != len(stages):
            raise InputError(f"{where}: a stage window is listed twice")
        return cls(
            sha256=sha256_field(d, "sha256", where),
            name=_str(d, "name", where, default="model"),
            n_layers=n_layers,
            file_bytes=file_bytes,
            header_bytes=header_bytes,
            sources=tuple(sources),
            layer_bytes=tuple(lb),
            outside_bytes=_int(d, "outside_bytes", where, default=0),
            stages=stages,
        )


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


# ---------------------------------------------------------------------------------------------- rank manifest


@attrs.frozen
class WindowSpec:
    start: int
    end: int
    #: Reward weight: credits per token this window earns at base demand.
    weight: float

    def to_wire(self) -> dict[str, Any]:
        return {"layers": [self.start, self.end], "weight": self.weight}

    @classmethod
    def from_wire(cls, data: Any, where: str) -> WindowSpec:
        d = _obj(data, where)
        a, b = layers_field(d, where)
        return cls(a, b, _num(d, "weight", where, low=0.0, high=1e12, default=1.0))


@attrs.frozen
class ManifestRecord:
    """The rank manifest of a model: its windows in ring order, each with a reward weight."""

    model: str
    windows: tuple[WindowSpec, ...]
    #: "planner" (windows from kvasir.planner) or "explicit".
    origin: str = "explicit"

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "origin": self.origin, "windows": [w.to_wire() for w in self.windows]}

    @classmethod
    def from_wire(cls, data: Any, model: str, where: str = "manifest") -> ManifestRecord:
        d = _obj(data, where)
        raw = d.get("windows")
        if not isinstance(raw, list) or not 2 <= len(raw) <= MAX_WINDOWS:
            raise InputError(f"{where}: 'windows' must list 2-{MAX_WINDOWS} windows")
        windows = tuple(WindowSpec.from_wire(w, f"{where}: windows[{i}]") for i, w in enumerate(raw))
        origin = d.get("origin", "explicit")
        if origin not in ("planner", "explicit"):
            raise InputError(f"{where}: 'origin' must be 'planner' or 'explicit'")
        return cls(model, windows, origin)


# ---------------------------------------------------------------------------------------------- claims


@attrs.frozen
class ClaimRequest:
    """Body of claim and renew: which window, who, for how long, and (once serving) where to reach it."""

    model: str
    start: int
    end: int
    node_id: str
    lease_s: float
    endpoint: str | None = None
    state: LeaseState = "fetching"
    #: Renew only: the lease being renewed.
    lease_id: str | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "layers": [self.start, self.end],
            "node_id": self.node_id,
            "lease_s": self.lease_s,
            "endpoint": self.endpoint,
            "state": self.state,
        }
        if self.lease_id is not None:
            out["lease_id"] = self.lease_id
        return out

    @classmethod
    def from_wire(cls, data: Any, *, renew: bool = False, where: str = "claim") -> ClaimRequest:
        d = _obj(data, where)
        a, b = layers_field(d, where)
        state = d.get("state", "fetching")
        if state not in LEASE_STATES:
            raise InputError(f"{where}: 'state' must be one of {', '.join(LEASE_STATES)}")
        endpoint = endpoint_field(d, where)
        if state == "serving" and endpoint is None:
            raise InputError(f"{where}: a serving holder must give its 'endpoint'")
        return cls(
            model=sha256_field(d, "model", where),
            start=a,
            end=b,
            node_id=node_id_field(d, where),
            lease_s=_num(d, "lease_s", where, low=MIN_LEASE_S, high=MAX_LEASE_S, default=30.0),
            endpoint=endpoint,
            state=state,
            lease_id=_str(d, "lease_id", where) if renew else None,
        )


@attrs.frozen
class LeaseRef:
    """Body of release: the lease to give up."""

    model: str
    start: int
    end: int
    node_id: str
    lease_id: str

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layers": [self.start, self.end],
            "node_id": self.node_id,
            "lease_id": self.lease_id,
        }

    @classmethod
    def from_wire(cls, data: Any, where: str = "release") -> LeaseRef:
        d = _obj(data, where)
        a, b = layers_field(d, where)
        return cls(sha256_field(d, "model", where), a, b, node_id_field(d, where), _str(d, "lease_id", where))


@attrs.frozen
class Lease:
    """A granted lease: the holder owns the window until ``expires_at`` (unix seconds) unless it renews."""

    model: str
    start: int
    end: int
    node_id: str
    lease_id: str
    expires_at: float

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layers": [self.start, self.end],
            "node_id": self.node_id,
            "lease_id": self.lease_id,
            "expires_at": self.expires_at,
        }

    @classmethod
    def from_wire(cls, data: Any, where: str = "lease") -> Lease:
        d = _obj(data, where)
        a, b = layers_field(d, where)
        return cls(
            sha256_field(d, "model", where),
            a,
            b,
            node_id_field(d, where),
            _str(d, "lease_id", where),
            _num(d, "expires_at", where, low=0, high=1e12),
        )


# ---------------------------------------------------------------------------------------------- demand, credits


@attrs.frozen
class DemandReport:
    """Requests that entered the ring at the reporting node, and the tokens they generated."""

    model: str
    requests: int
    tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "requests": self.requests, "tokens": self.tokens}

    @classmethod
    def from_wire(cls, data: Any, where: str = "demand") -> DemandReport:
        d = _obj(data, where)
        return cls(
            sha256_field(d, "model", where),
            _int(d, "requests", where, default=0),
            _int(d, "tokens", where, default=0),
        )


@attrs.frozen
class CreditReport:
    """Tokens a lease holder served on its window since its last report."""

    model: str
    start: int
    end: int
    node_id: str
    lease_id: str
    tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "layers": [self.start, self.end],
            "node_id": self.node_id,
            "lease_id": self.lease_id,
            "tokens": self.tokens,
        }

    @classmethod
    def from_wire(cls, data: Any, where: str = "credit") -> CreditReport:
        d = _obj(data, where)
        a, b = layers_field(d, where)
        return cls(
            sha256_field(d, "model", where),
            a,
            b,
            node_id_field(d, where),
            _str(d, "lease_id", where),
            _int(d, "tokens", where, default=0),
        )


# ---------------------------------------------------------------------------------------------- coverage (read side)


@attrs.frozen
class CoverageEntry:
    """One window of a model's rank manifest as the coverage map shows it."""

    model: str
    rank: int
    start: int
    end: int
    weight: float
    #: Credits per token served on this window now (weight × the model's demand multiplier).
    reward: float
    #: Bytes of the window's stage file (what a holder downloads and loads).
    bytes: int
    sha256: str
    holder: str | None = None
    lease_expires: float | None = None
    state: LeaseState | None = None
    endpoint: str | None = None

    @property
    def covered(self) -> bool:
        return self.holder is not None

    @property
    def serving(self) -> bool:
        return self.holder is not None and self.state == "serving" and self.endpoint is not None

    def to_wire(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "rank": self.rank,
            "layers": [self.start, self.end],
            "weight": self.weight,
            "reward": self.reward,
            "bytes": self.bytes,
            "sha256": self.sha256,
            "holder": self.holder,
            "lease_expires": self.lease_expires,
            "state": self.state,
            "endpoint": self.endpoint,
        }

    @classmethod
    def from_wire(cls, data: Any, where: str = "window") -> CoverageEntry:
        d = _obj(data, where)
        a, b = layers_field(d, where)
        holder = d.get("holder")
        if holder is not None and not isinstance(holder, str):
            raise InputError(f"{where}: 'holder' must be a node id or null")
        state = d.get("state")
        if state is not None and state not in LEASE_STATES:
            raise InputError(f"{where}: bad 'state'")
        expires = d.get("lease_expires")
        return cls(
            model=sha256_field(d, "model", where),
            rank=_int(d, "rank", where),
            start=a,
            end=b,
            weight=_num(d, "weight", where, low=0, high=1e12),
            reward=_num(d, "reward", where, low=0, high=1e18),
            bytes=_int(d, "bytes", where, low=1),
            sha256=sha256_field(d, "sha256", where),
            holder=holder,
            lease_expires=None if expires is None else _num(d, "lease_expires", where, low=0, high=1e12),
            state=state,
            endpoint=endpoint_field(d, where),
        )


def coverage_from_wire(data: Any) -> list[CoverageEntry]:
    """The windows of every model in a ``GET /v1/coverage`` reply."""
    d = _obj(data, "coverage")
    models = d.get("models")
    if not isinstance(models, list):
        raise InputError("coverage: 'models' must be a list")
    out: list[CoverageEntry] = []
    for m in models:
        windows = _obj(m, "coverage model").get("windows")
        if not isinstance(windows, list):
            raise InputError("coverage: a model's 'windows' must be a list")
        out += [CoverageEntry.from_wire(w) for w in windows]
    return out


def windows_of(entries: Sequence[CoverageEntry], model: str) -> list[CoverageEntry]:
    return sorted((e for e in entries if e.model == model), key=lambda e: e.rank)
