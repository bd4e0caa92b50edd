"""One claimed window, served: ``async with serve_window(…) as serving:`` (docs/market.md § Enrollment).

Entering fetches the window's stage (reused when one with the signed hash is on disk), loads it, checks admission
by reproduction, opens the :class:`~kvasir.ring.node.Node` and renews the lease as ``serving`` with its endpoint.
The block owns one nursery, and with it every task of the session: the lease keeper (from the claim on, through
the download), the coverage follower, the ledger's reports and the caller's node handler (a control socket, an
API). A lost lease raises :class:`~kvasir.market.agent.lease.LeaseTaken` out of its task, which ends the block;
leaving the block stops those tasks, then the node (requests in flight fail with an error reply), then the stage.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NoReturn, TypeVar

import attrs
import httpx
import trio

from kvasir.core.errors import KvasirError, MarketError
from kvasir.core.identity import PublicKey
from kvasir.market.agent.client import MarketClient, is_transient
from kvasir.market.agent.config import EnrollConfig
from kvasir.market.agent.lease import LeaseKeeper, LeaseLost, LeaseTaken
from kvasir.market.agent.ledger import Ledger
from kvasir.market.agent.policy import OwnState, Release, decide, window_key
from kvasir.market.agent.ringmap import keep_known, manifest_from_coverage, with_port
from kvasir.market.agent.trust import Trust
from kvasir.market.agent.vouch import Linked, LinkedKeys, vouch_every
from kvasir.market.records import CoverageEntry
from kvasir.market.tickets import TicketPolicy, predecessor_ticket_policy
from kvasir.relay.ringlink import market_grant_connector, secret_connector
from kvasir.ring.edges import RelayConnect
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.record import NodeRecorder
from kvasir.ring.status import MarketWindow
from kvasir.shard.fetch import FetchResult, fetch_window, verify_stage
from kvasir.stage.engine import Stage
from kvasir.util.addr import format_hostport
from kvasir.util.progress import byte_bar
from kvasir.util.tls import client_context
from kvasir.verify.probe import check_probe

log = logging.getLogger("kvasir.enroll")
T = TypeVar("T")

#: What runs beside a serving node, in the session's nursery, until the session ends (e.g. its control socket).
NodeHandler = Callable[[Node], Awaitable[None]]


@attrs.define
class Progress:
    """What the enrollment shows in its status: a state line, the windows fetched, when it first served."""

    state: str = "starting"
    fetches: list[FetchResult] = attrs.Factory(list)
    started: float = attrs.Factory(time.monotonic)
    joined_after: float | None = None


@attrs.define
class MarketView:
    """The market's map of the node's ring (windows, holders, rewards), as the node's status shows it."""

    windows: tuple[MarketWindow, ...] | None = None

    def __call__(self) -> tuple[MarketWindow, ...] | None:
        return self.windows

    def update(self, coverage: Sequence[CoverageEntry]) -> None:
        self.windows = tuple(
            MarketWindow(c.rank, (c.start, c.end), c.holder if c.serving else None, c.reward, c.state) for c in coverage
        )


@attrs.define(eq=False)
class Agent:
    """What every session of one enrolling node shares: its settings, market client, trust and TLS context."""

    config: EnrollConfig
    market: MarketClient
    trust: Trust
    tls: ssl.SSLContext = attrs.Factory(client_context)
    draw: random.Random = attrs.Factory(random.Random)


@attrs.define(eq=False)
class Serving:
    """A window being served (what :func:`serve_window` yields)."""

    agent: Agent
    window: CoverageEntry
    keeper: LeaseKeeper
    node: Node
    endpoint: str
    ledger: Ledger
    view: MarketView

    async def report(self) -> None:
        """Send the receipts of paid requests (the market settles them: docs/market.md § Credit)."""
        lease = self.keeper.lease
        if lease is not None:
            await self.ledger.report(self.agent.market, lease)

    async def report_every(self, seconds: float) -> NoReturn:
        while True:
            await trio.sleep(seconds)
            await self.report()

    async def follow_coverage(self) -> NoReturn:
        """Re-read the market's map every poll: the node's status shows it, the receipts name its holders, and the
        node's manifest follows it (a replaced neighbour is dialled at its new address). LeaseTaken when the map
        says the window is no longer this node's (:func:`~kvasir.market.agent.policy.decide`)."""
        cfg, window, node = self.agent.config, self.window, self.node
        own = OwnState(cfg.node_id, holding=window_key(window))
        while True:
            await trio.sleep(cfg.poll_s)
            try:
                coverage = await self.agent.market.coverage(window.model)
            except (MarketError, KvasirError) as exc:
                log.warning("node %s: coverage poll failed: %s", cfg.node_id, exc)
                continue
            self.view.update(coverage)
            self.ledger.see_holders(coverage, window.rank)
            decision = decide(coverage, own, cfg.budget_bytes, self.agent.draw)
            if isinstance(decision, Release):
                raise LeaseTaken(decision.reason)
            if len(coverage) != node.manifest.size:
                continue  # the manifest changed under us: the lease keeper finds out whether we still hold a window
            fresh = manifest_from_coverage(
                coverage,
                window.rank,
                cfg.listen_host,
                node.port,
                name=node.manifest.model_name,
                relay=cfg.relay,
                secret=cfg.ring_secret,
                host_ok=cfg.host_ok,
                own_key=cfg.identity.public,
            )
            # A window the map shows uncovered keeps the neighbour the node knows: a lapsed lease (a market that
            # cannot be reached, a clock off) is no reason to drop a working link; a new holder replaces it.
            lapsed = {w.rank for w in coverage if not w.serving and w.rank != window.rank}
            node.update_manifest(keep_known(fresh, node.manifest, lapsed))


@asynccontextmanager
async def serve_window(
    agent: Agent,
    window: CoverageEntry,
    keeper: LeaseKeeper,
    progress: Progress,
    *,
    handler: NodeHandler | None = None,
) -> AsyncIterator[Serving]:
    """Serve ``window``, claimed under ``keeper``'s lease, until the block ends (see the module's docstring)."""
    cfg = agent.config
    async with trio.open_nursery() as tasks:
        tasks.start_soon(keeper.keep)
        path = await patiently(agent, "fetching the window", lambda: fetch_stage(agent, window, progress))
        progress.state = "loading"
        stage = await trio.to_thread.run_sync(Stage.load, cfg.stage_config(path))
        view = MarketView()
        try:
            await patiently(agent, "admission", lambda: _admit(agent, window, stage, progress))
            await trio.to_thread.run_sync(lambda: stage.vocab)
            coverage = await patiently(agent, "reading coverage", lambda: agent.market.coverage(window.model))
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
            opened: Node | None = None

            def peer_policy() -> TicketPolicy | None:
                issuer = agent.trust.ticket_issuer
                if opened is None or issuer is None:
                    return None
                return ticket_policy(issuer, window, opened, agent.market.market_time)

            node_config = NodeConfig(
                manifest,
                window.rank,
                node_id=cfg.node_id,
                relay=cfg.relay,
                relay_connect=_relay_connect(cfg, keeper),
                identity=cfg.identity,
                peer_policy=peer_policy,
                ticket=keeper.ticket,
                **cfg.node_options,
            )
            # Recording is required in a market ring (issue 24, N9): every node records and refuses what a member
            # that does not record sends (a boundary or END without its chain head).
            recorder = await trio.to_thread.run_sync(_recorder, cfg, window, stage)
            async with open_node(node_config, stage, market_view=view, recorder=recorder) as node:
                opened = node
                ledger = Ledger(cfg.node_id)
                ledger.see_holders(coverage, window.rank)
                # Lossless, and for the node's whole life: requests its shutdown fails are witnessed too.
                node.requests.on_end.add(lambda ended: ledger.request_ended(ended, node.rank, node.manifest.size))
                host = cfg.advertise_host or cfg.listen_host
                endpoint = f"relay:{cfg.relay}" if cfg.relay else format_hostport(host, node.port)
                node.update_manifest(attrs.evolve(manifest, ranks=with_port(manifest.ranks, window.rank, node.port)))
                keeper.endpoint = endpoint
                try:
                    await patiently(agent, "renewing the lease as serving", keeper.renew)
                except MarketError as exc:
                    if exc.status in (404, 409):  # another node's now, or gone: lost, not the window's fault
                        raise LeaseTaken(f"lost window: {exc}") from None
                    raise
                serving = Serving(agent, window, keeper, node, endpoint, ledger, view)
                progress.state = "serving"
                progress.joined_after = time.monotonic() - progress.started
                log.warning(
                    "node %s serving window %d:%d (rank %d) at %s, %.1f s after start",
                    cfg.node_id, window.start, window.end, window.rank, endpoint, progress.joined_after,
                )  # fmt: skip
                tasks.start_soon(serving.follow_coverage)
                tasks.start_soon(serving.report_every, cfg.report_s)
                tasks.start_soon(vouch_every, agent.market, lambda: keeper.lease, cfg.node_id, _linked(node))
                if handler is not None:
                    tasks.start_soon(handler, node)
                try:
                    yield serving
                finally:
                    tasks.cancel_scope.cancel()  # the session's tasks stop before the node does
        finally:
            view.windows = None
            stage.close()


async def patiently(agent: Agent, what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, tried again every poll while the market is unreachable or busy
    (:func:`~kvasir.market.agent.client.is_transient`): a market outage is no reason to give up a window. The lease
    keeper beside it ends the session if the window is really lost."""
    while True:
        try:
            return await call()
        except MarketError as exc:
            if not is_transient(exc):
                raise
            log.warning("node %s: %s: %s (retrying)", agent.config.node_id, what, exc)
        await trio.sleep(agent.config.poll_s)


def ticket_policy(
    issuer: PublicKey, window: CoverageEntry, node: Node, clock: Callable[[], float] = time.time
) -> TicketPolicy:
    """Who may link to ``window`` as its predecessor: the holder of the market's ticket for exactly the previous
    window (not the next one: issue 24 N2), its expiry checked against ``clock`` (the node's estimate of the market's
    time, which issued it)."""
    return predecessor_ticket_policy(issuer, window.model, node.manifest, window.rank, clock)


def _linked(node: Node) -> Linked:
    """The keys on the node's live links: the predecessor's (its ticket checked for the window before), the
    successor's (the key the link was dialled with: the manifest's, from the market's map)."""

    def keys() -> LinkedKeys:
        links = node.links
        pred = links.predecessor_key if links.predecessor is not None else None
        succ = node.manifest.successor(node.rank).key if links.successor is not None else None
        return pred, succ

    return keys


def _relay_connect(cfg: EnrollConfig, keeper: LeaseKeeper) -> RelayConnect | None:
    """How the node joins its relay edges: with the edge grants the market signs with each lease renewal, or (a
    relay that still takes v1 tokens) with the ring secret."""
    if cfg.ring_secret:
        return secret_connector(bytes.fromhex(cfg.ring_secret))
    return market_grant_connector(cfg.identity, keeper.grants)


def _recorder(cfg: EnrollConfig, window: CoverageEntry, stage: Stage) -> NodeRecorder:
    """The node's receipts, recording required: in ``--record DIR``, else in the stage directory's ``record/``."""
    from kvasir.verify.kernel import stage_kernel_class

    directory = cfg.record_dir if cfg.record_dir is not None else cfg.stage_dir / "record"
    directory.mkdir(parents=True, exist_ok=True)
    return NodeRecorder(
        directory,
        cfg.identity,
        window.model,
        (window.start, window.end),
        stage_kernel_class(stage),
        keep_bytes=cfg.record_keep,
        required=True,
    )


async def _admit(agent: Agent, window: CoverageEntry, stage: Stage, progress: Progress) -> None:
    """Admission by reproduction: AdmissionRefused (the window is released and avoided) when the loaded window
    does not reproduce the probe hash the signed record holds for this node's kernel class."""
    record = (await agent.trust.verified_model(window.model)).stage(window.start, window.end)
    if record is None or not record.probes:
        return
    progress.state = "probing"
    checked = await trio.to_thread.run_sync(check_probe, stage, record.probe_map(), (window.start, window.end))
    if checked is not None:
        log.info("node %s reproduces the probe of window %d:%d (%s)", agent.config.node_id, window.start,
                 window.end, checked)  # fmt: skip


async def fetch_stage(agent: Agent, window: CoverageEntry, progress: Progress) -> Path:
    """The window's stage file: one on disk with the signed record's hash, or downloaded from the first source
    that serves it (LeaseLost when none does)."""
    cfg = agent.config
    progress.state = f"fetching window {window.start}:{window.end}"
    model = await agent.trust.verified_model(window.model)
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
            with byte_bar(f"window {window.start}:{window.end}") as bar:  # on a terminal only
                result = await fetch_window(
                    url,
                    window.start,
                    window.end,
                    path,
                    sha256=stage.sha256,  # the signed record's hash, never the coverage map's
                    model_sha256=model.sha256,
                    max_header_bytes=model.header_bytes,
                    file_bytes=model.file_bytes,
                    progress=bar,
                    tls=agent.tls,
                )
        except Exception as exc:  # any failure of one source (KvasirError, or a bug on hostile input): next one
            errors.append(f"{type(exc).__name__}: {exc}")
            log.warning("node %s: source %s failed: %s", cfg.node_id, url, exc)
            continue
        progress.fetches.append(result)
        log.warning(
            "node %s fetched window %d:%d: %d bytes (header %d + window %d) in %.2f s",
            cfg.node_id, window.start, window.end, result.bytes_fetched, result.header_bytes, result.window_bytes,
            result.seconds,
        )  # fmt: skip
        return path
    raise LeaseLost(f"no source could serve window {window.start}:{window.end}: {'; '.join(errors)}")
