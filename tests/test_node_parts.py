"""The node's parts at their seams: the one end-of-generation decision, the one exception-to-code mapping (through a
real node on FakeStages under MockClock), and the last rank's sampler built inside ``Stage.run`` (off the event loop
with a real stage).

The request path itself is tests/test_node_flow.py (fakes) and tests/test_ring.py (llama.cpp over TCP).
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any, TypeVar

import pytest
import trio
import trio.testing

from kvasir.core.errors import (
    InputError,
    InvalidRequest,
    KvasirError,
    ProtocolError,
    RequestRefused,
    RingError,
    StageError,
)
from kvasir.core.stops import Ending, ending
from kvasir.ring.failover import ReplayMismatch
from kvasir.ring.linkmgr import SuccessorLost
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.outbox import error_code
from kvasir.ring.requests import ClientEvent, EndEvent
from kvasir.testing.fakestage import FakeSampler, FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.wire import ErrorCode, SamplingParams
from tests.streams import wait_for

T = TypeVar("T")
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 9, 17, 33]
WINDOWS = [(0, 2), (2, 4), (4, 6)]


def test_the_end_of_a_generation_is_decided_in_generates_order() -> None:
    def end(**kw: Any) -> Ending | None:
        return ending(**{"eog": False, "text": "", "stops": (), "generated": 1, "max_tokens": 4, **kw})

    assert end() is None
    assert end(eog=True, text="a STOP", stops=("STOP",), generated=4) is Ending.EOG  # eog first: nothing emitted
    assert end(text="a STOP", stops=("STOP",), generated=4) is Ending.STOP  # a stop string before max tokens
    assert end(text="a STO", stops=("STOP",), generated=4) is Ending.MAX_TOKENS
    assert end(text="a STO", stops=("", "STOP"), generated=3) is None  # an empty stop string matches nothing
    assert {e.value for e in Ending} == {"eog", "stop", "max_tokens"}  # the wire's EndReason names, lower case


def test_every_exception_that_stops_a_request_has_one_code() -> None:
    cases: list[tuple[BaseException, ErrorCode]] = [
        (RequestRefused(ErrorCode.OVERLOADED, "no free sequence"), ErrorCode.OVERLOADED),
        (InvalidRequest(ErrorCode.CONTEXT_FULL, "too long"), ErrorCode.CONTEXT_FULL),
        (ReplayMismatch(ErrorCode.REPLAY_MISMATCH, "differs"), ErrorCode.REPLAY_MISMATCH),
        (RingError("no link to the successor for 30 s"), ErrorCode.LINK_LOST),
        (SuccessorLost("the successor link was lost"), ErrorCode.LINK_LOST),
        (StageError("llama_decode failed"), ErrorCode.STAGE_FAILED),
        (InputError("only the first stage takes token ids"), ErrorCode.STAGE_FAILED),
        (KvasirError("anything else of ours"), ErrorCode.STAGE_FAILED),
        (ProtocolError("a malformed frame"), ErrorCode.PROTOCOL),
        (ValueError("a bug"), ErrorCode.INTERNAL),
    ]
    assert [error_code(exc) for exc, _ in cases] == [code for _, code in cases]


@asynccontextmanager
async def ring(last: FakeStage | None = None) -> AsyncIterator[list[Node]]:
    """A ring of FakeStages (``last``: the last rank's own)."""
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net)
    stages[-1] = last or stages[-1]
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                open_node(NodeConfig(manifest, r, node_id=f"node{r}"), stages[r], transport=net, rng=random.Random(r))
            )
            for r in range(len(WINDOWS))
        ]
        await wait_for(lambda: all(n.ready for n in nodes), "the ring to link")
        yield nodes


async def fail_with(node: Node, exc: Exception) -> list[ClientEvent]:
    """A request entering at ``node``, stopped there by ``exc`` inside the node's one mapping place."""
    async with node.request(PROMPT, GREEDY, 50) as handle:
        async with node.outbox.fails(handle.request_id):
            raise exc
        async with aclosing(node.events(handle)) as events:
            return [ev async for ev in events]


@pytest.mark.parametrize(
    ("exc", "code", "round_the_ring"),
    [
        (RingError("no link to the successor for 30 s"), "link_lost", False),
        (StageError("llama_decode failed"), "stage_failed", True),
        (InvalidRequest(ErrorCode.BAD_REQUEST, "token 999 outside the vocabulary"), "bad_request", True),
        (ValueError("a bug"), "internal", True),
    ],
)
async def test_a_request_stopped_at_a_node_ends_with_its_code(
    autojump_clock: trio.testing.MockClock, exc: Exception, code: str, round_the_ring: bool
) -> None:
    """A lost link is LINK_LOST, never STAGE_FAILED, and only that one stays local (no link to send an ERROR on: the
    failover timers tell the ring); the others go round the ring as an ERROR and every node frees the request."""
    async with ring() as nodes:
        errors = [n.status().requests.errors for n in nodes]
        events = await fail_with(nodes[0], exc)
        end = events[-1]
        assert isinstance(end, EndEvent) and end.reason == "error" and end.code == code, end
        assert end.error == str(exc)
        assert nodes[0].status().requests.errors == errors[0] + 1
        if round_the_ring:
            await wait_for(lambda: [n.status().requests.free_sequences for n in nodes] == [2, 2, 2], "all freed")
            assert [n.status().requests.errors for n in nodes][1:] == errors[1:]  # they pass it on, not originate
        else:
            assert len(nodes[0].requests) == 0
        # The ring goes on serving.
        _tokens, done = await answer(nodes[1], 4)
        assert done.reason == "max_tokens"


async def answer(node: Node, max_tokens: int) -> tuple[list[int], EndEvent]:
    tokens: list[int] = []
    async with node.request(PROMPT, GREEDY, max_tokens) as handle, aclosing(node.events(handle)) as events:
        async for ev in events:
            if isinstance(ev, EndEvent):
                return tokens, ev
            if ev.token >= 0:
                tokens.append(ev.token)
    raise AssertionError("no end event")


class RunTrackingStage(FakeStage):
    """Records whether each sampler was built inside ``run`` (a real Stage's worker thread) or on the loop."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.in_run = False
        self.built: list[bool] = []

    def new_sampler(self, params: SamplingParams) -> FakeSampler:
        self.built.append(self.in_run)
        return super().new_sampler(params)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        def inside() -> T:
            self.in_run = True
            try:
                return fn(*args)
            finally:
                self.in_run = False

        return await super().run(inside)


async def test_the_last_rank_builds_each_sampler_inside_stage_run(autojump_clock: trio.testing.MockClock) -> None:
    """Building the sampler chain feeds it the whole prompt: the last rank does it in the worker-thread call of the
    request's first sample, never on the event loop, and the answer is the same."""
    last = RunTrackingStage(*WINDOWS[-1], WINDOWS[-1][1], model_sha256="f" * 64)
    async with ring(last) as nodes:
        for entry in (nodes[0], nodes[2]):
            tokens, end = await answer(entry, 5)
            assert tokens == expected_tokens(PROMPT, 5) and end.reason == "max_tokens"
    assert last.built == [True, True]


async def test_a_protocol_error_while_handling_a_frame_fails_its_request_not_the_link(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Issue 24, N3: nothing a frame's handling raises goes on to the link task. A ProtocolError there (a frame built
    from the request beyond a wire limit; malformed frames are refused by the decoder before) fails that request
    with PROTOCOL round the ring; the block raises nothing, and the link stays."""
    async with ring() as nodes, nodes[0].request(PROMPT, GREEDY, 50) as handle:
        link = nodes[0].links.successor
        async with nodes[0].outbox.fails(handle.request_id):
            raise ProtocolError("a TOKEN past the largest position")
        assert nodes[0].requests.get(handle.request_id) is None
        events = [ev async for ev in nodes[0].events(handle)]
        assert isinstance(events[-1], EndEvent) and events[-1].code == "protocol", events[-1]
        assert nodes[0].links.successor is link
