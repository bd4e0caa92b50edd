"""Who may write to the market: signed requests (operator and nodes) and signed model records.

**Requests.** Every write carries four headers: ``x-kvasir-key`` (the signer's public key text), ``x-kvasir-time``
(unix seconds, an integer), ``x-kvasir-nonce`` (16-64 characters of [0-9a-f]) and ``x-kvasir-signature`` (base64url
Ed25519) over::

    kvasir-market-request/v1\\n<METHOD>\\n<target>\\n<time>\\n<nonce>\\n<sha256 hex of the body>

The market accepts a request whose time is within :data:`REQUEST_WINDOW_S` of its clock and whose nonce it has
not seen in that window (:class:`NonceCache`, bounded), so a captured request cannot be replayed.

**Market time.** Every reply of the market carries ``x-kvasir-market-time`` (unix seconds, decimal, its clock when
it replied). A client signs with its estimate of the market's time, not its own clock: the last value seen plus
the monotonic time elapsed since (:class:`MarketTime`), so neither side's clock steps nor a skew between them make
requests stale. A ``stale_request`` refusal carries the header too: the client re-learns and signs again once.

**Records.** A model record carries the operator's ``signature`` (base64url Ed25519) over
``kvasir-model/v1\\n`` + the record's canonical JSON (sorted keys, no spaces, without ``signature``). Nodes pin the
operator's key and check it before they fetch or load anything the record names.

Every function here is pure: time is passed in.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import attrs

from kvasir.core.errors import InputError, MarketError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.signed import canonical_json, canonical_lines, sign, unb64url, verify

REQUEST_DOMAIN = b"kvasir-market-request/v1\n"
MODEL_DOMAIN = b"kvasir-model/v1\n"
DELEGATION_DOMAIN = b"kvasir-market-delegation/v1\n"
#: How far a request's time may be from the market's clock (both ways).
REQUEST_WINDOW_S = 60
#: Nonces remembered at once; a full cache refuses new requests (503) rather than forget a live nonce.
MAX_NONCES = 200_000
H_KEY, H_TIME, H_NONCE, H_SIG = "x-kvasir-key", "x-kvasir-time", "x-kvasir-nonce", "x-kvasir-signature"
#: The reply header with the market's time (see the module's docstring).
H_MARKET_TIME = "x-kvasir-market-time"
_MARKET_TIME = re.compile(r"[0-9]{1,12}(\.[0-9]{1,9})?")
_NONCE = re.compile(r"[0-9a-f]{16,64}")
_TIME = re.compile(r"[0-9]{1,12}")
#: Longest signature text read (an Ed25519 signature is 86 characters of base64url).
MAX_SIGNATURE_CHARS = 200


# ---------------------------------------------------------------------------------------------- requests


def request_message(method: str, target: str, when: int, nonce: str, body: bytes) -> bytes:
    return canonical_lines(REQUEST_DOMAIN, method, target, when, nonce, hashlib.sha256(body).hexdigest())


def sign_request(identity: Identity, method: str, target: str, body: bytes, now: float) -> dict[str, str]:
    """The headers that sign one request made at ``now``."""
    when, nonce = int(now), secrets.token_hex(16)
    sig = sign(identity, request_message(method, target, when, nonce, body))
    return {H_KEY: identity.public.to_text(), H_TIME: str(when), H_NONCE: nonce, H_SIG: sig}


def format_market_time(now: float) -> str:
    return f"{now:.3f}"


def parse_market_time(text: str | None) -> float | None:
    """The market's time from a reply's header, or None (absent or malformed)."""
    if text is None or not _MARKET_TIME.fullmatch(text):
        return None
    return float(text)


class MarketTime(NamedTuple):
    """A client's estimate of the market's clock: ``seen`` market seconds at ``mono`` on the client's monotonic
    clock (pure: the caller passes the monotonic time in; in-process state, never on the wire)."""

    seen: float
    mono: float

    def at(self, mono: float) -> float:
        return self.seen + (mono - self.mono)


@attrs.frozen
class Signed:
    """A request whose signature checked out: who signed it, and its nonce and time (for the replay cache)."""

    key: PublicKey
    nonce: str
    when: int

    @property
    def node_id(self) -> str:
        return self.key.fingerprint


def verify_request(method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes, now: float) -> Signed:
    """The signer of a request, or MarketError 401 naming what is missing or wrong (pure: no replay check)."""
    h: dict[str, str] = {}
    for k, v in headers:
        if k.lower() in (H_KEY, H_TIME, H_NONCE, H_SIG):
            h[k.lower()] = v
    if len(h) != 4:
        raise MarketError(401, "unsigned", "this request must be signed (x-kvasir-key, -time, -nonce, -signature)")
    try:
        key = PublicKey.from_text(h[H_KEY])
        sig = unb64url(h[H_SIG], "x-kvasir-signature", max_chars=MAX_SIGNATURE_CHARS)
    except InputError as exc:
        raise MarketError(401, "bad_signature", str(exc)) from None
    if not _TIME.fullmatch(h[H_TIME]) or not _NONCE.fullmatch(h[H_NONCE]):
        raise MarketError(401, "bad_signature", "x-kvasir-time is unix seconds; x-kvasir-nonce is 16-64 hex digits")
    when = int(h[H_TIME])
    if abs(when - now) > REQUEST_WINDOW_S:
        raise MarketError(401, "stale_request", f"request time {when} is more than {REQUEST_WINDOW_S} s off")
    if not key.verify(sig, request_message(method, target, when, h[H_NONCE], body)):
        raise MarketError(401, "bad_signature", "the request's signature does not match its key")
    return Signed(key, h[H_NONCE], when)


class NonceCache:
    """Nonces seen within the request window; bounded (a full cache refuses, it never forgets a live nonce)."""

    def __init__(self, window_s: float = REQUEST_WINDOW_S, max_entries: int = MAX_NONCES) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: dict[str, float] = {}  # nonce -> when it can be forgotten (insertion order ~ time order)

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, signed: Signed, now: float) -> None:
        """Remember ``signed.nonce``; MarketError 401 if it was used already, 503 if the cache is full."""
        self._expire(now)
        if signed.nonce in self._seen:
            raise MarketError(401, "replayed_request", "this request's nonce was used already")
        if len(self._seen) >= self.max_entries:
            raise MarketError(503, "busy", "too many signed requests in flight; retry shortly")
        # Kept until the request's time leaves the window, whatever our clock said at arrival.
        self._seen[signed.nonce] = max(now, signed.when) + self.window_s

    def _expire(self, now: float) -> None:
        # Oldest first (insertion order is nearly time order): stop at the first live one, so each call costs only
        # what it removes. A nonce stored out of order is kept a little longer, which is the safe direction.
        stale = []
        for n, until in self._seen.items():
            if until >= now:
                break
            stale.append(n)
        for n in stale:
            del self._seen[n]


# ---------------------------------------------------------------------------------------------- records


def sign_record(identity: Identity, domain: bytes, wire: Mapping[str, Any]) -> str:
    return sign(identity, canonical_json(domain, wire))


def signature_ok(key: PublicKey, message: bytes, signature: object) -> bool:
    """Whether ``signature`` (base64url text, or anything a body may hold) is ``key``'s signature of ``message``."""
    return verify(key, signature, message, max_chars=MAX_SIGNATURE_CHARS)


def record_signed_by(key: PublicKey, domain: bytes, wire: Mapping[str, Any], signature: str | None) -> bool:
    return signature_ok(key, canonical_json(domain, wire), signature)


def delegation_message(market: PublicKey) -> bytes:
    """What the operator signs to say that ``market`` may issue window tickets for its models."""
    return DELEGATION_DOMAIN + market.to_text().encode()


def sign_delegation(operator: Identity, market: PublicKey) -> str:
    """The operator's delegation to ``market``, as base64url signature text."""
    return sign(operator, delegation_message(market))
