"""The market's HTTP JSON API (docs/protocol.md § Market API) on the shared HTTP plumbing (kvasir.net.http).

Routes parse bodies into records (bad input → 400, nothing stored), then run one store transaction in a worker
thread, at most ``store.concurrency`` at once (the SQLite store's one connection is never shared across threads at
once). The routes know the store only as :class:`~kvasir.market.server.backend.MarketBackend`.

Every write is signed (kvasir.market.auth): models, manifests and the delegation by the operator's key; claims,
renewals, releases, receipts and credit reads by the node whose ``node_id`` is its key's fingerprint; fraud proofs
by the operator or another holder of the model (kvasir.market.server.fraud).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import attrs
import trio

from kvasir.core.errors import InputError, MarketError
from kvasir.core.identity import Identity, PublicKey
from kvasir.market import auth, replies
from kvasir.market.records import (
    AdmissionRequest,
    ClaimRequest,
    CreditReport,
    FraudRecord,
    Lease,
    LeaseRef,
    LinkVouch,
    ManifestRecord,
    ModelRecord,
    ReceiptBatch,
    sha256_field,
)
from kvasir.market.server.backend import MarketBackend
from kvasir.market.server.fraud import ProofJudge
from kvasir.market.server.gate import ClaimGate, RateLimited
from kvasir.market.server.proofmemo import ProofMemo
from kvasir.market.tickets import MAX_TICKET_S, WindowTicket, issue_ticket
from kvasir.net.http import ApiLimits, HttpConnection, HttpError, HttpRequest, json_bytes, serve_http
from kvasir.relay.grant import EdgeGrant, sign_grant
from kvasir.relay.token import Role
from kvasir.verify.audit import FraudProof, check_proof, proof_id
from kvasir.verify.commit import VerificationError

log = logging.getLogger("kvasir.market")
T = TypeVar("T")

_MODEL = re.compile(r"^/v1/models/([0-9a-f]{64})$")
_MANIFEST = re.compile(r"^/v1/models/([0-9a-f]{64})/manifest$")
MARKET_LIMITS = ApiLimits(max_body_bytes=1024 * 1024, max_connections=512)


class MarketService:
    """The routes. ``identity``: the market's own key (it signs window tickets); ``operator``: the key whose
    signature publishing needs (default: the market's own); ``judge``: re-executes fraud proofs (kvasir.market.
    server.fraud; None: the market acts only on the operator's proofs)."""

    def __init__(
        self,
        store: MarketBackend,
        identity: Identity,
        operator: PublicKey | None = None,
        judge: ProofJudge | None = None,
        gate: ClaimGate | None = None,
    ) -> None:
        self.store = store
        #: Claims' rate limits and new keys' proof of work (security N6).
        self.gate = gate or ClaimGate(identity.public.to_text())
        self.judge = judge
        #: Re-executing a proof loads a window and runs llama.cpp: one at a time, beside the store's threads.
        self.judge_limiter = trio.CapacityLimiter(1)
        self.proofs = ProofMemo()  # rejected proofs and their submitters: none is re-executed twice (N15)
        self.identity = identity
        self.operator = operator or identity.public
        self.limiter = trio.CapacityLimiter(store.concurrency)
        self.nonces = auth.NonceCache()
        self.delegation: str | None = store.get_meta("delegation")
        if self.operator == identity.public:
            self.delegation = auth.sign_delegation(identity, identity.public)

    def _signed(self, request: HttpRequest, *, operator: bool = False, node_id: str | None = None) -> auth.Signed:
        """The request's signer (401 unsigned, stale, replayed or forged); 403 unless it is the operator (or the
        node the body names)."""
        now = self.store.clock()
        signed = auth.verify_request(request.method, request.target, request.headers, request.body, now)
        if operator and signed.key != self.operator:
            raise MarketError(403, "not_operator", f"only the operator {self.operator.fingerprint} may publish")
        if node_id is not None and node_id != signed.node_id:
            raise MarketError(403, "wrong_node", f"node_id {node_id!r} is not the signing key's {signed.node_id}")
        self.nonces.check(signed, now)  # last: a refused request does not use up its nonce
        return signed

    def _ticketed(self, lease: Lease, holder: PublicKey) -> Lease:
        """The lease with a fresh window ticket (its relay edge: the one into the holder's window), and relay edge
        grants for the holder's two edges: downstream on the edge into its window, upstream on the next one."""
        manifest, rank = self.store.window_of(lease.model, lease.start, lease.end)
        not_after = int(min(lease.expires_at, self.store.clock() + MAX_TICKET_S))
        edge = relay_edge_id(lease.model, rank)
        ticket = WindowTicket(lease.model, lease.start, lease.end, holder, not_after, self.identity.public, edge)
        ring = market_ring_id(lease.model, self.identity.public)
        grants = tuple(
            sign_grant(self.identity, EdgeGrant(ring, e, role, holder, int(lease.expires_at), self.identity.public))
            for e, role in (
                (edge, Role.DOWNSTREAM),
                (relay_edge_id(lease.model, (rank + 1) % len(manifest.windows)), Role.UPSTREAM),
            )
        )
        return attrs.evolve(lease, ticket=issue_ticket(self.identity, ticket), grants=grants)

    async def _db(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args), limiter=self.limiter)

    def _operator(self) -> dict[str, Any]:
        return {
            "operator": self.operator.to_text(),
            "market": self.identity.public.to_text(),
            "delegation": self.delegation,
        }

    async def handle(self, http: HttpConnection, request: HttpRequest) -> None:
        extra: tuple[tuple[str, str], ...] = ()
        try:
            status, body = await self._route(request, http.peer)
        except HttpError as exc:  # 404, 405 (with its ``allow``)
            status, body, extra = exc.status, exc.body(), exc.headers
        except RateLimited as exc:  # claims and admissions over their rate (kvasir.market.server.gate)
            status, body = exc.status, HttpError(exc.status, exc.code, str(exc)).body()
            extra = (("retry-after", str(exc.retry_after)),)
        except InputError as exc:
            status, body = 400, HttpError(400, "bad_request", str(exc)).body()
        except MarketError as exc:
            status, body = exc.status, HttpError(exc.status, exc.code, str(exc)).body()
        raw = json_bytes(body)
        await http.send_json_bytes(status, raw, [*self._signed_reply(request, status, raw), *extra])

    def _signed_reply(self, request: HttpRequest, status: int, body: bytes) -> list[tuple[str, str]]:
        """The market's time (nodes sign with their estimate of it, docs/protocol.md § Market time) and the market
        key's signature of the reply, bound to the request's nonce (kvasir.market.replies; security N1)."""
        when = auth.format_market_time(self.store.clock())
        nonce = replies.request_nonce({k.lower(): v for k, v in request.headers})
        sig = replies.sign_reply(self.identity, request.method, request.target, status, nonce, when, body)
        return [(auth.H_MARKET_TIME, when), (replies.H_REPLY_SIG, sig)]

    async def _route(self, request: HttpRequest, peer: str = "?") -> tuple[int, Any]:
        method, path = request.method, request.path
        query = _query(request.target)

        def allow(*methods: str) -> None:
            if method not in methods:
                raise HttpError(405, "method_not_allowed", f"{method} {path}", [("allow", ", ".join(methods))])

        if path == "/v1/operator":
            allow("GET")
            return 200, self._operator()
        if path == "/v1/operator/delegation":
            allow("PUT")
            self._signed(request, operator=True)
            body = _body(request)
            sig = body.get("signature") if isinstance(body, dict) else None
            if not auth.signature_ok(self.operator, auth.delegation_message(self.identity.public), sig):
                raise InputError("delegation: 'signature' is not the operator's signature of this market's key")
            assert isinstance(sig, str)
            await self._db(self.store.set_meta, "delegation", sig)
            self.delegation = sig
            return 200, self._operator()
        if path == "/v1/models":
            allow("GET")
            return 200, {"models": [m.to_wire() for m in await self._db(self.store.models)]}
        if m := _MODEL.match(path):
            allow("GET", "PUT")
            if method == "GET":
                return 200, (await self._db(self.store.model, m.group(1))).to_wire()
            self._signed(request, operator=True)
            model = ModelRecord.from_wire(_body(request))
            if model.sha256 != m.group(1):
                raise InputError("model: 'sha256' differs from the one in the path")
            if not model.signed_by(self.operator):
                raise InputError("model: 'signature' is not the operator's signature of this record")
            new = await self._db(self.store.put_model, model)
            return (201 if new else 200), model.to_wire()
        if m := _MANIFEST.match(path):
            allow("GET", "PUT")
            if method == "GET":
                return 200, (await self._db(self.store.manifest, m.group(1))).to_wire()
            self._signed(request, operator=True)
            manifest = ManifestRecord.from_wire(_body(request), m.group(1))
            await self._db(self.store.put_manifest, manifest)
            return 200, manifest.to_wire()
        if path == "/v1/coverage":
            allow("GET")
            only = sha256_field(query, "model", "query") if "model" in query else None
            return 200, await self._db(self.store.coverage, only)
        if path == "/v1/demand":
            if method == "POST":  # demand is settled client traffic, never a holder's report (security N7)
                raise MarketError(410, "gone", "demand derives from settled client traffic; nobody reports it")
            allow("GET")
            return 200, await self._db(self.store.demand)
        if path == "/v1/accounts":
            allow("GET")
            return 200, await self._db(self.store.account, _key_query(query))
        if path == "/v1/claims":
            allow("POST")
            req = ClaimRequest.from_wire(_body(request))
            signed = self._signed(request, node_id=req.node_id)
            self.gate.count_claim(signed.key.to_text(), peer, self.store.clock())
            if self.gate.work_bits:
                self.gate.require_admission(await self._db(self.store.admitted, signed.key.to_text()))
            lease = await self._db(self.store.claim, req, signed.key.to_text())
            return 200, (await self._db(self._ticketed, lease, signed.key)).to_wire()
        if path == "/v1/claims/renew":
            allow("POST")
            req = ClaimRequest.from_wire(_body(request), renew=True, where="renew")
            signed = self._signed(request, node_id=req.node_id)
            lease = await self._db(self.store.renew, req, signed.key.to_text())
            return 200, (await self._db(self._ticketed, lease, signed.key)).to_wire()
        if path == "/v1/claims/release":
            allow("POST")
            ref = LeaseRef.from_wire(_body(request))
            signed = self._signed(request, node_id=ref.node_id)
            await self._db(self.store.release, ref, signed.key.to_text())
            return 200, {"released": True}
        if path == "/v1/vouch":
            allow("POST")
            vouch = LinkVouch.from_wire(_body(request))
            signed = self._signed(request, node_id=vouch.node_id)
            return 200, await self._db(self.store.vouch, vouch, signed.key.to_text())
        if path == "/v1/admission":
            allow("GET", "POST")
            if method == "GET":
                return 200, self.gate.info()
            admission = AdmissionRequest.from_wire(_body(request))
            signed = self._signed(request, node_id=admission.node_id)
            self.gate.count_admission(peer, self.store.clock())
            self.gate.check_work(signed.key.to_text(), admission.nonce)
            await self._db(self.store.admit, signed.key.to_text(), self.gate.work_bits)
            return 200, {"admitted": True, **self.gate.info()}
        if path == "/v1/receipts":
            allow("POST")
            batch = ReceiptBatch.from_wire(_body(request))
            signed = self._signed(request, node_id=batch.node_id)
            market = self.identity.public.to_text()
            return 200, await self._db(self.store.add_receipts, batch, signed.key.to_text(), market)
        if path == "/v1/credits":
            allow("POST")
            credit = CreditReport.from_wire(_body(request))
            signed = self._signed(request, node_id=credit.node_id)
            return 200, await self._db(self.store.credit, credit, signed.key.to_text())
        if path == "/v1/fraud":
            allow("GET", "POST")
            if method == "GET":
                return 200, await self._db(self.store.frauds)
            signed = self._signed(request)
            return 200, await self._fraud(FraudProof.from_wire(_body(request)), signed)
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

    async def _fraud(self, proof: FraudProof, signed: auth.Signed) -> dict[str, Any]:
        """Check a fraud proof, then have the store withdraw the suspect's credit and claim (docs/market.md § Fraud)."""
        try:
            check_proof(proof)
        except VerificationError as exc:
            raise MarketError(422, "bad_proof", f"fraud proof: {exc}") from None
        s = proof.suspect
        suspect = s.key.fingerprint
        await self._db(self.store.window_of, s.model_sha256, s.start, s.end)  # 404: not a window of this market
        operator = signed.key == self.operator
        if not operator and (
            signed.node_id == suspect or not await self._db(self.store.holds_lease, signed.node_id, s.model_sha256)
        ):
            raise MarketError(403, "not_allowed", "fraud proofs come from the operator or another holder of the model")
        verdict = None
        pid = proof_id(proof)
        if self.judge is not None:
            async with self.judge_limiter:  # the memo is read in turn: copies queued behind a rejection are not rerun
                if self.proofs.rejected(proof, pid):
                    raise MarketError(422, "proof_rejected", f"already judged: node {suspect} computed these steps")
                wait = 0.0 if operator else self.proofs.retry_after(signed.node_id, self.store.clock())
                if wait > 0:
                    raise MarketError(
                        429,
                        "too_many_rejected_proofs",
                        f"this key's recent proofs were rejected; the market judges its next one in {wait:.0f} s",
                    )
                verdict = await trio.to_thread.run_sync(self.judge, proof)
                if verdict is False:
                    self.proofs.reject(proof, pid, signed.node_id, self.store.clock())
        if verdict is False:
            raise MarketError(422, "proof_rejected", f"re-executed: node {suspect}'s window computes what it signed")
        if verdict is None and not operator:
            raise MarketError(422, "cannot_judge", "this market cannot re-execute that window; the operator can submit")
        record = FraudRecord(
            proof_id=pid,
            node_id=suspect,
            model=s.model_sha256,
            start=s.start,
            end=s.end,
            request=s.request,
            step=proof.step,
            submitter=signed.node_id,
            verdict="reexecuted" if verdict else "operator",
        )
        result = await self._db(self.store.withdraw, record)
        log.warning(
            "fraud: node %s, layers %d:%d: credit withdrawn (proof %s)",
            suspect,
            s.start,
            s.end,
            record.proof_id,
        )
        return result


def _body(request: HttpRequest) -> Any:
    try:
        return json.loads(request.body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"request body is not JSON ({exc})") from None
    except RecursionError:
        raise InputError("request body is nested too deeply") from None


def market_ring_id(model: str, market: PublicKey) -> str:
    """The ring id in a market ring's edge grants: one ring per model and market. The market's key is in it, so two
    markets serving one model through one relay never name the same ring (security N14)."""
    return hashlib.sha256(f"kvasir-market-ring/v2\n{market.to_text()}\n{model}".encode()).hexdigest()


def relay_edge_id(model: str, rank: int) -> str:
    """The relay edge into window ``rank`` of a market ring: the model in it, so rings of two models never share
    an edge id on one relay."""
    return f"{model[:12]}-e{rank}"


def machine_identity() -> Identity:
    """This machine's node identity, where ``kvasir id`` keeps it (the per-user data directory)."""
    import platformdirs

    from kvasir.core.identity import IDENTITY_FILE, load_or_create_identity

    return load_or_create_identity(Path(platformdirs.user_data_dir("kvasir", appauthor=False)) / IDENTITY_FILE)


def _key_query(query: dict[str, str]) -> str:
    key = query.get("key", "")
    PublicKey.from_text(key)  # InputError: 400
    return key


def _query(target: str) -> dict[str, str]:
    _, _, q = target.partition("?")
    return dict(parse_qsl(q))


async def serve_market(
    db: Path,
    host: str,
    port: int,
    *,
    store: MarketBackend | None = None,
    identity: Identity | None = None,
    operator: PublicKey | None = None,
    tls: ssl.SSLContext | None = None,
    judge: ProofJudge | None = None,
    gate: Callable[[Identity], ClaimGate] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the market on ``host:port`` (0: any free port) with its state in ``db`` (SQLite) or in ``store`` (any
    engine; the caller closes it); ``started(bound_port)``.

    ``identity``: the market's key (default: this machine's node identity); ``operator``: the publisher's key
    (default: the market's own); ``tls``: serve HTTPS (kvasir.util.tls.server_context); ``judge``: re-executes
    fraud proofs (kvasir.market.server.fraud.StageJudge); ``gate``: builds the claims' rate limits and admission
    from the market's identity (default: :class:`~kvasir.market.server.gate.ClaimGate`'s defaults, no work asked).
    """
    if identity is None:
        identity = await trio.to_thread.run_sync(machine_identity)
    own = store is None
    if store is None:
        from kvasir.market.server.store import MarketStore  # the default engine: SQLite at ``db``

        store = await trio.to_thread.run_sync(MarketStore, db)
    service = MarketService(store, identity, operator, judge, None if gate is None else gate(identity))
    try:
        await serve_http(
            service.handle, host, port, limits=MARKET_LIMITS, name="market", tls=tls, task_status=task_status
        )
    finally:
        if own:
            store.close()
