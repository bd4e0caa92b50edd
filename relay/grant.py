"""Edge tokens v2: relay admission signed by the ring's operator key, never by a secret every node shares.

Two signatures, so the operator need not be online every few minutes:

- an **edge grant**, signed by the operator (the ring's owner, or the market for market rings): ring (the manifest's
  sha256), edge id, role, the holder's public key and the grant's expiry;
- a **token**, signed by the holder with its own key: the grant's digest and a short expiry (at most
  :data:`MAX_TOKEN_LIFETIME` ahead of the relay's clock), renewed by the node.

Text form (one HTTP header value, URL-safe): ``v2.<grant>.<grant signature>.<expires_at>.<holder signature>`` where
``<grant>`` is the base64url of the grant's canonical bytes (below) and signatures are base64url Ed25519. Canonical
grant bytes: ``kvasir-edge-grant/v2\\n<ring>\\n<edge>\\n<role>\\n<holder key text>\\n<not_after>\\n<issuer key text>``.
The holder signs ``kvasir-edge-token/v2\\n`` + sha256(grant bytes) + ``\\n<expires_at>``. Every function is pure:
time is passed in.
"""

from __future__ import annotations

import hashlib
import re

import attrs

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.signed import b64url, canonical_lines, seal, split_lines, unb64url
from kvasir.relay.errors import EdgeTokenError, EdgeTokenExpired
from kvasir.relay.token import Role, is_valid_edge_id

TOKEN_VERSION_V2 = "v2"
MAX_TOKEN_LIFETIME = 600  # seconds: a stolen token is worth ten minutes at most
CLOCK_SKEW = 30  # seconds of disagreement between a node's clock and the relay's that we tolerate
MAX_TOKEN_CHARS = 2048
_RING = re.compile(r"[0-9a-f]{64}")
_GRANT_DOMAIN = b"kvasir-edge-grant/v2\n"
_TOKEN_DOMAIN = b"kvasir-edge-token/v2\n"


def _unb64(text: str, what: str) -> bytes:
    try:
        return unb64url(text, what)
    except InputError as exc:
        raise EdgeTokenError(f"malformed edge token {what}") from exc


@attrs.frozen
class EdgeGrant:
    """The operator's word that ``holder`` may be ``role`` on ``edge`` of ``ring`` until ``not_after``."""

    ring: str
    edge: str
    role: Role
    holder: PublicKey
    not_after: int
    issuer: PublicKey

    def __attrs_post_init__(self) -> None:
        if not _RING.fullmatch(self.ring):
            raise InputError("a grant's ring is the manifest's lowercase hex sha256")
        if not is_valid_edge_id(self.edge):
            raise InputError(f"invalid edge id {self.edge!r}")
        if self.not_after < 0:
            raise InputError("not_after must be a non-negative Unix time")

    def to_bytes(self) -> bytes:
        return canonical_lines(
            _GRANT_DOMAIN,
            self.ring,
            self.edge,
            int(self.role),
            self.holder.to_text(),
            self.not_after,
            self.issuer.to_text(),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> EdgeGrant:
        try:
            ring, edge, role, holder, not_after, issuer = split_lines(data, _GRANT_DOMAIN, 6, "edge grant")
            if not not_after.isdigit() or len(not_after) > 20 or str(int(not_after)) != not_after:
                raise ValueError("not_after")
            return cls(
                ring, edge, Role(int(role)), PublicKey.from_text(holder), int(not_after), PublicKey.from_text(issuer)
            )
        except ValueError as exc:  # InputError is a ValueError
            raise EdgeTokenError("malformed edge grant") from exc


def sign_grant(operator: Identity, grant: EdgeGrant) -> str:
    """``<grant>.<signature>``: the part of a token the operator hands a node (manifest, ``ring up``, market)."""
    if grant.issuer != operator.public:
        raise InputError("a grant is signed by its issuer")
    return seal(operator, grant.to_bytes())


def read_grant(signed_grant: str) -> EdgeGrant:
    """The grant inside ``<grant>.<signature>``, checked against its own issuer's signature (whether that issuer is
    trusted is the relay's question). A node reads its grants from the manifest with it, to pick the one for an
    edge and role and to catch a damaged or misplaced grant at start rather than at the relay."""
    grant_text, dot, sig_text = signed_grant.partition(".")
    if not dot or len(signed_grant) > MAX_TOKEN_CHARS:
        raise EdgeTokenError("malformed edge grant")
    data = _unb64(grant_text, "grant")
    grant = EdgeGrant.from_bytes(data)
    if not grant.issuer.verify(_unb64(sig_text, "grant signature"), data):
        raise EdgeTokenError("edge grant signature does not verify")
    return grant


def make_token(holder: Identity, signed_grant: str, expires_at: int) -> str:
    """The token a node presents to the relay: its grant and its own signature over a short expiry."""
    grant_text, _, _ = signed_grant.partition(".")
    digest = hashlib.sha256(_unb64(grant_text, "grant")).digest()
    signature = holder.sign(_TOKEN_DOMAIN + digest + f"\n{expires_at}".encode("ascii"))
    return f"{TOKEN_VERSION_V2}.{signed_grant}.{expires_at}.{b64url(signature)}"


@attrs.frozen
class CheckedToken:
    """A verified token: its grant, its expiry, and its identity (the relay takes each token once, and a same-key
    connection replaces a live one only with a later expiry; security N13)."""

    grant: EdgeGrant
    expires_at: int
    #: sha256 of what the holder signed (grant digest and expiry): one per token, whatever its signature's spelling.
    token_id: bytes


def verify_token(token: str, trusted: frozenset[PublicKey], edge: str, role: Role | None, now: int) -> EdgeGrant:
    """Check ``token`` for ``role`` (None: the role its grant names) on ``edge`` at Unix time ``now``.

    Returns the verified grant. The caller keys the edge by ``(grant.issuer, grant.ring, edge)`` and pins
    ``grant.holder`` for the role. Raises :class:`EdgeTokenExpired` for a genuine but expired token or grant,
    :class:`EdgeTokenError` for anything else.
    """
    return check_token(token, trusted, edge, role, now).grant


def check_token(token: str, trusted: frozenset[PublicKey], edge: str, role: Role | None, now: int) -> CheckedToken:
    """:func:`verify_token`, returning also the token's expiry and identity."""
    if len(token) > MAX_TOKEN_CHARS:
        raise EdgeTokenError("edge token too long")
    parts = token.split(".")
    if len(parts) != 5 or parts[0] != TOKEN_VERSION_V2:
        raise EdgeTokenError("malformed edge token")
    _, grant_text, grant_sig_text, expiry_text, holder_sig_text = parts
    data = _unb64(grant_text, "grant")
    grant = EdgeGrant.from_bytes(data)
    if grant.issuer not in trusted:
        raise EdgeTokenError(f"edge grant issued by an untrusted key {grant.issuer.fingerprint}")
    if not grant.issuer.verify(_unb64(grant_sig_text, "grant signature"), data):
        raise EdgeTokenError("edge grant signature does not verify")
    if grant.edge != edge or (role is not None and grant.role != role):
        raise EdgeTokenError("edge grant is for another edge or role")
    if not expiry_text.isdigit() or len(expiry_text) > 20 or str(int(expiry_text)) != expiry_text:
        raise EdgeTokenError("malformed edge token expiry")
    expires_at = int(expiry_text)
    message = _TOKEN_DOMAIN + hashlib.sha256(data).digest() + f"\n{expires_at}".encode("ascii")
    if not grant.holder.verify(_unb64(holder_sig_text, "holder signature"), message):
        raise EdgeTokenError("edge token is not signed by the grant's holder")
    if expires_at - now > MAX_TOKEN_LIFETIME + CLOCK_SKEW:
        raise EdgeTokenError(f"edge token lives longer than {MAX_TOKEN_LIFETIME} s")
    if now >= expires_at:
        raise EdgeTokenExpired(f"edge token expired at {expires_at}")
    if now >= grant.not_after:
        raise EdgeTokenExpired(f"edge grant expired at {grant.not_after}")
    return CheckedToken(grant, expires_at, hashlib.sha256(message).digest())
