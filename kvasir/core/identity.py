"""Node identities: an Ed25519 key pair per node; a node's id is its public key's fingerprint.

The key file is PKCS#8 PEM, created once with mode 0600 and never rewritten. Public keys travel as text
``ed25519:<base64url of the 32 raw bytes>`` (manifests, market records, ``kvasir id``).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import attrs
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvasir.core.errors import InputError
from kvasir.core.signed import b64url, unb64url

KEY_PREFIX = "ed25519:"
IDENTITY_FILE = "identity.pem"


def fingerprint_of(raw: bytes) -> str:
    """The short, stable id of a raw public key: 16 hex digits of its SHA-256."""
    return hashlib.sha256(raw).hexdigest()[:16]


@attrs.frozen(order=True)
class PublicKey:
    """A node's Ed25519 public key (32 raw bytes)."""

    raw: bytes = attrs.field(validator=attrs.validators.instance_of(bytes))

    def __attrs_post_init__(self) -> None:
        if len(self.raw) != 32:
            raise InputError(f"an Ed25519 public key has 32 bytes, not {len(self.raw)}")

    @classmethod
    def from_text(cls, text: str) -> PublicKey:
        """Parse ``ed25519:<base64url>``; InputError names what is wrong."""
        if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
            raise InputError(f"a node key looks like {KEY_PREFIX}<base64url>, not {str(text)[:40]!r}")
        try:
            raw = unb64url(text[len(KEY_PREFIX) :], "node key")
        except InputError:
            raise InputError(f"node key {text[:40]!r} is not base64url") from None
        return cls(raw)

    def to_text(self) -> str:
        return KEY_PREFIX + b64url(self.raw)

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self.raw)

    def verify(self, signature: bytes, message: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def __str__(self) -> str:
        return self.to_text()


@attrs.frozen
class Identity:
    """A node's key pair. ``node_id`` is the public key's fingerprint."""

    private: Ed25519PrivateKey
    public: PublicKey

    @classmethod
    def generate(cls) -> Identity:
        return cls.from_private(Ed25519PrivateKey.generate())

    @classmethod
    def from_private(cls, private: Ed25519PrivateKey) -> Identity:
        raw = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(private, PublicKey(raw))

    @property
    def node_id(self) -> str:
        return self.public.fingerprint

    def sign(self, message: bytes) -> bytes:
        return self.private.sign(message)

    def private_pem(self) -> bytes:
        return self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )


def load_identity(path: Path) -> Identity:
    """Read a key file; refuse one that others can read (like ssh does) or that is not an Ed25519 key."""
    try:
        st = path.stat()
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"cannot read identity {path}: {exc.strerror}") from exc
    if os.name == "posix" and st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InputError(f"identity {path} is readable by others (mode {st.st_mode & 0o777:o}); chmod 600 it")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise InputError(f"identity {path} is not an unencrypted PEM private key") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise InputError(f"identity {path} holds a {type(key).__name__}, not an Ed25519 key")
    return Identity.from_private(key)


def create_identity(path: Path) -> Identity:
    """Write a new key file with mode 0600; never replaces an existing one (a racing creator's key wins)."""
    identity = Identity.generate()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(identity.private_pem())
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)  # fails if the file appeared meanwhile: never overwrite a key
        except FileExistsError:
            return load_identity(path)
    except OSError as exc:
        raise InputError(f"cannot write identity {path}: {exc.strerror}") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return identity


def load_or_create_identity(path: Path) -> Identity:
    """The identity at ``path``, created on first use."""
    return load_identity(path) if path.exists() else create_identity(path)


def named_identity(path: Path | None, default: Path, *, create: bool = False) -> Identity:
    """The key a command runs as: ``default`` is created on first use; a named ``path`` only with ``create``.

    A mistyped ``--identity`` must not quietly become a fresh key (the ring then refuses it as a key mismatch, far
    from the typo), so a named file that does not exist is an error unless the user asked for a new key.
    """
    if path is None:
        return load_or_create_identity(default)
    if create or path.exists():
        return load_or_create_identity(path)
    raise InputError(f"identity {path} does not exist (add --create-identity to make a new key there)")
