"""Signed market replies: every answer of the market is signed by the market's key, so a node acts on nothing an
on-path attacker wrote (security N1: a rewritten coverage map once chose the key a node's successor link pinned).

A client sends ``x-kvasir-reply-nonce`` (16-64 characters of [0-9a-f], fresh per request) with every request, GETs
included. The market answers with ``x-kvasir-reply-signature``: base64url Ed25519, by the market's key (the one
the operator delegates tickets to, ``/v1/operator``'s ``market``), over::

    kvasir-market-reply/v1\\n<METHOD>\\n<target>\\n<status>\\n<nonce>\\n<market time>\\n<sha256 hex of the body>

``target`` is the request's path and query as sent; ``nonce`` the request's (empty if it sent none). The nonce
makes a reply good for its own request only: an older signed map cannot be replayed in place of a fresh one.
Error replies (404, 409, ...) are signed the same way; replies the HTTP layer writes before the market sees the
request (413, 503 at the connection cap) are not, and a verifying client treats them as unanswered.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Mapping

from kvasir.core.errors import MarketError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.signed import canonical_lines, sign, verify

REPLY_DOMAIN = b"kvasir-market-reply/v1\n"
H_REPLY_NONCE = "x-kvasir-reply-nonce"
H_REPLY_SIG = "x-kvasir-reply-signature"
_NONCE = re.compile(r"[0-9a-f]{16,64}")
#: Longest reply signature read (an Ed25519 signature is 86 characters of base64url).
MAX_SIGNATURE_CHARS = 200


def new_nonce() -> str:
    return secrets.token_hex(16)


def request_nonce(headers: Mapping[str, str]) -> str:
    """The request's reply nonce (lower-case header names), or "" when it sent none or a malformed one."""
    nonce = headers.get(H_REPLY_NONCE, "")
    return nonce if _NONCE.fullmatch(nonce) else ""


def reply_message(method: str, target: str, status: int, nonce: str, market_time: str, body: bytes) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return canonical_lines(REPLY_DOMAIN, method, target, status, nonce, market_time, digest)


def sign_reply(
    identity: Identity, method: str, target: str, status: int, nonce: str, market_time: str, body: bytes
) -> str:
    """The ``x-kvasir-reply-signature`` of one reply."""
    return sign(identity, reply_message(method, target, status, nonce, market_time, body))


def check_reply(
    key: PublicKey,
    method: str,
    target: str,
    status: int,
    nonce: str,
    market_time: str | None,
    body: bytes,
    signature: str | None,
) -> None:
    """Nothing if ``signature`` is ``key``'s over this reply to this request; MarketError ``bad_reply`` (status 0:
    as good as no answer) otherwise, naming the route."""
    if signature is None:
        raise MarketError(0, "bad_reply", f"market: {method} {target}: reply ({status}) not signed by the market")
    message = reply_message(method, target, status, nonce, market_time or "", body)
    if not verify(key, signature, message, max_chars=MAX_SIGNATURE_CHARS):
        raise MarketError(
            0,
            "bad_reply",
            f"market: {method} {target}: reply ({status}) not signed by market key {key.fingerprint}: not acted on",
        )
