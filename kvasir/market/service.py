"""The market's HTTP JSON API (docs/protocol.md § Market API) on the shared HTTP plumbing (kvasir.net.http).

Routes parse bodies into records (bad input → 400, nothing stored), then run one store transaction in a worker
thread through a limiter of one (sqlite3 blocks; the one connection is never shared across threads at once).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import trio

from kvasir.errors import InputError, MarketError
from kvasir.market.records import (
    ClaimRequest,
    CreditReport,
    DemandReport,
    LeaseRef,
    ManifestRecord,
    ModelRecord,
    sha256_field,
)
from kvasir.market.store import MarketStore
from kvasir.net.http import ApiLimits, HttpConnection, HttpError, HttpRequest, serve_http

log = logging.getLogger("kvasir.market")
T = TypeVar("T")

_MODEL = re.compile(r"^/v1/models/([0-9a-f]{64})$")
_MANIFEST = re.compile(r"^/v1/models/([0-9a-f]{64})/manifest$")
MARKET_LIMITS = ApiLimits(max_body_bytes=1024 * 1024, max_connections=512)


class MarketService:
    def __init__(self, store: MarketStore) -> None:
        self.store = store
        self.limiter = trio.CapacityLimiter(1)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args), limiter=self.limiter)

    async def handle(self, http: HttpConnection, request: HttpRequest) -> None:
        try:
            status, body = await self._route(request)
        except InputError as exc:
            raise HttpError(400, "bad_request", str(exc)) from None
        except MarketError as exc:
            raise HttpError(exc.status, exc.code, str(exc)) from None
        await http.send_json(status, body)

    async def _route(self, request: HttpRequest) -> tuple[int, Any]:
        method, path = request.method, request.path
        query = _query(request.target)

        def allow(*methods: str) -> None:
            if method not in methods:
                raise HttpError(405, "method_not_allowed", f"{method} {path}", [("allow", ", ".join(methods))])

        if path == "/v1/models":
            allow("GET")
            return 200, {"models": [m.to_wire() for m in await self._db(self.store.models)]}
        if m := _MODEL.match(path):
            allow("GET", "PUT")
            if method == "GET":
                return 200, (await self._db(self.store.model, m.group(1))).to_wire()
            model = ModelRecord.from_wire(_body(request))
            if model.sha256 != m.group(1):
                raise InputError("model: 'sha256' differs from the one in the path")
            new = await self._db(self.store.put_model, model)
            return (201 if new else 200), model.to_wire()
        if m := _MANIFEST.match(path):
            allow("GET", "PUT")
            if method == "GET":
                return 200, (await self._db(self.store.manifest, m.group(1))).to_wire()
            manifest = ManifestRecord.from_wire(_body(request), m.group(1))
            await self._db(self.store.put_manifest, manifest)
            return 200, manifest.to_wire()
        if path == "/v1/coverage":
            allow("GET")
            only = sha256_field(query, "model", "query") if "model" in query else None
            return 200, await self._db(self.store.coverage, only)
        if path == "/v1/demand":
            allow("GET", "POST")
            if method == "POST":
                await self._db(self.store.add_demand, DemandReport.from_wire(_body(request)))
            return 200, await self._db(self.store.demand)
        if path == "/v1/claims":
            allow("POST")
            return 200, (await self._db(self.store.claim, ClaimRequest.from_wire(_body(request)))).to_wire()
        if path == "/v1/claims/renew":
            allow("POST")
            req = ClaimRequest.from_wire(_body(request), renew=True, where="renew")
            return 200, (await self._db(self.store.renew, req)).to_wire()
        if path == "/v1/claims/release":
            allow("POST")
            await self._db(self.store.release, LeaseRef.from_wire(_body(request)))
            return 200, {"released": True}
        if path == "/v1/credits":
            allow("POST")
            return 200, await self._db(self.store.credit, CreditReport.from_wire(_body(request)))
        if path == "/v1/ledger":
            allow("GET")
            return 200, await self._db(self.store.ledger)
        if path == "/v1/status":
            allow("GET")
            return 200, {
                "coverage": await self._db(self.store.coverage, None),
                "demand": await self._db(self.store.demand),
                "ledger": await self._db(self.store.ledger),
            }
        raise HttpError(404, "not_found", f"unknown route {method} {path}")


def _body(request: HttpRequest) -> Any:
    try:
        return json.loads(request.body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"request body is not JSON ({exc})") from None


def _query(target: str) -> dict[str, str]:
    _, _, q = target.partition("?")
    return dict(parse_qsl(q))


async def serve_market(
    db: Path,
    host: str,
    port: int,
    *,
    store: MarketStore | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the market on ``host:port`` (0: any free port) with its state in ``db``; ``started(bound_port)``."""
    own = store is None
    store = store if store is not None else await trio.to_thread.run_sync(MarketStore, db)
    service = MarketService(store)
    try:
        await serve_http(service.handle, host, port, limits=MARKET_LIMITS, name="market", task_status=task_status)
    finally:
        if own:
            store.close()
