"""TLS for Kvasir's HTTP services (market, model seeder) and their clients (market client, window fetcher).

A server loads a certificate chain and key (``--tls-cert``/``--tls-key``, as ``kvasir relay`` does). A client
verifies the server with the system's CAs plus, where given, an extra PEM bundle (``--market-ca``): an operator
with a private or self-signed CA passes it, and public sources (a Hugging Face URL) still verify. A certificate
that does not verify is reported in one line that says how to fix it, never as a traceback.
"""

from __future__ import annotations

import functools
import ssl
from pathlib import Path

from kvasir.core.errors import InputError


def server_context(cert: Path | str, key: Path | str) -> ssl.SSLContext:
    """A server-side context for ``cert`` (PEM chain) and ``key`` (PEM); one-line InputError if they do not load."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise InputError(f"cannot load the TLS certificate {cert} with key {key}: {exc}") from None
    return context


def client_context(ca: Path | str | None = None) -> ssl.SSLContext:
    """A client context that verifies host names against the system's CAs and, if given, the PEM bundle ``ca``.

    Where the system has no CA store (some minimal containers), certifi's bundle (httpx's own default) stands in.
    Without ``ca`` one context is shared by every client of the process (loading the CA store takes ~50 ms).
    """
    if ca is None:
        return _system_context()
    context = _new_context()
    try:
        context.load_verify_locations(cafile=str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise InputError(f"cannot load the CA bundle {ca}: {exc}") from None
    return context


@functools.cache
def _system_context() -> ssl.SSLContext:
    return _new_context()


def _new_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    if not context.cert_store_stats().get("x509_ca"):
        try:
            import certifi

            context.load_verify_locations(certifi.where())
        except (ImportError, OSError, ssl.SSLError):
            pass
    return context


def tls_failure(exc: BaseException) -> str | None:
    """If ``exc`` (or what caused it) is a failed certificate check, a one-line reason; else None."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted ({cur.verify_message or cur.reason or cur})"
        if isinstance(cur, ssl.SSLError):
            return f"TLS failed ({cur.reason or cur})"
        cur = cur.__cause__ or cur.__context__
    return None
