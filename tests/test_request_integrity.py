"""Requests are what the client asked (issue 24 item 2; security review 2, N3 and N8): a member of a real ring on
loopback (three in-process nodes on real llama.cpp windows of the tiny llama, linked over TCP) rewrites the START it
forwards; the ring refuses or the entry fails the request with PARAMS_MISMATCH, the entry never streams or counts a
token past what its client asked, and an honest client of the same ring still gets the whole model's exact answer.

The hostile member is rank 1 with its link's ``send`` replaced: it rewrites the START of the victim's requests (those
asking ``VICTIM_MAX`` tokens) on their way to the last rank and passes everything else on untouched. A naive member
changes the parameters only; a careful one recomputes the parameters hash too (it knows the canonical encoding).
"""

from __future__ import annotations

import operator
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from kvasir.core.identity import Identity
from kvasir.local.launcher import free_ports
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.record import NodeRecorder
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.shard.cache import model_sha256, stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.verify.audit import read_json
from kvasir.verify.commit import WindowReceipt
from kvasir.wire import Frame, SamplingParams, StartRequest, request_params_hash

WINDOWS = [(0, 2), (2, 4), (4, 6)]
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 9, 17, 33]
N_CTX = 256
#: The victim's requests ask this many tokens (the member tampers with those only); honest ones ask HONEST_MAX.
VICTIM_MAX = 4
HONEST_MAX = 12


def reference(model: Path, max_tokens: int, stop: tuple[str, ...] = ()) -> tuple[list[int], str]:
    """The whole model in one llama.cpp context, greedy: the exact answer."""
    with Stage.load(StageConfig(model, n_ctx=N_CTX, n_seq_max=1, n_threads=1)) as stage:
        result = LocalPipeline([stage]).generate(PROMPT, GREEDY, max_tokens, stop=stop)
        return result.tokens, result.text


@asynccontextmanager
async def three_nodes(
    model: Path, cache_dir: Path, record: Path | None = None, *, required: bool = False
) -> AsyncIterator[list[Node]]:
    """The tiny llama's three windows as in-process nodes linked over loopback TCP (each recording into ``record``
    when given; ``required``: recording required, as in a market ring)."""
    paths = stage_files(model, WINDOWS, cache_dir)
    ports = free_ports(3)
    ranks = tuple(RankEntry(r, a, b, "127.0.0.1", ports[r]) for r, (a, b) in enumerate(WINDOWS))
    manifest = Manifest(model_sha256(model, cache_dir), 6, ranks, model_name="tiny")
    stages = [
        await trio.to_thread.run_sync(Stage.load, StageConfig(p, n_ctx=N_CTX, n_seq_max=4, n_threads=1)) for p in paths
    ]
    try:
        for s in stages:
            await trio.to_thread.run_sync(operator.attrgetter("vocab"), s)
        async with AsyncExitStack() as stack:
            nodes = []
            for r, stage in enumerate(stages):
                recorder = None
                if record is not None:
                    recorder = NodeRecorder(
                        record, Identity.generate(), manifest.model_sha256, WINDOWS[r], "TEST-0", required=required
                    )
                config = NodeConfig(manifest, r, node_id=f"node{r}", link_wait=5.0)
                nodes.append(await stack.enter_async_context(open_node(config, stage, recorder=recorder)))
            with trio.fail_after(30):
                while not all(n.ready for n in nodes):  # noqa: ASYNC110 (no event for it)
                    await trio.sleep(0.01)
            yield nodes
    finally:
        for s in stages:
            s.close()


def rewrite_starts(
    node: Node, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any], *, rehash: bool, victim: int = VICTIM_MAX
) -> list[int]:
    """Make ``node`` a member that rewrites each START it forwards that asks ``victim`` tokens with ``change`` (and,
    ``rehash``, its parameters hash to match); returns the ids of the requests it altered."""
    send = node.links.send
    altered: list[int] = []

    async def rewrite(frame: Frame) -> None:
        if isinstance(frame, StartRequest) and frame.max_tokens == victim:
            frame = attrs.evolve(frame, **change)
            if rehash:
                frame = attrs.evolve(frame, params_hash=request_params_hash(frame))
            altered.append(frame.request_id)
        await send(frame)

    monkeypatch.setattr(node.links, "send", rewrite)
    return altered


async def ask(
    node: Node, max_tokens: int, stop: tuple[str, ...] = (), params: SamplingParams = GREEDY
) -> tuple[list[TokenEvent], EndEvent]:
    """One client request, read to its end: its token events and its end."""
    tokens: list[TokenEvent] = []
    with trio.fail_after(60):
        async with node.request(PROMPT, params, max_tokens, stop) as handle, aclosing(node.events(handle)) as events:
            async for ev in events:
                if isinstance(ev, EndEvent):
                    return tokens, ev
                tokens.append(ev)
    raise AssertionError("no end event")


async def all_freed(nodes: list[Node]) -> None:
    with trio.fail_after(30):
        while any(len(n.requests) for n in nodes):  # noqa: ASYNC110
            await trio.sleep(0.01)


async def honest_answer(nodes: list[Node], expected: list[int], expected_text: str, entry: int = 0) -> None:
    """An honest client of the same ring (entering at rank ``entry``), through the same member: the whole model's
    exact answer."""
    tokens, end = await ask(nodes[entry], HONEST_MAX)
    assert end.reason == "max_tokens" and end.error is None, end
    assert [t.token for t in tokens if t.index >= 0] == expected
    assert end.text == expected_text and end.generated_tokens == HONEST_MAX


@pytest.mark.parametrize(
    "change",
    [
        {"sampling": SamplingParams(temperature=1.5, seed=7)},
        {"max_tokens": 40},
        {"stop": ()},
        {"speculate": 4},
    ],
    ids=["sampling", "max_tokens", "stops", "speculate"],
)
async def test_a_member_that_rewrites_start_is_refused_by_the_next_node(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch, change: dict[str, Any]
) -> None:
    """N8, a member changing START's sampling, max_tokens, stops or speculate on its way. It used to work: the last
    rank sampled with what it got (the review's client saw garbage at temperature 1.5, or 40 tokens for 4, billed as
    40), no error, and with --record the last rank signed the altered sampling. Now the next node recomputes the
    parameters hash, refuses the START before it takes a sequence (PARAMS_MISMATCH), and the client hears so before
    any token; an honest client of the same ring gets its exact answer."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir) as nodes:
        altered = rewrite_starts(nodes[1], monkeypatch, change, rehash=False)
        tokens, end = await ask(nodes[0], VICTIM_MAX, ("\n\n",))
        assert altered and end.reason == "error" and end.code == "params_mismatch", end
        assert "rank 2" in (end.error or "") and "altered on the way" in (end.error or "")
        assert tokens == [] and end.generated_tokens == 0
        await honest_answer(nodes, expected, text)
        await all_freed(nodes)


async def test_a_consistent_rewrite_is_caught_at_the_entry_and_signed_by_the_last_rank(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """N8, a careful member: it rewrites the sampling (temperature 1.5) and recomputes the parameters hash, so the
    last rank finds the START consistent and samples with it. It used to be undetectable (answers changed, 0 errors,
    the last rank's receipt signed ``temperature 1.5``). Now END echoes the hash the last rank served, the entry
    compares it with its own commitment and fails the request (PARAMS_MISMATCH); the receipts make it attributable:
    the member's own receipt signs the entry's hash as received, the last rank's the altered one, over a link bound
    to the member's key. The honest client's answer is the whole model's."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir, tmp_path) as nodes:
        altered = rewrite_starts(
            nodes[1], monkeypatch, {"sampling": SamplingParams(temperature=1.5, seed=7)}, rehash=True
        )
        committed: list[bytes] = []
        request = nodes[0].request

        @asynccontextmanager
        async def noting(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            async with request(*args, **kwargs) as handle:
                state = nodes[0].requests.get(handle.request_id)
                assert state is not None
                committed.append(state.start.params_hash)
                yield handle

        monkeypatch.setattr(nodes[0], "request", noting)
        tokens, end = await ask(nodes[0], VICTIM_MAX)
        assert altered and end.reason == "error" and end.code == "params_mismatch", end
        assert "the last rank served other parameters" in (end.error or "")
        assert len(tokens) <= VICTIM_MAX and end.generated_tokens <= VICTIM_MAX
        await honest_answer(nodes, expected, text)
        await all_freed(nodes)
    receipts = [WindowReceipt.from_wire(read_json(p)) for p in (tmp_path / "receipts").glob(f"{altered[0]:016x}-*")]
    by_window = {r.start: r for r in receipts}
    assert sorted(by_window) == [0, 2, 4]
    for r in receipts:
        r.verify()
    assert by_window[0].params_hash == by_window[2].params_hash == committed[0].hex()  # what the member received
    last = by_window[4]
    assert last.params_hash != committed[0].hex() and last.sampling is not None and last.sampling.temperature == 1.5
    honest = [WindowReceipt.from_wire(read_json(p)) for p in (tmp_path / "receipts").glob("*-4-6.json")]
    assert all(r.params_hash == committed[1].hex() for r in honest if r.request != altered[0])


async def test_a_last_rank_that_forwards_another_prompt_is_caught_by_rank_0(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N8, the prompt: a request entering at rank 1 reaches rank 0 (which embeds the prompt) through the last rank.
    A last rank that serves the START it got but forwards rank 0 other prompt ids, with a parameters hash to match,
    used to make the ring answer another prompt unseen. Now rank 0 compares the hash the last rank echoes in END with
    its own START's and fails the request (PARAMS_MISMATCH, from rank 0); an honest client entering at rank 1 gets
    the whole model's answer."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir) as nodes:
        altered = rewrite_starts(nodes[2], monkeypatch, {"prompt": tuple(reversed(PROMPT))}, rehash=True)
        tokens, end = await ask(nodes[1], VICTIM_MAX)
        assert altered and end.reason == "error" and end.code == "params_mismatch", end
        assert "rank 0: the last rank served other parameters" in (end.error or "")
        assert len(tokens) <= VICTIM_MAX
        await all_freed(nodes)
        await honest_answer(nodes, expected, text, entry=1)


async def _lengthened(
    nodes: list[Node], monkeypatch: pytest.MonkeyPatch, client: Callable[[Node], Awaitable[None]]
) -> list[int]:
    altered = rewrite_starts(nodes[1], monkeypatch, {"max_tokens": 100}, rehash=True)
    await client(nodes[0])
    assert altered
    return altered


async def test_a_lengthened_request_ends_at_the_clients_max_tokens(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N8 (``maxtokens``): a careful member raises max_tokens from 4 to 100. It used to stream and bill 40 tokens
    for 4 (``usage completion_tokens 40``). Now the entry stops at the client's 4: exactly the whole model's first 4
    tokens reach the client, the fifth fails the request (PARAMS_MISMATCH) and is neither streamed nor counted, and
    the ring frees the request everywhere."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir) as nodes:
        seen: dict[str, Any] = {}

        async def reader(node: Node) -> None:
            seen["tokens"], seen["end"] = await ask(node, VICTIM_MAX)

        await _lengthened(nodes, monkeypatch, reader)
        end = seen["end"]
        assert end.reason == "error" and end.code == "params_mismatch", end
        assert "the ring sent token 4 past the client's max_tokens 4" in (end.error or "")
        assert [t.token for t in seen["tokens"] if t.index >= 0] == expected[:VICTIM_MAX]
        assert end.generated_tokens == VICTIM_MAX
        await all_freed(nodes)
        await honest_answer(nodes, expected, text)


async def test_a_client_that_stops_reading_cannot_crash_the_entry(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N3: a member lengthens a request (4 → 100 tokens) and its streaming client reads nothing. The entry used to
    push every token into a channel sized for the client's max_tokens: the (max_tokens + 3)th raised trio.WouldBlock
    out of EntryStream.push into the link task, and the entry node's process died 3 s after the request (review 2 at
    de6f35e, ``probe_member.py RUN slowclient``); since the outbox catches what a frame raises, the node lived but the
    client found 6 tokens for its 4 and an ``internal`` error. Now nothing past max_tokens is pushed, so the channel
    never fills: the request fails alone (PARAMS_MISMATCH), the node serves on, and the client that finally reads
    finds exactly its 4 tokens and the error."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir) as nodes:
        events: list[Any] = []

        async def idle_client(node: Node) -> None:
            with trio.fail_after(60):
                async with node.request(PROMPT, GREEDY, VICTIM_MAX) as handle:
                    while node.requests.get(handle.request_id) is not None:  # noqa: ASYNC110 (reads nothing meanwhile)
                        await trio.sleep(0.01)
                    await trio.sleep(0.5)  # the ring's frames that were already on their way arrive too
                    async for ev in node.events(handle):
                        events.append(ev)

        await _lengthened(nodes, monkeypatch, idle_client)
        assert [ev.token for ev in events if isinstance(ev, TokenEvent) and ev.index >= 0] == expected[:VICTIM_MAX]
        assert isinstance(events[-1], EndEvent) and events[-1].code == "params_mismatch", events[-1]
        await all_freed(nodes)
        await honest_answer(nodes, expected, text)


def stop_string(model: Path) -> str:
    """A stop string the whole model's greedy answer meets a few tokens in: the text of one of its tokens."""
    with Stage.load(StageConfig(model, n_ctx=N_CTX, n_seq_max=1, n_threads=1)) as stage:
        for token in LocalPipeline([stage]).generate(PROMPT, GREEDY, 60).tokens[2:]:
            piece = stage.vocab.piece(token).decode("utf-8", "replace")
            if piece.isascii() and piece.isprintable() and piece.strip():
                return piece
    raise AssertionError("no printable token in the answer")


async def test_a_dropped_stop_string_ends_the_request_at_the_clients_stop(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N8 (stops): a careful member drops the client's stop strings. The ring used to generate on to max_tokens,
    streaming and counting every token past the stop. Now the entry sees its client's stop in the text: the client
    gets the whole model's text up to the stop, and the next token fails the request (PARAMS_MISMATCH) without being
    streamed or counted."""
    model = tiny_model("llama", "f32")
    stop = await trio.to_thread.run_sync(stop_string, model)
    expected, text = await trio.to_thread.run_sync(reference, model, 60, (stop,))
    honest, honest_text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    assert len(expected) < 60  # the stop ends the whole model's answer early
    async with three_nodes(model, cache_dir) as nodes:
        altered = rewrite_starts(nodes[1], monkeypatch, {"stop": ()}, rehash=True, victim=60)
        tokens, end = await ask(nodes[0], 60, (stop,))
        assert altered and end.reason == "error" and end.code == "params_mismatch", end
        assert "past the client's stop string" in (end.error or "")
        assert [t.token for t in tokens if t.index >= 0] == expected
        assert end.text == text and end.generated_tokens == len(expected)
        await all_freed(nodes)
        await honest_answer(nodes, honest, honest_text)


async def test_a_members_injected_start_never_closes_an_honest_link(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """A neighbour's frames never raise into a link task. Review 2, N21: the last rank (a member) injects a START of
    its own whose entry node id is one byte long; rank 0 forwards it to rank 1 without the prompt's ids, a 67-byte
    body every decoder used to refuse (``body length 67 invalid``), so rank 1 closed its honest predecessor link to
    rank 0, and again at each replay of that START after a relink: the honest client got no answer (60 s). Now the
    frame decodes: the
    injected request is served (or refused) alone, the link 0 → 1 stays the same link, and an honest client gets the
    whole model's answer."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir) as nodes:
        link = nodes[1].links.predecessor
        errors = nodes[1].requests.errors
        forged = StartRequest(0x5EED, tuple(PROMPT), 8, 2, "x", GREEDY)
        await nodes[2].links.send(forged)
        with trio.fail_after(30):
            while nodes[1].requests.get(forged.request_id) is None:  # noqa: ASYNC110
                await trio.sleep(0.01)
        await honest_answer(nodes, expected, text)
        assert nodes[1].links.predecessor is link and nodes[1].requests.errors == errors
