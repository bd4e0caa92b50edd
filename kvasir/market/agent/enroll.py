"""Self-enrollment: an empty node claims a window from the market, downloads only it, joins the ring and earns.

One :class:`Enrollment` owns one nursery (``run``). The loop:

1. poll the coverage map; :func:`~kvasir.market.agent.choice.choose_window` picks the best reward per byte among
   uncovered windows that fit the memory budget (ties: a seeded random draw);
2. claim it (state ``fetching``, a lease); a lost race (409) means choose again. Claiming *before* the download
   means two nodes never download the same window at once, and a node that dies mid-download loses the window
   when its lease runs out;
3. download the window's stage (HTTP Range, verified against the market's window hash), load it, start the
   :class:`~kvasir.ring.node.Node` and renew the lease as ``serving`` with its link endpoint;
4. while serving: renew the lease every third of its time, follow the coverage map (the node's manifest is
   rebuilt from it, so a replacement neighbour is dialled at its new address), report demand and credit the
   tokens served (tokens × layers) to the ledger;
5. a lost lease (expired and taken by another node, or a window gone from the manifest) stops the node and goes
   back to 1; shutdown fails in-flight requests, credits what is left and releases the lease.

Timeouts live in the child tasks that wait (every market call is bounded by the client's timeout).

Trust: the node signs every market write with its identity (its id is the key's fingerprint) and loads nothing a
model record names unless the record carries the pinned operator's signature (``market_key``; without one, the
operator key the market names is trusted on first use and its fingerprint logged). A failure while holding a
window (no source, a bad record, any KvasirError) releases the lease and avoids that window for a while.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from kvasir.core.identity import Identity, PublicKey
from kvasir.errors import InputError, KvasirError, MarketError
from kvasir.market import auth
from kvasir.market.agent.choice import choose_window
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import (
    MAX_RECEIPTS,
    MAX_REPORT_REQUESTS,
    MAX_REPORT_TOKENS,
    ClaimRequest,
    CoverageEntry,
    CreditReport,
    DemandReport,
    Lease,
    LeaseRef,
    ModelRecord,
    Receipt,
    ReceiptBatch,
)
from kvasir.market.tickets import TicketPolicy
from kvasir.relay.ringlink import market_grant_connector, secret_connector
from kvasir.ring.edges import RelayConnect
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.record import NodeRecorder
from kvasir.ring.status import MarketWindow
from kvasir.shard.fetch import FetchResult, fetch_window, verify_stage
from kvasir.stage.engine import Stage, StageConfig
from kvasir.util.addr import format_hostport, parse_hostport
from kvasir.util.progress import byte_bar
from kvasir.util.tls import client_context
from kvasir.verify.probe import check_probe

log = logging.getLogger("kvasir.enroll")

#: Address of a window nobody serves yet (the node's dial loop waits on it).
UNKNOWN_HOST, UNKNOWN_PORT = "0.0.0.0", 0
#: How long a window that failed (no source, a bad record) is left to others.
AVOID_S = 120.0
#: Receipts kept for the market at most (while it cannot be reached), and how often to re-report unconfirmed work.
MAX_PENDING_RECEIPTS = 4096
CREDIT_RETRY_S = 5.0


@attrs.frozen
class EnrollConfig:
    market_url: str
    budget_bytes: int
    stage_dir: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    #: The host the market shows neighbours (default: the listen host).
    advertise_host: str | None = None
    lease_s: float = 30.0
    poll_s: float = 2.0
    seed: int | None = None
    relay: str | None = None
    ring_secret: str | None = None
    #: The key that signs this node's claims and reports; its fingerprint is the node id.
    identity: Identity = attrs.field(factory=Identity.generate)
    #: The operator key records must be signed by (None: trust the market's on first use, and log it).
    market_key: PublicKey | None = None
    #: Whether neighbours and sources may be private or loopback addresses (None: only if the market's is).
    allow_private: bool | None = None
    #: A PEM bundle of CAs trusted besides the system's, for an https market and https sources.
    market_ca: Path | None = None
    #: Stage settings and node settings (everything but the manifest and rank).
    stage_config: Callable[[Path], StageConfig] = StageConfig
    node_options: dict[str, Any] = attrs.field(factory=dict)
    #: ``kvasir node --record DIR``: signed receipts of every request on the window held (kvasir.ring.record).
    record_dir: Path | None = None
    record_keep: int = 1 << 30

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def host_ok(self, host: str) -> bool:
        """Whether the node may dial or fetch from ``host`` (what the market says must not aim it at the inside of
        its own network, unless the market itself lives there)."""
        allow = self.allow_private
        if allow is None:
            allow = not is_public_host(httpx.URL(self.market_url).host)
        return allow or is_public_host(host)

    @property
    def report_s(self) -> float:
        return max(0.2, min(self.lease_s / 3, 5.0))


def is_public_host(host: str) -> bool:
    """A global IP address, or a DNS name other than localhost and .local/.internal/one-label names (pure: a name
    is not resolved, so a public name that resolves inside is not caught here)."""
    host = host.strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        pass
    return "." in host and not host.endswith((".local", ".internal", ".localhost", ".lan", ".home.arpa"))


def manifest_from_coverage(
    windows: Sequence[CoverageEntry],
    rank: int,
    host: str,
    port: int,
    *,
    name: str = "model",
    relay: str | None = None,
    secret: str | None = None,
    host_ok: Callable[[str], bool] = lambda _: True,
    own_key: PublicKey | None = None,
) -> Manifest:
    """The rank manifest a node runs with, built from its model's coverage map (pure).

    Its own rank gets ``host:port``; other ranks the endpoint of their serving holder, or an unknown address
    (0.0.0.0:0) the node waits on until a holder appears. An endpoint whose host ``host_ok`` refuses, or that does
    not parse, counts as unknown. Ranks carry their holder's key when the map shows it (``own_key`` for this
    node's own rank), which the links pin (protocol v2).
    """
    ranks = []
    for w in sorted(windows, key=lambda e: e.rank):
        link = "relay" if relay is not None else "direct"
        h, p = UNKNOWN_HOST, UNKNOWN_PORT
        key = None
        if w.serving and w.holder_key is not None:
            try:
                key = PublicKey.from_text(w.holder_key)
            except InputError:
                key = None
        if w.rank == rank:
            h, p, key = host, port, own_key
        elif w.serving and w.endpoint is not None and not w.endpoint.startswith("relay:"):
            try:
                eh, ep = parse_hostport(w.endpoint, what="endpoint")
            except InputError:
                eh, ep = UNKNOWN_HOST, UNKNOWN_PORT
            if host_ok(eh):
                h, p = eh, ep
        ranks.append(RankEntry(w.rank, w.start, w.end, h, p, None, link, key))
    first = windows[0]
    return Manifest(
        model_sha256=first.model,
        n_layers=max(w.end for w in windows),
        ranks=tuple(ranks),
        model_name=name,
        secret=secret,
        relay=relay,
    )


def exit_rank(entry_rank: object, size: int) -> int | None:
    """The rank that witnesses a request besides its entry (pure): the last rank, which samples every token, or
    rank 0 (which embeds every token) for a request that entered at the last rank; None in a one-window ring."""
    if not isinstance(entry_rank, int) or size < 2 or not 0 <= entry_rank < size:
        return None
    return size - 1 if entry_rank != size - 1 else 0


class LeaseLost(KvasirError):
    """The node no longer holds its window."""


class Enrollment:
    """One self-enrolling node. ``run`` until cancelled; ``close`` on shutdown."""

    def __init__(
        self,
        config: EnrollConfig,
        *,
        on_node: Callable[[Node, trio.Nursery], Awaitable[None]] | None = None,
        client: MarketClient | None = None,
    ) -> None:
        self.config = config
        #: How https markets and sources are verified: the system's CAs and the ``--market-ca`` bundle.
        self.tls = client_context(config.market_ca)
        self.market = client or MarketClient(config.market_url, identity=config.identity, tls=self.tls)
        self.draw = random.Random(config.seed)
        self.on_node = on_node
        self.node: Node | None = None
        #: The market's coverage map of this node's ring (windows, holders, rewards), shown in the node's status.
        self.market_view: tuple[MarketWindow, ...] | None = None
        self.lease: Lease | None = None
        self.window: CoverageEntry | None = None
        self.endpoint: str | None = None
        self.state = "starting"
        self.fetches: list[FetchResult] = []
        self.started = time.monotonic()
        self.joined_after: float | None = None
        self._reported_tokens = 0
        self._credit_lease: str | None = None
        self._credit_base = 0
        self._credit_sent = 0  # cumulative tokens last reported under the current lease
        self._credited = 0  # what the market credited for it (receipts confirm with a lag)
        self._credit_retry_at = 0.0
        #: Node id serving each rank (by the latest coverage map), named in the receipts this node signs.
        self._holders: list[str] = []
        self._receipts: list[Receipt] = []
        self._demand = {"requests": 0, "tokens": 0}
        self.operator_key: PublicKey | None = config.market_key
        #: The market's ticket key, when the operator delegated to it (neighbours' tickets are checked with it).
        self.ticket_issuer: PublicKey | None = None
        self._avoid: dict[tuple[str, int, int], float] = {}
        self._lost = False
        self._warned_operator: PublicKey | None = None
        #: Whether the market ever answered (a TLS failure before that is fatal, after it a passing fault).
        self._reached = False

    # ------------------------------------------------------------------------------------------ main loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                window, lease = await self._claim_one()
                self._lost = False
                try:
                    await self._hold(window, lease)
                except* KvasirError as group:
                    reasons = "; ".join(str(e) for e in _leaves(group))
                    log.warning("node %s: %s; choosing again", self.config.node_id, reasons)
                    self._avoid[(window.model, window.start, window.end)] = time.monotonic() + AVOID_S
                finally:
                    if not self._lost:  # a failure or shutdown: hand the window back at once
                        with trio.CancelScope(shield=True):
                            await self._release()
                    self.node, self.lease, self.window, self.endpoint = None, None, None, None
                await trio.sleep(self.config.poll_s if not self._lost else 0)
        finally:
            with trio.CancelScope(shield=True):
                await self.market.aclose()

    async def _trust(self) -> None:
        """Learn the operator's key (pinned, or trusted on first use) and the market's delegated ticket key."""
        if self.operator_key is not None and self.ticket_issuer is not None:
            return
        info = await self.market.operator()
        try:
            named = PublicKey.from_text(info.get("operator", ""))
            market = PublicKey.from_text(info.get("market", ""))
        except InputError as exc:
            raise MarketError(0, "bad_operator", f"market: /v1/operator: {exc}") from None
        if self.operator_key is None:
            self.operator_key = named
            log.warning(
                "node %s: trusting market operator %s (fingerprint %s) on first use; pin it with --market-key %s",
                self.config.node_id,
                named.to_text(),
                named.fingerprint,
                named.to_text(),
            )
        elif named != self.operator_key and named != self._warned_operator:
            self._warned_operator = named  # once per key, not every poll
            log.warning(
                "node %s: the market names operator %s, not the pinned %s: its records will be refused",
                self.config.node_id,
                named.fingerprint,
                self.operator_key.fingerprint,
            )
        if auth.signature_ok(self.operator_key, auth.delegation_message(market), info.get("delegation")):
            self.ticket_issuer = market

    def _recorder(self, window: CoverageEntry, stage: Stage) -> NodeRecorder:
        from kvasir.verify.kernel import stage_kernel_class

        cfg = self.config
        assert cfg.record_dir is not None
        cfg.record_dir.mkdir(parents=True, exist_ok=True)
        return NodeRecorder(
            cfg.record_dir,
            cfg.identity,
            window.model,
            (window.start, window.end),
            stage_kernel_class(stage),
            keep_bytes=cfg.record_keep,
        )

    def _relay_connect(self) -> RelayConnect | None:
        """How this node joins its relay edges: with the edge grants the market signs with each lease renewal, or
        (a relay that still takes v1 tokens) with the ring secret."""
        cfg = self.config
        if cfg.ring_secret:
            return secret_connector(bytes.fromhex(cfg.ring_secret))
        return market_grant_connector(cfg.identity, lambda: () if self.lease is None else self.lease.grants)

    def _ticket(self) -> bytes:
        """This node's current window ticket (renewed with its lease), for the neighbour it dials."""
        lease = self.lease
        return b"" if lease is None or lease.ticket is None else lease.ticket.encode()

    def ticket_policy(self) -> TicketPolicy | None:
        """Who may neighbour this node's window: holders of the adjacent windows with the market's tickets."""
        window, issuer = self.window, self.ticket_issuer
        if window is None or issuer is None or self.node is None:
            return None
        ranks = self.node.manifest.ranks
        near = {
            (r.start, r.end)
            for r in ranks
            if abs(r.rank - window.rank) == 1 or {r.rank, window.rank} == {0, len(ranks) - 1}
        }
        return TicketPolicy(issuer, window.model, frozenset(near))

    async def _release(self) -> None:
        lease = self.lease
        if lease is None:
            return
        self.lease = None
        with trio.move_on_after(5):
            try:
                await self.market.release(
                    LeaseRef(lease.model, lease.start, lease.end, self.config.node_id, lease.lease_id)
                )
                log.warning("node %s released window %d:%d", self.config.node_id, lease.start, lease.end)
            except KvasirError as exc:
                log.warning("node %s: release failed: %s", self.config.node_id, exc)

    async def _claim_one(self) -> tuple[CoverageEntry, Lease]:
        """Poll, choose, claim: until a claim succeeds."""
        cfg = self.config
        while True:
            self.state = "choosing"
            try:
                await self._trust()
                skipped: list[str] = []
                coverage = await self.market.coverage(skipped=skipped)
                self._reached = True
                if skipped:
                    log.info(
                        "node %s: skipped %d malformed coverage entries: %s", cfg.node_id, len(skipped), skipped[0]
                    )
                now = time.monotonic()
                self._avoid = {k: until for k, until in self._avoid.items() if until > now}
                coverage = [c for c in coverage if (c.model, c.start, c.end) not in self._avoid]
                choice = choose_window(coverage, cfg.budget_bytes, self.draw)
                if choice is not None:
                    req = ClaimRequest(choice.model, choice.start, choice.end, cfg.node_id, cfg.lease_s)
                    lease = await self.market.claim(req)
                    log.info("node %s claimed window %d:%d", cfg.node_id, choice.start, choice.end)
                    return choice, lease
                self.state = "waiting for an uncovered window that fits"
            except MarketError as exc:
                if exc.status == 409:
                    log.info("node %s lost the race for a window: %s", cfg.node_id, exc)
                    continue  # someone else was faster: choose again at once
                if exc.code == "tls" and not self._reached:
                    raise  # a market this node cannot verify from the start: a setup error, said in one line
                log.warning("node %s: %s", cfg.node_id, exc)
            except KvasirError as exc:  # a malformed reply: wait and ask again
                log.warning("node %s: %s", cfg.node_id, exc)
            await trio.sleep(cfg.poll_s)

    async def _hold(self, window: CoverageEntry, lease: Lease) -> None:
        cfg = self.config
        self.window, self.lease = window, lease
        lost: list[str] = []
        async with trio.open_nursery() as nursery:

            def lose(reason: str) -> None:
                lost.append(reason)
                self._lost = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(self._keep_lease, lose)
            path = await self._fetch(window)
            self.state = "loading"
            stage = await trio.to_thread.run_sync(Stage.load, cfg.stage_config(path))
            try:
                await self._admit(window, stage)
                await trio.to_thread.run_sync(lambda: stage.vocab)
                coverage = await self.market.coverage(window.model)
                manifest = manifest_from_coverage(
                    coverage,
                    window.rank,
                    cfg.listen_host,
                    cfg.listen_port,
                    relay=cfg.relay,
                    secret=cfg.ring_secret,
                    host_ok=cfg.host_ok,
                    own_key=cfg.identity.public,
                )
                node_config = NodeConfig(
                    manifest,
                    window.rank,
                    node_id=cfg.node_id,
                    relay=cfg.relay,
                    relay_connect=self._relay_connect(),
                    identity=cfg.identity,
                    peer_policy=self.ticket_policy,
                    ticket=self._ticket,
                    **cfg.node_options,
                )
                recorder = None
                if cfg.record_dir is not None:
                    recorder = await trio.to_thread.run_sync(self._recorder, window, stage)
                async with (
                    open_node(node_config, stage, market_view=lambda: self.market_view, recorder=recorder) as node,
                    trio.open_nursery() as serving,
                ):
                    port = node.port
                    self.node = node
                    self._reported_tokens, self._credit_lease, self._credit_base = 0, None, 0
                    self._receipts.clear()
                    self._see_holders(coverage, window.rank)
                    host = cfg.advertise_host or cfg.listen_host
                    self.endpoint = f"relay:{cfg.relay}" if cfg.relay else format_hostport(host, port)
                    node.update_manifest(attrs.evolve(manifest, ranks=_with_port(manifest.ranks, window.rank, port)))
                    await self._renew("serving")
                    self.state = "serving"
                    self.joined_after = time.monotonic() - self.started
                    log.warning(
                        "node %s serving window %d:%d (rank %d) at %s, %.1f s after start",
                        cfg.node_id,
                        window.start,
                        window.end,
                        window.rank,
                        self.endpoint,
                        self.joined_after,
                    )
                    serving.start_soon(self._follow_coverage, node, port)
                    serving.start_soon(self._watch_demand, node)
                    serving.start_soon(self._report_loop)
                    if self.on_node is not None:
                        await self.on_node(node, serving)
                    await trio.sleep_forever()
            finally:
                self.market_view = None
                stage.close()
        if lost:
            raise LeaseLost(lost[0])

    async def _admit(self, window: CoverageEntry, stage: Stage) -> None:
        """Admission by reproduction: AdmissionRefused (the window is released and avoided) when the loaded window
        does not reproduce the probe hash the signed record holds for this node's kernel class."""
        record = (await self.verified_model(window.model)).stage(window.start, window.end)
        if record is None or not record.probes:
            return
        self.state = "probing"
        checked = await trio.to_thread.run_sync(check_probe, stage, record.probe_map(), (window.start, window.end))
        if checked is not None:
            log.info("node %s reproduces the probe of window %d:%d (%s)", self.config.node_id, window.start,
                     window.end, checked)  # fmt: skip

    # ------------------------------------------------------------------------------------------ fetching

    async def _fetch(self, window: CoverageEntry) -> Path:
        cfg = self.config
        self.state = f"fetching window {window.start}:{window.end}"
        model = await self.verified_model(window.model)
        stage = model.stage(window.start, window.end)
        if stage is None:
            raise LeaseLost(f"the signed record of {window.model[:12]}… has no window {window.start}:{window.end}")
        d = cfg.stage_dir / window.model[:16]
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"layers-{window.start}-{window.end}.gguf"
        if await trio.to_thread.run_sync(verify_stage, path, stage.sha256):
            log.info("node %s reuses its stage %s", cfg.node_id, path)
            return path
        errors = []
        for url in model.sources:
            if not cfg.host_ok(httpx.URL(url).host):
                errors.append(f"{url}: a private or loopback source, and this node does not allow them")
                continue
            try:
                with byte_bar(f"window {window.start}:{window.end}") as progress:  # on a terminal only
                    result = await fetch_window(
                        url,
                        window.start,
                        window.end,
                        path,
                        sha256=stage.sha256,  # the signed record's hash, never the coverage map's
                        model_sha256=model.sha256,
                        max_header_bytes=model.header_bytes,
                        file_bytes=model.file_bytes,
                        progress=progress,
                        tls=self.tls,
                    )
            except Exception as exc:  # any failure of one source (KvasirError, or a bug on hostile input): next one
                errors.append(f"{type(exc).__name__}: {exc}")
                log.warning("node %s: source %s failed: %s", cfg.node_id, url, exc)
                continue
            self.fetches.append(result)
            log.warning(
                "node %s fetched window %d:%d: %d bytes (header %d + window %d) in %.2f s",
                cfg.node_id,
                window.start,
                window.end,
                result.bytes_fetched,
                result.header_bytes,
                result.window_bytes,
                result.seconds,
            )
            return path
        raise LeaseLost(f"no source could serve window {window.start}:{window.end}: {'; '.join(errors)}")

    async def verified_model(self, sha256: str) -> ModelRecord:
        """The market's record of a model, if the trusted operator signed it (LeaseLost otherwise)."""
        await self._trust()
        model = await self.market.model(sha256)
        key = self.operator_key
        assert key is not None
        if model.sha256 != sha256 or not model.signed_by(key):
            raise LeaseLost(f"the record of model {sha256[:12]}… is not signed by operator {key.fingerprint}")
        return model

    # ------------------------------------------------------------------------------------------ lease

    async def _renew(self, state: str) -> None:
        cfg, lease = self.config, self.lease
        assert lease is not None
        req = ClaimRequest(
            lease.model,
            lease.start,
            lease.end,
            cfg.node_id,
            cfg.lease_s,
            endpoint=self.endpoint,
            state="serving" if state == "serving" else "fetching",
            lease_id=lease.lease_id,
        )
        try:
            self.lease = await self.market.renew(req)
        except MarketError as exc:
            if exc.code != "lease_expired":
                raise
            # Nobody took it meanwhile: claim it again (keeps serving without a gap).
            self.lease = await self.market.claim(attrs.evolve(req, lease_id=None))

    async def _keep_lease(self, lose: Callable[[str], None]) -> None:
        cfg = self.config
        while True:
            await trio.sleep(cfg.lease_s / 3)
            try:
                await self._renew("serving" if self.node is not None and self.endpoint else "fetching")
            except MarketError as exc:
                if exc.status in (404, 409):
                    lose(f"lost window: {exc}")
                    return
                log.warning("node %s: renewing the lease failed (will retry): %s", cfg.node_id, exc)
            except KvasirError as exc:  # a malformed reply: the lease may still be ours; retry
                log.warning("node %s: renewing the lease failed (will retry): %s", cfg.node_id, exc)

    # ------------------------------------------------------------------------------------------ serving

    async def _follow_coverage(self, node: Node, port: int) -> None:
        cfg = self.config
        window = self.window
        assert window is not None
        while True:
            await trio.sleep(cfg.poll_s)
            try:
                coverage = await self.market.coverage(window.model)
            except (MarketError, KvasirError) as exc:
                log.warning("node %s: coverage poll failed: %s", cfg.node_id, exc)
                continue
            self.market_view = tuple(
                MarketWindow(c.rank, (c.start, c.end), c.holder if c.serving else None, c.reward, c.state)
                for c in coverage
            )
            self._see_holders(coverage, window.rank)
            if len(coverage) != node.manifest.size:
                continue  # the manifest changed under us: the lease keeper finds out whether we still hold a window
            node.update_manifest(
                manifest_from_coverage(
                    coverage,
                    window.rank,
                    cfg.listen_host,
                    port,
                    name=node.manifest.model_name,
                    relay=cfg.relay,
                    secret=cfg.ring_secret,
                    host_ok=cfg.host_ok,
                    own_key=cfg.identity.public,
                )
            )

    def _see_holders(self, coverage: Sequence[CoverageEntry], rank: int) -> None:
        holders = {c.rank: (c.holder or "") if c.serving else "" for c in coverage}
        holders[rank] = self.config.node_id
        self._holders = [holders.get(r, "") for r in range(max(holders) + 1)]

    async def _watch_demand(self, node: Node) -> None:
        """Count requests that entered the ring at this node and the tokens they generated; keep a receipt of each
        request this node witnesses (its tokens and the holders that produced them), which the market needs to
        credit any window: the entry's own, and the exit witness's (:func:`exit_rank`) naming the entry node."""
        witnessed: dict[int, int] = {}  # request id → entry rank, for requests this node witnesses
        async with node.hub.subscribe() as events:
            async for ev in events:
                if ev.get("type") != "request":
                    continue
                request = ev.get("request")
                if ev.get("state") == "start" and isinstance(request, int):
                    entry_rank = ev.get("entry_rank")
                    mine = entry_rank == node.rank or exit_rank(entry_rank, node.manifest.size) == node.rank
                    if mine and isinstance(entry_rank, int) and len(witnessed) < MAX_PENDING_RECEIPTS:
                        witnessed[request] = entry_rank  # requests in flight; bounded all the same
                elif ev.get("state") == "end" and request in witnessed:
                    entry_rank = witnessed.pop(request)
                    generated = min(int(ev.get("generated") or 0), MAX_REPORT_TOKENS)
                    if entry_rank == node.rank:
                        self._demand["requests"] += 1
                        self._demand["tokens"] += generated
                        entry = None
                    else:
                        entry = self._holders[entry_rank] if entry_rank < len(self._holders) else ""
                        if not entry:
                            continue  # nobody known at the entry's rank: no receipt to pair with
                    if generated > 0:
                        self._receipts.append(Receipt(request, generated, tuple(self._holders), entry))
                        del self._receipts[:-MAX_PENDING_RECEIPTS]  # bounded while the market is away

    async def _report_loop(self) -> None:
        while True:
            await trio.sleep(self.config.report_s)
            await self.report()

    async def report(self) -> None:
        """Credit tokens served since the last report, and report demand; failures are retried next time."""
        node, lease = self.node, self.lease
        if node is None or lease is None:
            return
        if lease.lease_id != self._credit_lease:  # credit reports are cumulative per lease
            self._credit_lease, self._credit_base = lease.lease_id, self._reported_tokens
            self._credit_sent = self._credited = 0
        tokens = node.requests.tokens
        demand = {
            "requests": min(self._demand["requests"], MAX_REPORT_REQUESTS),
            "tokens": min(self._demand["tokens"], MAX_REPORT_TOKENS),
        }
        try:
            if demand["requests"] or demand["tokens"]:
                await self.market.demand(DemandReport(lease.model, demand["requests"], demand["tokens"]))
                self._demand["requests"] -= demand["requests"]
                self._demand["tokens"] -= demand["tokens"]
            while self._receipts:
                batch = self._receipts[:MAX_RECEIPTS]
                await self.market.receipts(ReceiptBatch(lease.model, self.config.node_id, tuple(batch)))
                del self._receipts[: len(batch)]
            served = tokens - self._credit_base
            now = time.monotonic()
            # Report new work at once; work not yet confirmed (receipts lag) again every CREDIT_RETRY_S.
            if served > self._credit_sent or (served > self._credited and now >= self._credit_retry_at):
                report = CreditReport(lease.model, lease.start, lease.end, self.config.node_id, lease.lease_id, served)
                reply = await self.market.credit(report)
                self._credit_sent, self._reported_tokens = served, tokens
                self._credited = int(reply.get("tokens") or 0)
                self._credit_retry_at = now + CREDIT_RETRY_S
        except (MarketError, KvasirError) as exc:
            log.info("node %s: report failed: %s", self.config.node_id, exc)

    async def close(self) -> None:
        """Shutdown: fail in-flight requests, credit the rest, release the lease (bounded in time)."""
        with trio.move_on_after(5):
            if self.node is not None:
                await self.node.shutdown()
            await self.report()
            await self._release()

    def status(self) -> dict[str, Any]:
        w = self.window
        return {
            "node_id": self.config.node_id,
            "state": self.state,
            "window": [w.start, w.end] if w else None,
            "rank": w.rank if w else None,
            "endpoint": self.endpoint,
            "joined_after_s": self.joined_after,
            "fetched": [
                {
                    "layers": [f.start, f.end],
                    "bytes_fetched": f.bytes_fetched,
                    "header_bytes": f.header_bytes,
                    "window_bytes": f.window_bytes,
                    "seconds": round(f.seconds, 3),
                }
                for f in self.fetches
            ],
        }


def _leaves(group: BaseExceptionGroup[KvasirError]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


def _with_port(ranks: tuple[RankEntry, ...], rank: int, port: int) -> tuple[RankEntry, ...]:
    return tuple(attrs.evolve(r, port=port) if r.rank == rank else r for r in ranks)
