"""Protocol v2 link security: mutual authentication by node keys, then TLS 1.3 bound to those keys.

The dialer (the end that sends boundaries) must prove its key before the acceptor reveals anything but a greeting:

1. acceptor → dialer  ``CHALLENGE``: ``KV 02 01`` + 32-byte random nonce.
2. dialer → acceptor  ``AUTH``: ``KV 02 02`` + u16 cert length + the dialer's self-signed certificate (DER) + u16
   ticket length + ticket (empty, or a market window ticket) + Ed25519 signature over
   ``AUTH_CONTEXT || nonce || sha256(cert) || sha256(ticket) || acceptor's expected raw public key``.
3. acceptor → dialer  ``VERDICT``: ``KV 02 03`` + one byte (0 accepted, else a :class:`Refusal`); a refused link closes.
4. TLS 1.3 over the same stream: the acceptor is the server with its own certificate and requires the client
   certificate from ``AUTH`` (pinned as the only trust anchor); the dialer checks that the server certificate's key is
   the one it expected. Everything after this (HELLO, frames) runs inside TLS.

The signature binds the acceptor's fresh nonce, so a captured AUTH cannot be replayed, and TLS's CertificateVerify
proves both ends hold their keys, so a man in the middle who relays AUTH still cannot finish the TLS handshake.
Certificates carry no meaning beyond their key: validity and names are fixed; the key is what is pinned.
"""

from __future__ import annotations

import datetime
import enum
import hashlib
import os
import ssl
import struct
import tempfile
from pathlib import Path
from typing import Protocol

import attrs
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvasir.core.errors import ProtocolError, RingError
from kvasir.core.identity import Identity, PublicKey
from kvasir.ring.tlsstream import TLSStream

MAGIC = b"KV\x02"
CHALLENGE, AUTH, VERDICT = 1, 2, 3
NONCE_BYTES = 32
MAX_CERT_BYTES = 1024  # an Ed25519 self-signed certificate is ~300 bytes
MAX_TICKET_BYTES = 4096
AUTH_CONTEXT = b"kvasir link v2 auth\x00"
#: Before authentication a peer may make us read at most this much (AUTH at its largest).
MAX_PREAUTH_BYTES = 4 + 2 + MAX_CERT_BYTES + 2 + MAX_TICKET_BYTES + 64


class Refusal(enum.IntEnum):
    """The VERDICT byte of a refused AUTH (docs/protocol.md § Link security)."""

    ACCEPTED = 0
    UNKNOWN_KEY = 1  # the key is not this link's expected neighbour, nor backed by a valid ticket
    BAD_SIGNATURE = 2
    MALFORMED = 3


class LinkAuthError(RingError):
    """The peer failed (or refused) link authentication."""

    def __init__(self, message: str, refusal: Refusal = Refusal.MALFORMED) -> None:
        super().__init__(message)
        self.refusal = refusal


class PeerPolicy(Protocol):
    """Who may be this node's neighbour: a manifest's named key, or a valid market ticket for the window."""

    def problem(self, key: PublicKey, ticket: bytes) -> str | None:
        """Why ``key`` (with ``ticket``, possibly empty) may not link here, or None."""
        ...


@attrs.frozen
class KeyPolicy:
    """Accepts exactly the keys a rank manifest names for this link."""

    keys: frozenset[PublicKey]

    def problem(self, key: PublicKey, ticket: bytes) -> str | None:
        return None if key in self.keys else f"key {key.fingerprint} is not this link's neighbour"


@attrs.frozen
class AnyPolicy:
    """Accepts a peer that any of ``policies`` accepts (a manifest's key, or a market ticket)."""

    policies: tuple[PeerPolicy, ...]

    def problem(self, key: PublicKey, ticket: bytes) -> str | None:
        problems = [p.problem(key, ticket) for p in self.policies]
        return None if any(p is None for p in problems) else "; ".join(p for p in problems if p)


@attrs.frozen
class Credentials:
    """An identity with its TLS certificate, files kept only as long as an SSLContext needs to load them."""

    identity: Identity
    cert_der: bytes
    cert_pem: bytes

    @classmethod
    def of(cls, identity: Identity) -> Credentials:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvasir-{identity.node_id}")])
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(identity.private.public_key())
            .serial_number(int.from_bytes(hashlib.sha256(identity.public.raw).digest()[:16], "big") >> 1)
            .not_valid_before(datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC))
            .not_valid_after(datetime.datetime(9999, 12, 31, tzinfo=datetime.UTC))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(identity.private, None)
        )
        return cls(
            identity, cert.public_bytes(serialization.Encoding.DER), cert.public_bytes(serialization.Encoding.PEM)
        )

    def _load_into(self, ctx: ssl.SSLContext) -> None:
        # ssl loads chains only from files: write both to a private temp dir and delete them at once.
        with tempfile.TemporaryDirectory(prefix="kvasir-tls-") as tmp:
            cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert_path.write_bytes(self.cert_pem)
            fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(self.identity.private_pem())
            ctx.load_cert_chain(cert_path, key_path)

    def server_context(self, client_cert_der: bytes) -> ssl.SSLContext:
        """TLS 1.3 server context that accepts exactly one client certificate (the one AUTH proved)."""
        ctx = _tls13(ssl.PROTOCOL_TLS_SERVER)
        ctx.num_tickets = 0  # links never resume sessions; no post-handshake messages to wait on
        self._load_into(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
        ctx.load_verify_locations(cadata=client_cert_der)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """TLS 1.3 client context: presents our certificate; the server's key is checked after the handshake."""
        ctx = _tls13(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # no CA: the pinned key is checked by key_of_cert after the handshake
        self._load_into(ctx)
        return ctx


def _tls13(protocol: ssl._SSLMethod) -> ssl.SSLContext:
    ctx = ssl.SSLContext(protocol)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.maximum_version = ssl.TLSVersion.TLSv1_3
    return ctx


def key_of_cert(der: bytes) -> PublicKey:
    """The Ed25519 key a certificate binds, checked against its own self-signature."""
    try:
        cert = x509.load_der_x509_certificate(der)
        key = cert.public_key()
        if not isinstance(key, Ed25519PublicKey):
            raise LinkAuthError("certificate key is not Ed25519")
        key.verify(cert.signature, cert.tbs_certificate_bytes)
    except LinkAuthError:
        raise
    except Exception as exc:  # cryptography raises several unrelated types for malformed input
        raise LinkAuthError(f"bad certificate: {type(exc).__name__}") from exc
    return PublicKey(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def auth_message(nonce: bytes, cert_der: bytes, ticket: bytes, acceptor_key: PublicKey) -> bytes:
    """What the dialer signs in AUTH."""
    return AUTH_CONTEXT + nonce + hashlib.sha256(cert_der).digest() + hashlib.sha256(ticket).digest() + acceptor_key.raw


def encode_auth(creds: Credentials, nonce: bytes, ticket: bytes, acceptor_key: PublicKey) -> bytes:
    signature = creds.identity.sign(auth_message(nonce, creds.cert_der, ticket, acceptor_key))
    return (
        MAGIC
        + bytes([AUTH])
        + struct.pack("<H", len(creds.cert_der))
        + creds.cert_der
        + struct.pack("<H", len(ticket))
        + ticket
        + signature
    )


class _Reader:
    """Exact reads from a stream with a byte budget: a peer cannot make us buffer more than it is allowed."""

    def __init__(self, stream: trio.abc.Stream, budget: int) -> None:
        self._stream = stream
        self._buf = bytearray()
        self._budget = budget

    async def exactly(self, n: int) -> bytes:
        if n > self._budget:
            raise LinkAuthError("handshake message over its size limit")
        while len(self._buf) < n:
            chunk = await self._stream.receive_some(max(n - len(self._buf), 1))
            if not chunk:
                raise LinkAuthError("peer closed during the handshake")
            self._buf += chunk
        self._budget -= n
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    @property
    def leftover(self) -> bytes:
        return bytes(self._buf)


async def _expect(reader: _Reader, kind: int) -> None:
    head = await reader.exactly(4)
    if head[:3] != MAGIC:
        raise LinkAuthError(f"not a v2 link handshake (first bytes {head[:3].hex()})")
    if head[3] != kind:
        raise LinkAuthError(f"expected handshake message {kind}, got {head[3]}")


async def accept_secure(
    stream: trio.abc.Stream, creds: Credentials, policy: PeerPolicy, *, auth_timeout: float = float("inf")
) -> tuple[TLSStream, PublicKey, bytes]:
    """The acceptor's side: challenge, verify AUTH against ``policy``, then TLS. Returns (tls, peer key, ticket).

    Raises :class:`LinkAuthError` (after sending the VERDICT) if the dialer is not allowed, or if its AUTH does not
    arrive within ``auth_timeout`` of the challenge. The caller bounds the whole call in time.
    """
    nonce = os.urandom(NONCE_BYTES)
    await stream.send_all(MAGIC + bytes([CHALLENGE]) + nonce)
    reader = _Reader(stream, MAX_PREAUTH_BYTES)
    try:
        with trio.move_on_after(auth_timeout) as waited:
            await _expect(reader, AUTH)
            (cert_len,) = struct.unpack("<H", await reader.exactly(2))
            if cert_len > MAX_CERT_BYTES:
                raise LinkAuthError("certificate over its size limit")
            cert_der = await reader.exactly(cert_len)
            (ticket_len,) = struct.unpack("<H", await reader.exactly(2))
            if ticket_len > MAX_TICKET_BYTES:
                raise LinkAuthError("ticket over its size limit")
            ticket = await reader.exactly(ticket_len)
            signature = await reader.exactly(64)
        if waited.cancelled_caught:
            raise LinkAuthError(f"no AUTH within {auth_timeout:g} s of the challenge")
        if reader.leftover:
            raise LinkAuthError("bytes after AUTH before the verdict")
        peer = key_of_cert(cert_der)
        if not peer.verify(signature, auth_message(nonce, cert_der, ticket, creds.identity.public)):
            raise LinkAuthError("AUTH signature does not verify", Refusal.BAD_SIGNATURE)
        problem = policy.problem(peer, ticket)
        if problem is not None:
            raise LinkAuthError(problem, Refusal.UNKNOWN_KEY)
    except LinkAuthError as exc:
        with trio.move_on_after(1):
            await stream.send_all(MAGIC + bytes([VERDICT, exc.refusal]))
        raise
    await stream.send_all(MAGIC + bytes([VERDICT, Refusal.ACCEPTED]))
    tls = TLSStream(stream, creds.server_context(cert_der), server_side=True)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        raise LinkAuthError(str(exc)) from exc
    client_der = tls.getpeercert(binary_form=True)
    if client_der != cert_der:  # CERT_REQUIRED pinned it; check anyway, it costs nothing
        raise LinkAuthError("TLS client certificate differs from the one AUTH proved")
    return tls, peer, ticket


async def dial_secure(
    stream: trio.abc.Stream, creds: Credentials, expected: PublicKey, ticket: bytes = b""
) -> TLSStream:
    """The dialer's side: answer the challenge, then TLS, checking the acceptor holds ``expected``."""
    if len(ticket) > MAX_TICKET_BYTES:
        raise ProtocolError(f"ticket of {len(ticket)} bytes is over the {MAX_TICKET_BYTES}-byte limit")
    reader = _Reader(stream, 4 + NONCE_BYTES + 5)
    await _expect(reader, CHALLENGE)
    nonce = await reader.exactly(NONCE_BYTES)
    await stream.send_all(encode_auth(creds, nonce, ticket, expected))
    await _expect(reader, VERDICT)
    verdict = (await reader.exactly(1))[0]
    if verdict != Refusal.ACCEPTED:
        name = Refusal(verdict).name if verdict in Refusal._value2member_map_ else str(verdict)
        raise LinkAuthError(f"the peer refused this node's key ({name})", Refusal.UNKNOWN_KEY)
    if reader.leftover:
        raise LinkAuthError("bytes after VERDICT before TLS")
    tls = TLSStream(stream, creds.client_context(), server_side=False)
    try:
        await tls.do_handshake()
    except trio.BrokenResourceError as exc:
        raise LinkAuthError(str(exc)) from exc
    server_der = tls.getpeercert(binary_form=True)
    if server_der is None or key_of_cert(server_der) != expected:
        raise LinkAuthError("the peer's TLS key is not the expected neighbour's")
    return tls
