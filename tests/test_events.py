"""Node events: typed on the control socket, lossy for observers, lossless for accounting.

The flood test runs real nodes (FakeStages over memory streams, trio's MockClock): an observer that never reads
fills its channel, so the hub drops every later event for it, the request ends included; the market agent's ledger
listens on the lossless request-end listeners and still keeps a receipt and demand for every request.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from kvasir.core.clientauth import sign_auth
from kvasir.core.identity import Identity
from kvasir.core.schema import SchemaError
from kvasir.market.agent.ledger import Ledger
from kvasir.market.records import CoverageEntry, Receipt
from kvasir.ring.events import (
    EndListeners,
    EventHub,
    FailedOver,
    NodeEvent,
    RequestEnded,
    RequestStarted,
    TokenPassed,
    event_from_wire,
    event_to_wire,
)
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.requests import EndEvent
from kvasir.testing.fakestage import MemoryNetwork, fake_ring
from kvasir.tui.model import NodeModel
from kvasir.wire import SamplingParams
from tests.streams import wait_for

ids = st.integers(0, 2**64 - 1)
counts = st.integers(0, 10**6)
events = st.one_of(
    st.builds(TokenPassed, ids, counts, st.integers(-1, 10**6), st.text()),
    st.builds(RequestStarted, ids, counts, st.integers(0, 255)),
    st.builds(RequestEnded, ids, st.sampled_from(["eog", "stop", "error"]), counts, st.none() | st.text(), counts),
    st.builds(
        FailedOver,
        st.integers(0, 255),
        st.tuples(counts, counts),
        counts,
        counts,
        counts,
        st.none() | st.floats(0, 1e6),
    ),
)


@given(events)
def test_every_event_round_trips_through_its_json_line(event: NodeEvent) -> None:
    line = json.dumps(event_to_wire(event))
    assert event_from_wire(json.loads(line)) == event


def test_the_wire_shape_is_the_documented_one() -> None:
    """docs/protocol.md § Control socket: the tag first, then the fields, as the TUI and scripts read them."""
    assert event_to_wire(TokenPassed(7, 0, 5, "Hi")) == {"type": "token", "request": 7, "index": 0, "token": 5,
                                                          "text": "Hi"}  # fmt: skip
    assert list(event_to_wire(RequestStarted(7, 3, 1))) == ["type", "state", "request", "prompt_tokens", "entry_rank"]
    end = event_to_wire(RequestEnded(7, "eog", 2, None, 1))
    assert end == {"type": "request", "state": "end", "request": 7, "reason": "eog", "generated": 2, "error": None,
                   "entry_rank": 1}  # fmt: skip
    fo = json.loads(json.dumps(event_to_wire(FailedOver(2, (4, 8), 1, 9, 300, 0.5))))
    assert fo == {"type": "failover", "rank": 2, "window": [4, 8], "requests": 1, "frames": 9, "bytes": 300,
                  "stall_s": 0.5}  # fmt: skip


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"type": "note"}, "unknown event 'note'"),
        ({"type": "request", "state": "middle", "request": 1}, "unknown event 'request'"),
        ({"type": "token", "request": "1", "index": 0, "token": 1, "text": ""}, "request: must be an integer"),
        ({"type": "request", "state": "start", "request": 1, "prompt_tokens": 2}, "entry_rank: required field"),
        (["token"], "an event must be an object"),
    ],
)
def test_a_malformed_event_is_one_schema_error(obj: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        event_from_wire(obj, where="watch")


def test_the_tui_structures_events_and_skips_bad_ones() -> None:
    model = NodeModel()
    model.apply_all(
        [
            event_to_wire(RequestStarted(7, 3, 1)),
            event_to_wire(TokenPassed(7, 0, 5, "Hi")),
            {"type": "token", "request": 7, "index": "1", "token": 6, "text": "!"},  # skipped, counted
            event_to_wire(RequestEnded(7, "eog", 1, None, 1)),
        ]
    )
    view = model.requests[7]
    assert (view.text, view.tokens, view.state, view.reason, view.entry_rank) == ("Hi", 1, "ended", "eog", 1)
    assert (model.events, model.bad_events) == (3, 1)


def test_end_listeners_are_called_in_order_and_a_failing_one_does_not_stop_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    listeners = EndListeners()
    heard: list[tuple[str, int]] = []

    def broken(ended: RequestEnded) -> None:
        raise ValueError("a bookkeeping bug")

    listeners.add(lambda e: heard.append(("a", e.request)))
    listeners.add(broken)
    with listeners.listening(lambda e: heard.append(("b", e.request))):
        listeners.emit(RequestEnded(1, "eog"))
    listeners.emit(RequestEnded(2, "eog"))
    assert heard == [("a", 1), ("b", 1), ("a", 2)]
    assert "request-end listener failed" in caplog.text and len(listeners) == 2


async def test_the_hub_drops_for_a_stuck_observer() -> None:
    hub = EventHub(capacity=4)
    async with hub.subscribe() as stuck:
        for i in range(10):
            hub.publish(TokenPassed(1, i, i, "x"))
        assert hub.dropped == 6
        assert [e.index for e in [stuck.receive_nowait() for _ in range(4)]] == [0, 1, 2, 3]  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------- the flood

WINDOWS = [(0, 2), (2, 4), (4, 6)]
MODEL = "f" * 64


@asynccontextmanager
async def ring() -> AsyncIterator[list[Node]]:
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net, model=MODEL, n_ctx=256, n_seq_max=32)
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                open_node(NodeConfig(manifest, r, node_id=f"node{r}"), stages[r], transport=net, rng=random.Random(r))
            )
            for r in range(len(WINDOWS))
        ]
        await wait_for(lambda: all(n.ready for n in nodes), "the ring to link")
        yield nodes


def coverage(holders: list[str]) -> list[CoverageEntry]:
    return [
        CoverageEntry(MODEL, r, a, b, 1.0, 1.0, 100, "0" * 64, holders[r], None, "serving", f"10.0.0.{r}:1")
        for r, (a, b) in enumerate(WINDOWS)
    ]


def listen(ledger: Ledger, node: Node, ended: RequestEnded) -> None:
    ledger.request_ended(ended, node.rank, node.manifest.size)  # as kvasir.market.agent.session wires it


async def test_a_flooded_hub_loses_no_receipt(autojump_clock: trio.testing.MockClock) -> None:
    """Token events fill a stuck observer's channel; every paid request (its client's authorisation in START) still
    gets a receipt from every window, carrying that authorisation, and an unpaid one gets none (the ledger hears the
    lossless end listeners, not the hub)."""
    holders = ["node0", "node1", "node2"]
    max_tokens, per_entry = 80, 6  # 18 requests × 80 tokens pass every node: beyond the 1,024 slots
    async with ring() as nodes, AsyncExitStack() as stack:
        ledgers = []
        stuck = []
        for node in nodes:
            ledger = Ledger(node.config.node_id)
            ledger.see_holders(coverage(holders), node.rank)
            node.requests.on_end.add(functools.partial(listen, ledger, node))
            ledgers.append(ledger)
            stuck.append(await stack.enter_async_context(node.hub.subscribe()))  # an observer that never reads
        ids: dict[int, int] = {}  # request id -> entry rank
        auths: dict[int, str] = {}  # request id -> its client's authorisation (paid requests)
        client, market = Identity.generate(), Identity.generate()

        async def one(entry: Node, k: int) -> None:
            prompt = [1 + k, 2, 3]
            paid = sign_auth(client, market.public, "0" * 64, max_tokens=max_tokens, max_price=0, not_after=1)
            paid = paid if k % 3 else ""
            params = SamplingParams(temperature=0.0)
            async with entry.request(prompt, params, max_tokens, (), client_auth=paid) as handle:
                ids[handle.request_id] = entry.rank
                if paid:
                    auths[handle.request_id] = paid
                async for ev in entry.events(handle):
                    if isinstance(ev, EndEvent):
                        assert (ev.reason, ev.generated_tokens) == ("max_tokens", max_tokens), ev

        async with trio.open_nursery() as nursery:
            for node in nodes:
                for k in range(per_entry):
                    nursery.start_soon(one, node, k)
        await wait_for(lambda: all(len(n.requests) == 0 for n in nodes), "every request to end everywhere")

        n_requests = len(nodes) * per_entry
        assert len(ids) == n_requests
        for node, channel in zip(nodes, stuck, strict=True):
            # The hub dropped events for the stuck observer, request ends among them: it saw few or none.
            seen_ends = 0
            while True:
                try:
                    seen_ends += isinstance(channel.receive_nowait(), RequestEnded)
                except trio.WouldBlock:
                    break
            assert node.hub.dropped >= n_requests * (max_tokens + 2) - 1024
            assert seen_ends < n_requests
        assert len(auths) == len(nodes) * 4
        for rank, ledger in enumerate(ledgers):
            got: dict[int, Receipt] = {r.request: r for r in ledger.receipts}
            assert set(got) == set(auths), f"rank {rank} lost receipts"
            assert all(got[r].tokens == max_tokens and got[r].holders == tuple(holders) for r in got)
            assert all(got[r].client_auth == auths[r] for r in got)
