"""Edge tokens: who may join an edge of the ring through the relay.

A token is ``v1.<expires_at>.<signature>`` where ``signature`` is the unpadded base64url HMAC-SHA256, keyed
by the ring secret, of the ASCII bytes ``kvasir-edge-token/v1\\n<edge_id>\\n<role>\\n<expires_at>`` (``role``
is the preamble byte as a decimal digit, ``expires_at`` whole Unix seconds). The token names its expiry in
clear so the relay can tell an expired token from a forged one; edge and role are bound only through the
signature, so a token for one edge or role is useless for another. Every function here is pure: time is
passed in.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re

from kvasir.core.signed import b64url, canonical_lines
from kvasir.relay.errors import EdgeTokenError, EdgeTokenExpired

TOKEN_VERSION = "v1"
_DOMAIN = b"kvasir-edge-token/v1\n"
# URL-unreserved characters only: the id travels in the URL path unescaped and cannot hold the "\n" separator.
_EDGE_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")
_SIGNATURE_CHARS = 43  # base64url of 32 bytes, unpadded
MIN_SECRET_BYTES = 16


class Role(enum.IntEnum):
    """Which end of an edge a connection is; the value is the preamble byte."""

    UPSTREAM = 0x01  # the predecessor, which sends boundaries
    DOWNSTREAM = 0x02


def is_valid_edge_id(edge_id: str) -> bool:
    """True if ``edge_id`` is 1-128 URL-unreserved characters (``A-Z a-z 0-9 . _ ~ -``)."""
    return _EDGE_ID.fullmatch(edge_id) is not None


def _signature(secret: bytes, edge_id: str, role: Role, expires_at: int) -> str:
    message = canonical_lines(_DOMAIN, edge_id, int(role), expires_at)
    return b64url(hmac.new(secret, message, hashlib.sha256).digest())


def _check_inputs(secret: bytes, edge_id: str, role: Role) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"ring secret must be at least {MIN_SECRET_BYTES} bytes")
    if not is_valid_edge_id(edge_id):
        raise ValueError(f"invalid edge id {edge_id!r}")
    Role(role)  # raises ValueError for anything but 1 or 2


def make_edge_token(secret: bytes, edge_id: str, role: Role, expires_at: int) -> str:
    """Return the token that lets ``role`` join ``edge_id`` until Unix time ``expires_at`` (exclusive)."""
    _check_inputs(secret, edge_id, role)
    if expires_at < 0:
        raise ValueError("expires_at must be a non-negative Unix time")
    return f"{TOKEN_VERSION}.{expires_at}.{_signature(secret, edge_id, role, expires_at)}"


def verify_edge_token(secret: bytes, token: str, edge_id: str, role: Role, now: int) -> int:
    """Check ``token`` for ``role`` on ``edge_id`` at Unix time ``now``; return its expiry.

    Raises :class:`EdgeTokenError` when the token is malformed or signed for another edge, role or secret, and
    :class:`EdgeTokenExpired` when it is genuine but ``now >= expires_at``.
    """
    _check_inputs(secret, edge_id, role)
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_VERSION:
        raise EdgeTokenError("malformed edge token")
    _, expiry_text, signature = parts
    if not expiry_text.isascii() or not expiry_text.isdigit() or len(expiry_text) > 20:
        raise EdgeTokenError("malformed edge token expiry")
    expires_at = int(expiry_text)
    if str(expires_at) != expiry_text:  # one spelling per expiry, so no two tokens carry the same signature
        raise EdgeTokenError("malformed edge token expiry")
    if len(signature) != _SIGNATURE_CHARS or not signature.isascii():
        raise EdgeTokenError("malformed edge token signature")
    if not hmac.compare_digest(_signature(secret, edge_id, role, expires_at), signature):
        raise EdgeTokenError("edge token signature does not match this edge and role")
    if now >= expires_at:
        raise EdgeTokenExpired(f"edge token expired at {expires_at}")
    return expires_at
