"""A client of the market's HTTP API (httpx, async under trio). Error replies become :class:`MarketError` (404,
409) or :class:`InputError` (400); an unreachable market is a :class:`MarketError` with status 0."""

from __future__ import annotations

from typing import Any

import httpx

from kvasir.errors import InputError, MarketError
from kvasir.market.records import (
    ClaimRequest,
    CoverageEntry,
    CreditReport,
    DemandReport,
    Lease,
    LeaseRef,
    ManifestRecord,
    ModelRecord,
    coverage_from_wire,
)


def _raise_for(r: httpx.Response) -> Any:
    try:
        body = r.json()
    except ValueError:
        body = None
    if r.status_code < 300:
        return body
    err = body.get("error", {}) if isinstance(body, dict) else {}
    code = str(err.get("code", "error"))
    message = str(err.get("message", r.text[:200]))
    if r.status_code == 400:
        raise InputError(f"market: {message}")
    raise MarketError(r.status_code, code, f"market: {message}")


class MarketClient:
    def __init__(self, url: str, *, timeout: float = 10.0, client: httpx.AsyncClient | None = None) -> None:
        self.url = url.rstrip("/")
        self.http = client or httpx.AsyncClient(timeout=timeout)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> MarketClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None) -> Any:
        try:
            r = await self.http.request(method, self.url + path, json=body, params=params)
        except httpx.HTTPError as exc:
            raise MarketError(0, "unreachable", f"market {self.url}: {type(exc).__name__}: {exc}") from None
        return _raise_for(r)

    async def put_model(self, model: ModelRecord) -> None:
        await self._call("PUT", f"/v1/models/{model.sha256}", model.to_wire())

    async def model(self, sha256: str) -> ModelRecord:
        return ModelRecord.from_wire(await self._call("GET", f"/v1/models/{sha256}"))

    async def put_manifest(self, manifest: ManifestRecord) -> None:
        await self._call("PUT", f"/v1/models/{manifest.model}/manifest", manifest.to_wire())

    async def coverage(self, model: str | None = None) -> list[CoverageEntry]:
        params = {"model": model} if model else None
        return coverage_from_wire(await self._call("GET", "/v1/coverage", params=params))

    async def claim(self, req: ClaimRequest) -> Lease:
        return Lease.from_wire(await self._call("POST", "/v1/claims", req.to_wire()))

    async def renew(self, req: ClaimRequest) -> Lease:
        return Lease.from_wire(await self._call("POST", "/v1/claims/renew", req.to_wire()))

    async def release(self, ref: LeaseRef) -> None:
        await self._call("POST", "/v1/claims/release", ref.to_wire())

    async def demand(self, report: DemandReport) -> None:
        await self._call("POST", "/v1/demand", report.to_wire())

    async def credit(self, report: CreditReport) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", "/v1/credits", report.to_wire())
        return result

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/v1/status")
        return result
