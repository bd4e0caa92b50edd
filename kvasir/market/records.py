"""The market's API bodies: frozen records whose field validators hold the rules; the schema converter
(:mod:`kvasir.core.schema`) reads and writes their JSON.

``from_wire`` raises :class:`~kvasir.core.errors.InputError` naming the bad field; the service answers it with 400 and
stores nothing. Unknown keys are ignored (a newer peer may send more). docs/protocol.md § Market API is the reference
for every field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Self

import attrs

from kvasir.core.clientauth import MAX_AUTH_CHARS
from kvasir.core.errors import InputError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.schema import FieldError, Json, register_record, structure, unstructure
from kvasir.core.signed import canonical_json
from kvasir.core.validators import int_in, is_int, number_in, optional, rule
from kvasir.market import auth
from kvasir.util.addr import parse_hostport

_SHA256 = re.compile(r"[0-9a-f]{64}")
_NODE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
MAX_LEASE_S = 3600.0
MIN_LEASE_S = 0.5
MAX_WINDOWS = 4096
MAX_SOURCES = 16
MAX_TEXT = 512
#: Largest file a model record may describe (bytes); keeps every sum of sizes far from 2^63.
MAX_FILE_BYTES = 2**50
#: Tokens one receipt counts at most.
MAX_REPORT_TOKENS = 1_000_000
#: A credit report's cumulative tokens for one lease (the market bounds credit by time served anyway).
MAX_LEASE_TOKENS = 10**12
#: Receipts per batch at most.
MAX_RECEIPTS = 256
#: Credits per token a window can pay at most, whatever its weight and demand.
MAX_REWARD = 1e15
LeaseState = Literal["fetching", "serving"]
LEASE_STATES: tuple[LeaseState, ...] = ("fetching", "serving")


# ---------------------------------------------------------------------------------------------- field rules


def is_sha256(v: Any) -> bool:
    return isinstance(v, str) and _SHA256.fullmatch(v) is not None


_sha256 = rule(is_sha256, "must be a sha256 in lowercase hex")
_node_id = rule(lambda v: isinstance(v, str) and _NODE_ID.fullmatch(v) is not None,
                 "must be 1-64 characters of [A-Za-z0-9._-]")  # fmt: skip
_text = rule(lambda v: isinstance(v, str) and 0 < len(v) <= MAX_TEXT,
              f"must be a non-empty string of at most {MAX_TEXT} characters")  # fmt: skip
_state = rule(lambda v: v in LEASE_STATES, f"must be one of {', '.join(LEASE_STATES)}")


_bool = rule(lambda v: isinstance(v, bool), "must be true or false")
_ticket = rule(lambda v: isinstance(v, str) and len(v) <= 4096, "must be a string of at most 4096 characters")
_client_auth = rule(
    lambda v: isinstance(v, str) and 0 < len(v) <= MAX_AUTH_CHARS and v.isascii(),
    f"must be a client authorisation of at most {MAX_AUTH_CHARS} ASCII characters",
)


def _window_end(instance: Any, _: attrs.Attribute[int], end: Any) -> None:
    start = instance.start
    if not (is_int(start) and is_int(end) and 0 <= start < end):
        raise FieldError("layers", f"[{start}, {end}] is not a non-empty window")


def _key_text(_: object, __: attrs.Attribute[Any], v: Any) -> None:
    try:
        PublicKey.from_text(v)
    except InputError as exc:
        raise FieldError("holder_key", str(exc)) from None


def _grants(_: object, __: attrs.Attribute[Any], v: Any) -> None:
    if len(v) > 2 or not all(isinstance(g, str) and 0 < len(g) <= 2048 and g.isascii() for g in v):
        raise FieldError("grants", "at most two ASCII edge grants of at most 2048 characters")


def _endpoint(_: object, __: attrs.Attribute[Any], v: Any) -> None:
    """``host:port`` of a direct link, or ``relay:<ws-url>`` for a node reached through a relay edge."""
    if v is None:
        return
    if isinstance(v, str) and v.startswith("relay:"):
        if not v[6:].startswith(("ws://", "wss://")) or len(v) > MAX_TEXT:
            raise FieldError("endpoint", "of a relay is 'relay:ws://…' or 'relay:wss://…'")
        return
    try:
        parse_hostport(v, what="endpoint")
    except InputError:
        raise FieldError("endpoint", "must be 'host:port' or 'relay:ws(s)://…'") from None


def sha256_field(d: Mapping[str, Any], key: str, where: str) -> str:
    v = d.get(key)
    if not is_sha256(v):
        raise InputError(f"{where}: '{key}' must be a sha256 in lowercase hex")
    return str(v)


class _Record:
    """``to_wire``: the record as its JSON body (the schema converter's shape)."""

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out


class _Body(_Record):
    """A record that parses from its JSON body with no context; ``WHERE`` names it in errors."""

    WHERE: ClassVar[str]

    @classmethod
    def from_wire(cls, data: Any, where: str | None = None) -> Self:
        return structure(data, cls, where=where or cls.WHERE)


# ---------------------------------------------------------------------------------------------- models


_kernel_class = rule(lambda v: isinstance(v, str) and 0 < len(v) <= 64, "must be 1-64 characters")


@attrs.frozen
class Probe(_Body):
    """The publisher's probe hash of one window in one kernel class (kvasir.verify.probe): admission by reproduction."""

    WHERE: ClassVar[str] = "probe"

    kernel_class: str = attrs.field(validator=_kernel_class)
    sha256: str = attrs.field(validator=_sha256)


@attrs.frozen
class StageHash(_Body):
    """The stage file ``kvasir slice`` writes for one window: its sha256 and size, and its probe hashes."""

    WHERE: ClassVar[str] = "stage"

    start: int
    end: int = attrs.field(validator=_window_end)
    sha256: str = attrs.field(validator=_sha256)
    bytes: int = attrs.field(validator=int_in(1))
    probes: tuple[Probe, ...] = attrs.field(default=(), validator=rule(lambda v: len(v) <= 16, "at most 16 probes"))

    def probe_map(self) -> dict[str, str]:
        return {p.kernel_class: p.sha256 for p in self.probes}


@attrs.frozen
class ModelRecord(_Record):
    """A model on offer: its identity, where to download it, its byte profile and its windows' stage hashes."""

    sha256: str = attrs.field(validator=_sha256)
    name: str = attrs.field(validator=_text)
    n_layers: int = attrs.field(validator=int_in(1, key="layers"))
    file_bytes: int = attrs.field(validator=int_in(1, MAX_FILE_BYTES))
    #: Bytes of the GGUF header (metadata and tensor infos, up to the aligned data offset).
    header_bytes: int = attrs.field(validator=int_in(24, MAX_FILE_BYTES))
    #: URLs serving the whole GGUF with HTTP Range support.
    sources: tuple[str, ...]
    layer_bytes: tuple[int, ...]
    outside_bytes: int = attrs.field(validator=int_in(0))
    stages: tuple[StageHash, ...]
    #: The operator's signature (kvasir.market.auth): nodes load nothing from an unsigned or foreign record.
    signature: str | None = attrs.field(default=None, validator=optional(_text))

    def __attrs_post_init__(self) -> None:
        if self.header_bytes > self.file_bytes:
            raise InputError("'header_bytes' exceeds 'file_bytes'")
        if not 1 <= len(self.sources) <= MAX_SOURCES:
            raise InputError(f"'sources' must be a list of 1-{MAX_SOURCES} URLs")
        for url in self.sources:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > MAX_TEXT:
                raise InputError("every source must be an http:// or https:// URL")
        if len(self.layer_bytes) != self.n_layers or not all(
            is_int(x) and 0 <= x <= MAX_FILE_BYTES for x in self.layer_bytes
        ):
            raise InputError(f"'layer_bytes' must list {self.n_layers} byte counts")
        if len(self.stages) > MAX_WINDOWS:
            raise InputError(f"'stages' may list at most {MAX_WINDOWS} windows")
        if any(s.end > self.n_layers for s in self.stages):
            raise InputError(f"a stage window ends past layer {self.n_layers}")
        if len({(s.start, s.end) for s in self.stages}) != len(self.stages):
            raise InputError("a stage window is listed twice")

    def stage(self, start: int, end: int) -> StageHash | None:
        return next((s for s in self.stages if (s.start, s.end) == (start, end)), None)

    def signed(self, identity: Identity) -> ModelRecord:
        """This record with the operator's signature."""
        return attrs.evolve(self, signature=auth.sign_record(identity, auth.MODEL_DOMAIN, self.to_wire()))

    def signed_by(self, key: PublicKey) -> bool:
        return auth.record_signed_by(key, auth.MODEL_DOMAIN, self.to_wire(), self.signature)

    def same_content(self, other: ModelRecord) -> bool:
        return canonical_json(b"", self.to_wire()) == canonical_json(b"", other.to_wire())

    @classmethod
    def from_wire(cls, data: Any, where: str = "model") -> ModelRecord:
        if isinstance(data, Mapping):  # the fields the wire may leave out
            data = {"name": "model", "outside_bytes": 0, "stages": [], **data}
        return structure(data, cls, where=where)


# ---------------------------------------------------------------------------------------------- rank manifest


@attrs.frozen
class WindowSpec(_Body):
    WHERE: ClassVar[str] = "window"

    start: int
    end: int = attrs.field(validator=_window_end)
    #: Reward weight: credits per token this window earns at base demand.
    weight: float = attrs.field(default=1.0, validator=number_in(0.0, 1e12))


@attrs.frozen
class ManifestRecord(_Record):
    """The rank manifest of a model: its windows in ring order, each with a reward weight."""

    model: str
    windows: tuple[WindowSpec, ...]
    #: "planner" (windows from kvasir.planner) or "explicit".
    origin: str = attrs.field(
        default="explicit", validator=rule(lambda v: v in ("planner", "explicit"), "must be 'planner' or 'explicit'")
    )

    def __attrs_post_init__(self) -> None:
        if not 2 <= len(self.windows) <= MAX_WINDOWS:
            raise InputError(f"'windows' must list 2-{MAX_WINDOWS} windows")

    @classmethod
    def from_wire(cls, data: Any, model: str, where: str = "manifest") -> ManifestRecord:
        """The body of ``PUT /v1/models/<model>/manifest``: the model comes from the URL, not the body."""
        if isinstance(data, Mapping):
            data = {**data, "model": model}
        return structure(data, cls, where=where)


# ---------------------------------------------------------------------------------------------- claims


@attrs.frozen
class ClaimRequest(_Record):
    """Body of claim and renew: which window, who, for how long, and (once serving) where to reach it."""

    model: str = attrs.field(validator=_sha256)
    start: int
    end: int = attrs.field(validator=_window_end)
    node_id: str = attrs.field(validator=_node_id)
    lease_s: float = attrs.field(default=30.0, validator=number_in(MIN_LEASE_S, MAX_LEASE_S))
    endpoint: str | None = attrs.field(default=None, validator=_endpoint)
    state: LeaseState = attrs.field(default="fetching", validator=_state)
    #: Renew only: the lease being renewed.
    lease_id: str | None = attrs.field(default=None, validator=optional(_text))

    def __attrs_post_init__(self) -> None:
        if self.state == "serving" and self.endpoint is None:
            raise InputError("a serving holder must give its 'endpoint'")

    @classmethod
    def from_wire(cls, data: Any, *, renew: bool = False, where: str = "claim") -> ClaimRequest:
        if isinstance(data, Mapping) and not renew:
            data = {k: v for k, v in data.items() if k != "lease_id"}  # only a renewal names its lease
        req = structure(data, cls, where=where)
        if renew and req.lease_id is None:
            raise InputError(f"{where}: 'lease_id' must be a non-empty string of at most {MAX_TEXT} characters")
        return req


@attrs.frozen
class LeaseRef(_Body):
    """Body of release: the lease to give up."""

    WHERE: ClassVar[str] = "release"

    model: str = attrs.field(validator=_sha256)
    start: int
    end: int = attrs.field(validator=_window_end)
    node_id: str = attrs.field(validator=_node_id)
    lease_id: str = attrs.field(validator=_text)


@attrs.frozen
class LinkVouch(_Body):
    """Body of vouch: the holder of a window says it has a live authenticated link with ``key``, the holder of the
    window before its own (``side`` "predecessor": the link checked that key's market ticket for exactly that
    window) or after it ("successor": the node dialled that window's endpoint with that key pinned). A vouch from a
    holder of a distinct key confirms that neighbour's lease (docs/market.md § Leases must become service)."""

    WHERE: ClassVar[str] = "vouch"

    model: str = attrs.field(validator=_sha256)
    start: int
    end: int = attrs.field(validator=_window_end)
    node_id: str = attrs.field(validator=_node_id)
    lease_id: str = attrs.field(validator=_text)
    #: The neighbour's whole public key (``ed25519:…``), as its link authenticated it.
    key: str = attrs.field(validator=_key_text)
    side: Literal["predecessor", "successor"] = attrs.field(
        default="predecessor", validator=rule(lambda v: v in ("predecessor", "successor"),
                                              "must be 'predecessor' or 'successor'"),
    )  # fmt: skip


_nonce = rule(lambda v: isinstance(v, str) and 0 < len(v) <= 64 and v.isascii() and v.isalnum(),
              "must be 1-64 ASCII letters or digits")  # fmt: skip


@attrs.frozen
class AdmissionRequest(_Body):
    """Body of admission: the proof of work (:mod:`kvasir.market.work`) that admits the signing key to claim."""

    WHERE: ClassVar[str] = "admission"

    node_id: str = attrs.field(validator=_node_id)
    nonce: str = attrs.field(validator=_nonce)


@attrs.frozen
class Lease(_Body):
    """A granted lease: the holder owns the window until ``expires_at`` (unix seconds) unless it renews."""

    WHERE: ClassVar[str] = "lease"

    model: str = attrs.field(validator=_sha256)
    start: int
    end: int = attrs.field(validator=_window_end)
    node_id: str = attrs.field(validator=_node_id)
    lease_id: str = attrs.field(validator=_text)
    expires_at: float = attrs.field(validator=number_in(0, 1e12))
    #: The window ticket (kvasir.market.tickets) the market signed for the holder; neighbours check it.
    ticket: str | None = attrs.field(default=None, validator=optional(_ticket))
    #: Relay edge grants (kvasir.relay.grant) the market signed for the holder's two edges: relay admission without a
    #: secret every node shares.
    grants: tuple[str, ...] = attrs.field(default=(), validator=_grants)


# ---------------------------------------------------------------------------------------------- demand, credits


@attrs.frozen
class CreditReport(_Body):
    """Tokens a lease holder served on its window under this lease, in all (cumulative: a repeated report is
    idempotent, and the market credits at most what the window could have served since the claim)."""

    WHERE: ClassVar[str] = "credit"

    model: str = attrs.field(validator=_sha256)
    start: int
    end: int = attrs.field(validator=_window_end)
    node_id: str = attrs.field(validator=_node_id)
    lease_id: str = attrs.field(validator=_text)
    tokens: int = attrs.field(default=0, validator=int_in(0, MAX_LEASE_TOKENS))


@attrs.frozen
class Receipt(_Body):
    """One request a holder served on its window: its id, the tokens the ring generated for it, the node id holding
    each window (in rank order; "" where none) while it ran, and the client's signed authorisation that START
    carried (kvasir.core.clientauth). The market settles a request once the holder of every window sent a receipt
    for its authorisation (docs/market.md § Credit); a receipt without one settles nothing. ``entry``: unused (a
    receipt of an older node named its request's entry node)."""

    WHERE: ClassVar[str] = "receipt"

    request: int = attrs.field(validator=int_in(0, 2**64 - 1))
    tokens: int = attrs.field(validator=int_in(0, MAX_REPORT_TOKENS))
    holders: tuple[str, ...]
    entry: str | None = attrs.field(default=None, validator=optional(_node_id))
    client_auth: str | None = attrs.field(default=None, validator=optional(_client_auth))

    def __attrs_post_init__(self) -> None:
        if len(self.holders) > MAX_WINDOWS or not all(
            isinstance(h, str) and (h == "" or _NODE_ID.fullmatch(h)) for h in self.holders
        ):
            raise FieldError("holders", f"must list at most {MAX_WINDOWS} node ids (or '')")


@attrs.frozen
class ReceiptBatch(_Body):
    """Body of ``POST /v1/receipts``: receipts a witness (entry or exit) signs, with the request."""

    WHERE: ClassVar[str] = "receipts"

    model: str = attrs.field(validator=_sha256)
    node_id: str = attrs.field(validator=_node_id)
    receipts: tuple[Receipt, ...]

    def __attrs_post_init__(self) -> None:
        if not 1 <= len(self.receipts) <= MAX_RECEIPTS:
            raise InputError(f"'receipts' must list 1-{MAX_RECEIPTS} receipts")


# ---------------------------------------------------------------------------------------------- coverage (read side)


@attrs.frozen
class CoverageEntry(_Body):
    """One window of a model's rank manifest as the coverage map shows it."""

    WHERE: ClassVar[str] = "window"

    model: str = attrs.field(validator=_sha256)
    rank: int = attrs.field(validator=int_in(0))
    start: int
    end: int = attrs.field(validator=_window_end)
    weight: float = attrs.field(validator=number_in(0, 1e12))
    #: Credits per token served on this window now (weight × the model's demand multiplier).
    reward: float = attrs.field(validator=number_in(0, 1e18))
    #: Bytes of the window's stage file (what a holder downloads and loads).
    bytes: int = attrs.field(validator=int_in(1))
    sha256: str = attrs.field(validator=_sha256)
    holder: str | None = None
    lease_expires: float | None = attrs.field(default=None, validator=optional(number_in(0, 1e12)))
    state: LeaseState | None = attrs.field(default=None, validator=optional(_state))
    endpoint: str | None = attrs.field(default=None, validator=_endpoint)
    #: The holder's whole public key (``ed25519:…``): a neighbour dials it with the key pinned (protocol v2).
    holder_key: str | None = attrs.field(default=None, validator=optional(_key_text))
    #: A neighbour of a distinct key vouched lately for the holder's link (docs/market.md § Leases must become
    #: service).
    confirmed: bool = attrs.field(default=False, validator=_bool)
    #: The holder is past its deadline and unconfirmed: another key's claim takes the window.
    claimable: bool = attrs.field(default=False, validator=_bool)

    @property
    def covered(self) -> bool:
        return self.holder is not None

    @property
    def serving(self) -> bool:
        return self.holder is not None and self.state == "serving" and self.endpoint is not None


def coverage_from_wire(data: Any, skipped: list[str] | None = None) -> list[CoverageEntry]:
    """The windows of every model in a ``GET /v1/coverage`` reply.

    A malformed model or window is left out (its reason appended to ``skipped``), so one bad entry cannot stop a
    node from enrolling on the others; only a reply that is not a coverage map at all raises.
    """
    models = data.get("models") if isinstance(data, Mapping) else None
    if not isinstance(models, list):
        raise InputError("coverage: 'models' must be a list")
    out: list[CoverageEntry] = []
    for i, m in enumerate(models):
        windows = m.get("windows") if isinstance(m, Mapping) else None
        if not isinstance(windows, list):
            if skipped is not None:
                skipped.append(f"coverage: models[{i}]: 'windows' must be a list")
            continue
        for j, w in enumerate(windows):
            try:
                out.append(CoverageEntry.from_wire(w, f"coverage: models[{i}].windows[{j}]"))
            except InputError as exc:
                if skipped is not None:
                    skipped.append(str(exc))
    return out


for _cls in (WindowSpec, LeaseRef, CreditReport, LinkVouch):
    register_record(_cls, window=True)
register_record(AdmissionRequest)
register_record(Probe)
register_record(StageHash, window=True, omit_if_empty=("probes",))
register_record(CoverageEntry, window=True, omit_if_none=("holder_key",))
register_record(Lease, window=True, omit_if_none=("ticket",), omit_if_empty=("grants",))
register_record(ClaimRequest, window=True, omit_if_none=("lease_id",))
register_record(ModelRecord, rename={"n_layers": "layers"}, omit_if_none=("signature",))
register_record(ManifestRecord, key_order=("model", "origin", "windows"))
register_record(Receipt, omit_if_none=("entry", "client_auth"))
register_record(ReceiptBatch)


@attrs.frozen
class FraudRecord:
    """What the market writes down when it acts on a fraud proof (``POST /v1/fraud``, docs/market.md § Fraud):
    the proof's id, the suspect (its key's fingerprint) and window, the request and step the proof names, who
    submitted it and how it was judged (``reexecuted``: the market ran the window; ``operator``: the operator
    vouched for a proof the market could not run)."""

    proof_id: str
    node_id: str
    model: str
    start: int
    end: int
    request: int
    step: int
    submitter: str
    verdict: str
