"""Client authorisations: a market client's signed word that it pays for one request (docs/market.md § Credit).

The client signs, with the key of its market account: the market's key (no other market can settle it), the model,
a nonce (one request), the most tokens it pays for, the most it pays per token (micro-credits, all windows
together) and an expiry (market time, unix seconds). Text form (ASCII; the API takes it in the
``X-Kvasir-Client-Auth`` header, START and the receipts carry it unchanged)::

    ka1.<base64url of the canonical bytes>.<base64url Ed25519 signature by the client>

Canonical bytes: ``kvasir-client-auth/v1\\n<client key>\\n<market key>\\n<model>\\n<nonce>\\n<max_tokens>\\n
<max_price>\\n<not_after>``. Its id (:attr:`ClientAuth.auth_id`, the SHA-256 of those bytes) is what the market
settles at most once. Pure: no clock, no files.
"""

from __future__ import annotations

import hashlib
import re
import secrets

import attrs

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.signed import canonical_lines, seal, split_lines, unseal

AUTH_PREFIX = "ka1"
DOMAIN = b"kvasir-client-auth/v1\n"
#: The text form's length at most (what START's CLIENT_AUTH string may hold).
MAX_AUTH_CHARS = 1024
#: Tokens one authorisation pays for at most (START's own limit) and micro-credits per token at most.
MAX_AUTH_TOKENS = 1 << 20
MAX_PRICE = 10**15
#: Micro-credits in one credit: balances and prices are integers of these, so every move is exact.
MICRO = 1_000_000
_SHA = re.compile(r"[0-9a-f]{64}")
_NONCE = re.compile(r"[A-Za-z0-9_-]{8,64}")


@attrs.frozen
class ClientAuth:
    client: PublicKey
    market: PublicKey
    model: str
    nonce: str
    max_tokens: int
    max_price: int
    not_after: int

    def __attrs_post_init__(self) -> None:
        if not _SHA.fullmatch(self.model):
            raise InputError("a client authorisation's model is a lowercase hex sha256")
        if not _NONCE.fullmatch(self.nonce):
            raise InputError("a client authorisation's nonce is 8-64 characters of [A-Za-z0-9_-]")
        if not 1 <= self.max_tokens <= MAX_AUTH_TOKENS:
            raise InputError(f"a client authorisation pays for 1-{MAX_AUTH_TOKENS} tokens")
        if not 0 <= self.max_price <= MAX_PRICE:
            raise InputError(f"a client authorisation's price cap is 0-{MAX_PRICE} micro-credits per token")
        if not 0 <= self.not_after < 2**40:
            raise InputError("a client authorisation's expiry is unix seconds")

    def to_bytes(self) -> bytes:
        return canonical_lines(
            DOMAIN,
            self.client.to_text(),
            self.market.to_text(),
            self.model,
            self.nonce,
            self.max_tokens,
            self.max_price,
            self.not_after,
        )

    @property
    def auth_id(self) -> str:
        """What the market settles once: the SHA-256 of the signed bytes (hex)."""
        return hashlib.sha256(self.to_bytes()).hexdigest()

    @classmethod
    def from_bytes(cls, data: bytes) -> ClientAuth:
        parts = split_lines(data, DOMAIN, 7, "client authorisation")
        client, market, model, nonce, max_tokens, max_price, not_after = parts
        numbers = (max_tokens, max_price, not_after)
        if not all(n.isdigit() and len(n) <= 20 for n in numbers):
            raise InputError("a client authorisation's numbers are decimal")
        return cls(PublicKey.from_text(client), PublicKey.from_text(market), model, nonce, *(int(n) for n in numbers))


def sign_auth(
    client: Identity,
    market: PublicKey,
    model: str,
    *,
    max_tokens: int,
    max_price: int,
    not_after: int,
    nonce: str | None = None,
) -> str:
    """The text form of a fresh authorisation signed by ``client`` (a random nonce unless one is given)."""
    auth = ClientAuth(
        client.public, market, model, nonce or secrets.token_urlsafe(16), max_tokens, max_price, not_after
    )
    return f"{AUTH_PREFIX}.{seal(client, auth.to_bytes())}"


def parse_auth(text: str | bytes) -> ClientAuth:
    """The authorisation in ``text`` if its client signed it (InputError naming what is wrong otherwise); expiry,
    market and model are the settler's to check."""
    body, sig = unseal(text, AUTH_PREFIX, "client authorisation", max_chars=MAX_AUTH_CHARS)
    auth = ClientAuth.from_bytes(body)
    if not auth.client.verify(sig, body):
        raise InputError("the client authorisation is not signed by its client's key")
    return auth
