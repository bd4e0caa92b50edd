"""A client of the market's HTTP API (httpx, async under trio). Error replies become :class:`MarketError` (404,
409) or :class:`InputError` (400); an unreachable market is a :class:`MarketError` with status 0.

Writes are signed with the client's identity (kvasir.market.auth) at its estimate of the market's time, learned
from every reply's ``x-kvasir-market-time`` (docs/protocol.md § Market time); a write refused as ``stale_request``
is signed again once with the time that refusal carried. A reply larger than ``max_reply_bytes`` is refused unread.

Every request carries a fresh reply nonce; once ``reply_key`` is set (a self-enrolled node sets it to the market key
the pinned operator delegated to), a reply not signed by that key over that nonce (kvasir.market.replies) is a
:class:`MarketError` ``bad_reply`` and nothing in it is used, its market time included (security N1).
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import urlencode

import httpx

from kvasir.core.errors import InputError, MarketError
from kvasir.core.identity import Identity, PublicKey
from kvasir.market import auth, replies
from kvasir.market.records import (
    AdmissionRequest,
    ClaimRequest,
    CoverageEntry,
    CreditReport,
    Lease,
    LeaseRef,
    LinkVouch,
    ManifestRecord,
    ModelRecord,
    ReceiptBatch,
    coverage_from_wire,
)
from kvasir.util.tls import client_context, tls_failure

log = logging.getLogger("kvasir.market")

#: A skew between the market's clock and this host's beyond this (and each change beyond it) is logged.
SKEW_LOG_S = 5.0
#: Largest reply read from a market (a coverage map of MAX_MODELS models fits well within it).
MAX_REPLY_BYTES = 16 * 1024 * 1024


def is_transient(exc: Exception) -> bool:
    """Whether a failed market call says nothing about the window or the lease: the market is unreachable, busy or
    failing, or the reply was not the market's (``bad_reply``: retry later), as opposed to an answer (404, 409,
    403, a bad record)."""
    if not isinstance(exc, MarketError):
        return False
    return exc.code in ("unreachable", "stale_request", "bad_reply") or exc.status == 429 or exc.status >= 500


def _error_code(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else None


def _raise_for(status: int, raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        body = None
    if status < 300:
        return body
    err = body.get("error", {}) if isinstance(body, dict) else {}
    code = str(err.get("code", "error"))
    message = str(err.get("message", raw[:200].decode(errors="replace")))
    if status == 400:
        raise InputError(f"market: {message}")
    raise MarketError(status, code, f"market: {message}")


class _Reply(NamedTuple):
    """One reply as it came (in-process only): checked before anything in it is used."""

    status: int
    raw: bytes
    market_time: str | None
    signature: str | None
    nonce: str
    #: This host's monotonic time about when the market replied (halfway through the round trip).
    mono: float


class MarketClient:
    """``identity``: the key that signs writes (a node's, or the operator's for publishing); ``tls``: how an https
    market is verified (default: the system's CAs; kvasir.util.tls.client_context adds a ``--market-ca`` bundle)."""

    def __init__(
        self,
        url: str,
        *,
        identity: Identity | None = None,
        timeout: float = 10.0,
        client: httpx.AsyncClient | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        clock: Callable[[], float] = time.time,
        tls: ssl.SSLContext | None = None,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url.rstrip("/")
        self.identity = identity
        self.http = client or httpx.AsyncClient(timeout=timeout, verify=tls if tls is not None else client_context())
        self.max_reply_bytes = max_reply_bytes
        #: This host's clock: what requests are signed with until the market's time is known.
        self.clock = clock
        self.mono = mono
        #: The market key every reply must be signed by (None: replies are not checked; a node sets it once it
        #: has checked the operator's delegation to that key, kvasir.market.agent.trust).
        self.reply_key: PublicKey | None = None
        #: The market's time as last seen (None until a reply carried it).
        self.seen: auth.MarketTime | None = None
        self._skew_logged = 0.0

    def market_time(self) -> float:
        """The client's estimate of the market's clock (``clock()`` until a reply said it)."""
        seen = self.seen
        return self.clock() if seen is None else seen.at(self.mono())

    def _report_skew(self) -> None:
        """Say (once per change of more than SKEW_LOG_S) how far the market's clock is from this host's."""
        skew = self.skew()
        if skew is None or abs(skew - self._skew_logged) <= SKEW_LOG_S:
            return
        self._skew_logged = skew
        log.warning(
            "market %s: its clock is %+.1f s from this host's; requests are signed in the market's time",
            self.url,
            skew,
        )

    def skew(self) -> float | None:
        """How far the market's clock is ahead of this host's (seconds), as last seen; None before any reply."""
        return None if self.seen is None else self.market_time() - self.clock()

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> MarketClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict[str, str] | None = None,
        *,
        key_in_reply: Callable[[Any], PublicKey] | None = None,
    ) -> Any:
        """The reply's JSON, once its signature checked out (when this client verifies); ``key_in_reply`` names the
        key a 200 reply must be signed by, from the reply itself (``/v1/operator``: the delegated market key)."""
        content = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        headers = {"accept-encoding": "identity"} | ({"content-type": "application/json"} if body is not None else {})
        if method != "GET" and self.identity is None:
            raise InputError(f"market: {method} {path} must be signed; this client has no identity")
        target = path + ("?" + urlencode(params) if params else "")
        before = self.seen
        reply = await self._send(method, target, content, headers)
        self._accept(method, target, reply, key_in_reply)
        if reply.status == 401 and self.seen != before and _error_code(reply.raw) == "stale_request":
            # Our estimate of the market's time was off (its clock or ours stepped, or first contact): the refusal
            # said the market's time, so sign again once (a fresh nonce: nothing is replayed).
            reply = await self._send(method, target, content, headers)
            self._accept(method, target, reply, key_in_reply)
        return _raise_for(reply.status, reply.raw)

    def _accept(self, method: str, target: str, reply: _Reply, key_in_reply: Callable[[Any], PublicKey] | None) -> None:
        """Check the reply's signature (MarketError ``bad_reply`` if it is not the market's: nothing in it is
        used), then learn the market's time from it."""
        key = self.reply_key
        if key_in_reply is not None and reply.status == 200:
            key = key_in_reply(_raise_for(reply.status, reply.raw))
        if key is not None:
            replies.check_reply(
                key, method, target, reply.status, reply.nonce, reply.market_time, reply.raw, reply.signature
            )
        seen = auth.parse_market_time(reply.market_time)
        if seen is not None:  # the market's clock when it replied: about halfway through the round trip
            self.seen = auth.MarketTime(seen, reply.mono)
            self._report_skew()

    async def _send(self, method: str, target: str, content: bytes, headers: dict[str, str]) -> _Reply:
        nonce = replies.new_nonce()
        headers = headers | {replies.H_REPLY_NONCE: nonce}
        if method != "GET":
            assert self.identity is not None
            headers = headers | auth.sign_request(self.identity, method, target, content, self.market_time())
        try:
            sent = self.mono()
            async with self.http.stream(method, self.url + target, content=content or None, headers=headers) as r:
                mono = (sent + self.mono()) / 2
                declared = r.headers.get("content-length", "0")
                if declared.isdigit() and int(declared) > self.max_reply_bytes:
                    raise MarketError(r.status_code, "reply_too_large", f"market {self.url}: reply of {declared} bytes")
                raw = bytearray()
                async for chunk in r.aiter_raw():
                    raw += chunk
                    if len(raw) > self.max_reply_bytes:
                        raise MarketError(r.status_code, "reply_too_large", f"market {self.url}: reply too large")
                return _Reply(
                    r.status_code,
                    bytes(raw),
                    r.headers.get(auth.H_MARKET_TIME),
                    r.headers.get(replies.H_REPLY_SIG),
                    nonce,
                    mono,
                )
        except httpx.HTTPError as exc:
            why = tls_failure(exc)
            if why is not None:  # a wrong or missing CA: say so, and how to fix it
                unknown_ca = any(w in why for w in ("issuer", "self-signed", "self signed"))
                hint = "; pass --market-ca with the CA bundle that signed it" if unknown_ca else ""
                raise MarketError(0, "tls", f"market {self.url}: {why}{hint}") from None
            raise MarketError(0, "unreachable", f"market {self.url}: {type(exc).__name__}: {exc}") from None

    async def operator(self, key_in_reply: Callable[[Any], PublicKey] | None = None) -> dict[str, Any]:
        """The market's keys: ``operator`` (signs records), ``market`` (signs tickets and replies) and the
        delegation. ``key_in_reply``: the key the reply must be signed by, read from the reply (by the caller, who
        checks the delegation against the operator key it trusts)."""
        result = await self._call("GET", "/v1/operator", key_in_reply=key_in_reply)
        if not isinstance(result, dict):
            raise InputError("market: /v1/operator is not an object")
        return result

    async def put_delegation(self, signature: str) -> None:
        await self._call("PUT", "/v1/operator/delegation", {"signature": signature})

    async def put_model(self, model: ModelRecord) -> None:
        await self._call("PUT", f"/v1/models/{model.sha256}", model.to_wire())

    async def model(self, sha256: str) -> ModelRecord:
        return ModelRecord.from_wire(await self._call("GET", f"/v1/models/{sha256}"))

    async def put_manifest(self, manifest: ManifestRecord) -> None:
        await self._call("PUT", f"/v1/models/{manifest.model}/manifest", manifest.to_wire())

    async def coverage(self, model: str | None = None, skipped: list[str] | None = None) -> list[CoverageEntry]:
        params = {"model": model} if model else None
        return coverage_from_wire(await self._call("GET", "/v1/coverage", params=params), skipped)

    async def claim(self, req: ClaimRequest) -> Lease:
        return Lease.from_wire(await self._call("POST", "/v1/claims", req.to_wire()))

    async def renew(self, req: ClaimRequest) -> Lease:
        return Lease.from_wire(await self._call("POST", "/v1/claims/renew", req.to_wire()))

    async def release(self, ref: LeaseRef) -> None:
        await self._call("POST", "/v1/claims/release", ref.to_wire())

    async def vouch(self, vouch: LinkVouch) -> dict[str, Any]:
        """Vouch for the link from the predecessor's holder (``POST /v1/vouch``)."""
        result: dict[str, Any] = await self._call("POST", "/v1/vouch", vouch.to_wire())
        return result

    async def admission(self) -> dict[str, Any]:
        """What the market asks of a new key (``GET /v1/admission``: ``market``, ``work_bits``)."""
        result = await self._call("GET", "/v1/admission")
        if not isinstance(result, dict):
            raise InputError("market: /v1/admission is not an object")
        return result

    async def admit(self, request: AdmissionRequest) -> None:
        await self._call("POST", "/v1/admission", request.to_wire())

    async def receipts(self, batch: ReceiptBatch) -> dict[str, Any]:
        """Send a witness's receipts: the market's reply (how many were new, how many requests it settled)."""
        result: dict[str, Any] = await self._call("POST", "/v1/receipts", batch.to_wire())
        return result

    async def credit(self, report: CreditReport) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", "/v1/credits", report.to_wire())
        return result

    async def fraud(self, proof: Any) -> dict[str, Any]:
        """Submit a fraud proof's wire form (``POST /v1/fraud``): the withdrawal the market wrote down."""
        result: dict[str, Any] = await self._call("POST", "/v1/fraud", proof)
        return result

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/v1/status")
        return result
