"""Self-enrollment: an empty node claims a window from the market, downloads only it, joins the ring and earns.

One :class:`Enrollment` runs one loop (``run``), from these parts:

1. poll the coverage map; the pure policy (:func:`~kvasir.market.agent.policy.decide`) picks the best reward per
   byte among uncovered windows that fit the memory budget (ties: a seeded random draw), or says wait;
2. claim it (state ``fetching``, a lease: :mod:`~kvasir.market.agent.lease`); a lost race (409) means choose
   again. Claiming *before* the download means two nodes never download the same window at once, and a node that
   dies mid-download loses the window when its lease runs out;
3. ``async with serve_window(…)`` (:mod:`~kvasir.market.agent.session`): download the window's stage (HTTP Range,
   verified against the signed record's hash), load it, start the :class:`~kvasir.ring.node.Node` and renew the
   lease as ``serving`` with its link endpoint;
4. while serving: renew the lease every third of its time, follow the coverage map (the node's manifest is
   rebuilt from it, so a replacement neighbour is dialled at its new address), and send the receipts of paid
   requests (:mod:`~kvasir.market.agent.ledger`, fed by the node's lossless request-end listener);
5. a lost lease (expired and taken by another node, or a window gone from the manifest) stops the node and goes
   back to 1; shutdown fails in-flight requests, sends the receipts left and releases the lease.

Timeouts live in the child tasks that wait (every market call is bounded by the client's timeout).

Trust (:mod:`~kvasir.market.agent.trust`): the node signs every market write with its identity (its id is the
key's fingerprint), acts on no market reply that the market key the operator delegated to did not sign (the
coverage map, leases, tickets, grants, refusals: kvasir.market.replies), and loads nothing a model record names
unless the record carries the pinned operator's signature (``market_key``; without one, on a loopback market only,
the operator key the market names is trusted on first use and its fingerprint logged). A failure of the window
while holding it (no source, a bad record, a stage that would not load) releases the lease and avoids that window
for a while. An unreachable or busy market is not the window's failure (nor a reply the market did not sign): the
session waits for the market (:func:`~kvasir.market.agent.session.patiently`), and a window lost to another node is
not avoided either (it may be free again when that node dies).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import trio

from kvasir.core.errors import KvasirError, MarketError
from kvasir.core.identity import PublicKey
from kvasir.market.agent.client import MarketClient, is_transient
from kvasir.market.agent.config import EnrollConfig, is_public_host
from kvasir.market.agent.lease import LeaseKeeper, LeaseLost, LeaseTaken
from kvasir.market.agent.policy import Claim, OwnState, WindowKey, decide, next_look, window_key
from kvasir.market.agent.ringmap import manifest_from_coverage
from kvasir.market.agent.session import Agent, NodeHandler, Progress, Serving, serve_window
from kvasir.market.agent.trust import Trust
from kvasir.market.records import CoverageEntry, Lease, ModelRecord
from kvasir.ring.node import Node
from kvasir.shard.fetch import FetchResult
from kvasir.util.cli import reportable
from kvasir.util.tls import client_context

__all__ = [
    "EnrollConfig",
    "Enrollment",
    "LeaseLost",
    "is_public_host",
    "manifest_from_coverage",
]

log = logging.getLogger("kvasir.enroll")

#: How long a window that failed (no source, a bad record) is left to others.
AVOID_S = 120.0


class Enrollment:
    """One self-enrolling node. ``run`` until cancelled; ``close`` on shutdown.

    ``on_node(node)`` runs beside each node it serves, in that session's nursery, until the session ends (the
    command starts the node's control socket and API there).
    """

    def __init__(
        self, config: EnrollConfig, *, on_node: NodeHandler | None = None, client: MarketClient | None = None
    ) -> None:
        #: How https markets and sources are verified: the system's CAs and the ``--market-ca`` bundle.
        tls = client_context(config.market_ca)
        market = client or MarketClient(config.market_url, identity=config.identity, tls=tls)
        trust = Trust(market, config.node_id, config.market_key)
        self.agent = Agent(config, market, trust, tls, random.Random(config.seed))
        self.on_node = on_node
        self.progress = Progress()
        self.keeper = LeaseKeeper(market, config.node_id, config.lease_s)
        self.window: CoverageEntry | None = None
        self.serving: Serving | None = None
        self._avoid: dict[WindowKey, float] = {}
        #: Whether the market ever answered (a TLS failure before that is fatal, after it a passing fault).
        self._reached = False

    @property
    def config(self) -> EnrollConfig:
        return self.agent.config

    @property
    def market(self) -> MarketClient:
        return self.agent.market

    @property
    def operator_key(self) -> PublicKey | None:
        return self.agent.trust.operator_key

    @property
    def ticket_issuer(self) -> PublicKey | None:
        return self.agent.trust.ticket_issuer

    @property
    def state(self) -> str:
        return self.progress.state

    @property
    def node(self) -> Node | None:
        return None if self.serving is None else self.serving.node

    @property
    def lease(self) -> Lease | None:
        return self.keeper.lease

    @property
    def endpoint(self) -> str | None:
        return self.keeper.endpoint

    @property
    def fetches(self) -> list[FetchResult]:
        return self.progress.fetches

    async def verified_model(self, sha256: str) -> ModelRecord:
        """The market's record of a model, if the trusted operator signed it (LeaseLost otherwise)."""
        return await self.agent.trust.verified_model(sha256)

    # ------------------------------------------------------------------------------------------ main loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                window = await self._claim_one()
                lost = False
                try:
                    async with serve_window(
                        self.agent, window, self.keeper, self.progress, handler=self.on_node
                    ) as self.serving:
                        await trio.sleep_forever()
                except* LeaseTaken as group:
                    lost = True
                    self._give_up(window, group, avoid=False)
                except* KvasirError as group:
                    self._give_up(window, group, avoid=_window_failed(group))
                finally:
                    self.serving = self.window = None
                    if lost:  # no longer the node's: nothing to hand back
                        self.keeper.forget()
                    else:  # a failure or shutdown: hand the window back at once
                        with trio.CancelScope(shield=True):
                            await self.keeper.release()
                await trio.sleep(0 if lost else self.config.poll_s)
        finally:
            with trio.CancelScope(shield=True):
                await self.market.aclose()

    def _give_up(self, window: CoverageEntry, group: BaseExceptionGroup[KvasirError], *, avoid: bool) -> None:
        log.warning("node %s: %s; choosing again", self.config.node_id, reportable(group) or group)
        if avoid:
            self._avoid[window_key(window)] = time.monotonic() + AVOID_S

    async def _claim_one(self) -> CoverageEntry:
        """Poll, decide, claim: until a claim succeeds."""
        cfg = self.config
        while True:
            self.progress.state = "choosing"
            try:
                await self.agent.trust.learn()
                skipped: list[str] = []
                coverage = await self.market.coverage(skipped=skipped)
                self._reached = True
                if skipped:
                    log.info(
                        "node %s: skipped %d malformed coverage entries: %s", cfg.node_id, len(skipped), skipped[0]
                    )
                now = time.monotonic()
                self._avoid = {k: until for k, until in self._avoid.items() if until > now}
                own = OwnState(cfg.node_id, avoid=frozenset(self._avoid))
                decision = decide(coverage, own, cfg.budget_bytes, self.agent.draw)
                if isinstance(decision, Claim):
                    choice = decision.window
                    try:
                        await self.keeper.claim(choice)
                    except MarketError as exc:
                        if exc.code == "idle_cooldown":  # this key let the window idle: others' turn for a while
                            self._avoid[window_key(choice)] = time.monotonic() + AVOID_S
                        raise
                    log.info("node %s claimed window %d:%d", cfg.node_id, choice.start, choice.end)
                    self.window = choice
                    return choice
                self.progress.state = decision.reason
                await trio.sleep(next_look(coverage, own, cfg.budget_bytes, self.market.market_time(), cfg.poll_s))
                continue
            except MarketError as exc:
                if exc.status == 409:
                    log.info("node %s lost the race for a window: %s", cfg.node_id, exc)
                    continue  # someone else was faster: choose again at once
                if exc.code in ("tls", "untrusted_market") and not self._reached:
                    # a market this node cannot verify from the start (its certificate, or a market key the pinned
                    # operator did not delegate to): a setup error, said in one line
                    raise
                log.warning("node %s: %s", cfg.node_id, exc)
            except KvasirError as exc:  # a malformed reply: wait and ask again
                log.warning("node %s: %s", cfg.node_id, exc)
            await trio.sleep(cfg.poll_s)

    # ------------------------------------------------------------------------------------------ reports, shutdown

    async def report(self) -> None:
        """Credit tokens served since the last report, and report demand and receipts; failures are retried."""
        if self.serving is not None:
            await self.serving.report()

    async def close(self) -> None:
        """Shutdown: fail in-flight requests, credit the rest, release the lease (bounded in time)."""
        with trio.move_on_after(5):
            if self.serving is not None:
                await self.serving.node.shutdown()
            await self.report()
            await self.keeper.release()

    def status(self) -> dict[str, Any]:
        w = self.window
        skew = self.market.skew()
        return {
            "node_id": self.config.node_id,
            "state": self.state,
            "window": [w.start, w.end] if w else None,
            "rank": w.rank if w else None,
            "endpoint": self.endpoint,
            "joined_after_s": self.progress.joined_after,
            #: How far the market's clock is ahead of this host's (requests are signed in the market's time).
            "market_skew_s": None if skew is None else round(skew, 1),
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


def _window_failed(group: BaseExceptionGroup[KvasirError]) -> bool:
    """Whether a session's failure was the window's (avoid it), not only the market's (unreachable, busy)."""
    return group.subgroup(lambda e: not isinstance(e, BaseExceptionGroup) and not is_transient(e)) is not None
