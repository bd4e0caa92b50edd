"""Signed text: the one kit behind every Kvasir format that carries an Ed25519 signature.

- :func:`b64url` / :func:`unb64url`: unpadded base64url, the only binary-to-text encoding on the wire (keys,
  signatures, ticket and grant bodies, logged payloads).
- :func:`canonical_lines`: ``domain`` then the fields joined by ``\\n``, ASCII (window tickets, edge grants, market
  requests); :func:`split_lines` reads them back. :func:`canonical_json`: ``domain`` then sorted-key, space-free
  JSON (model records, receipts, fraud-proof ids).
- :func:`sign` / :func:`verify`: a signature as base64url text over such bytes; :func:`seal`:
  ``<base64url body>.<base64url signature>``, the signed-body form tickets and grants travel in.

Each format keeps its own domain string (docs/protocol.md names them), so no signature is valid in two formats.
Pure: no clock, no files. Keys are anything that signs or verifies (:class:`kvasir.core.identity.Identity`,
:class:`~kvasir.core.identity.PublicKey`), so this module imports neither.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from typing import Any, Protocol

from kvasir.core.errors import InputError

_B64URL = re.compile(r"[A-Za-z0-9_-]*={0,2}")


class Signer(Protocol):
    def sign(self, message: bytes) -> bytes: ...


class Verifier(Protocol):
    def verify(self, signature: bytes, message: bytes) -> bool: ...


def b64url(data: bytes) -> str:
    """``data`` as unpadded base64url text."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64url(text: object, what: str, *, max_chars: int | None = None) -> bytes:
    """The bytes of unpadded (or padded) base64url ``text``; InputError "``what`` is not base64url" for anything
    else: a non-string, text longer than ``max_chars``, or a character outside the base64url alphabet (standard
    base64's ``+`` and ``/``, spaces and newlines are refused, not skipped)."""
    if not isinstance(text, str) or (max_chars is not None and len(text) > max_chars) or not _B64URL.fullmatch(text):
        raise InputError(f"{what} is not base64url")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError):
        raise InputError(f"{what} is not base64url") from None


def canonical_lines(domain: bytes, *fields: object) -> bytes:
    """``domain`` followed by the fields' text joined by ``\\n``, UTF-8 (ASCII in every format but the market
    request's target: their fields are checked ASCII before they are signed)."""
    return domain + "\n".join(map(str, fields)).encode()


def split_lines(data: bytes, domain: bytes, count: int, what: str) -> list[str]:
    """The ``count`` fields of ``canonical_lines(domain, ...)`` bytes; InputError naming ``what`` otherwise."""
    if not data.startswith(domain):
        raise InputError(f"not a {what}")
    try:
        fields = data[len(domain) :].decode("ascii").split("\n")
    except UnicodeDecodeError:
        raise InputError(f"a {what} is ASCII") from None
    if len(fields) != count:
        raise InputError(f"a {what} has {count} fields")
    return fields


def canonical_json(domain: bytes, body: Mapping[str, Any], *, drop: str | None = "signature") -> bytes:
    """``domain`` followed by ``body`` (without the key ``drop``) as JSON: sorted keys, no spaces."""
    kept = {k: v for k, v in body.items() if k != drop}
    return domain + json.dumps(kept, sort_keys=True, separators=(",", ":")).encode()


def sign(signer: Signer, message: bytes) -> str:
    """``signer``'s signature of ``message`` as base64url text."""
    return b64url(signer.sign(message))


def verify(key: Verifier, signature: object, message: bytes, *, max_chars: int = 200) -> bool:
    """Whether ``signature`` (base64url text, or anything a body may hold) is ``key``'s signature of ``message``."""
    try:
        raw = unb64url(signature, "signature", max_chars=max_chars)
    except InputError:
        return False
    return key.verify(raw, message)


def seal(signer: Signer, body: bytes) -> str:
    """``<base64url body>.<base64url signature of body>``."""
    return f"{b64url(body)}.{sign(signer, body)}"


def unseal(text: str | bytes, prefix: str, what: str, *, max_chars: int) -> tuple[bytes, bytes]:
    """The (body, signature) of ``<prefix>.<seal>`` text, not yet verified: the signer is the caller's to know.
    InputError, naming ``what``, for anything else."""
    if isinstance(text, bytes):
        try:
            text = text.decode("ascii")
        except UnicodeDecodeError:
            raise InputError(f"a {what} is ASCII") from None
    if len(text) > max_chars:
        raise InputError(f"{what} too long")
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != prefix:
        raise InputError(f"a {what} looks like {prefix}.<body>.<signature>")
    body = unb64url(parts[1], f"{what} body", max_chars=max_chars)
    return body, unb64url(parts[2], f"{what} signature", max_chars=200)
