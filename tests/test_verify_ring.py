"""A real ring that records: node processes with ``--record DIR`` on real llama.cpp (tiny llama, 3 windows) write
signed receipts and spool their inputs; answers stay the whole model's; the receipts chain link to link; the
auditor's key selects a fraction and every selected window re-executes to the same bytes.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from kvasir.core.identity import Identity
from kvasir.core.sampling import SamplingParams
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.record import NodeRecorder
from kvasir.shard.cache import stage_files
from kvasir.testing.fakestage import FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.verify.audit import WindowLog, audit_window, legitimate_skips, read_json, skipped_steps
from kvasir.verify.commit import (
    NO_TOKEN,
    VerificationError,
    WindowReceipt,
    first_mismatch,
    successor_mismatch,
)
from kvasir.verify.select import key_commitment, new_key, reveal, selected, selection_value
from kvasir.wire import CHAIN_BYTES, FLAG_CHAIN, Boundary, Frame
from tests.conftest import run_cli
from tests.ringutil import ring_generate, running_ring, whole_model_tokens
from tests.streams import wait_for

WINDOWS = [(0, 2), (2, 4), (4, 6)]
GREEDY_PARAMS = SamplingParams.GREEDY
PROMPT = "The ring passes the hidden state on, window after window, " * 3


def _wait_receipts(directory: Path, n: int, timeout: float = 30.0) -> list[Path]:
    deadline = time.monotonic() + timeout
    while True:
        found = sorted((directory / "receipts").glob("*.json"))
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_selection_is_a_keyed_fraction() -> None:
    key, other = new_key(), new_key()
    ids = range(1, 20001)
    picked = [i for i in ids if selected(key, i, (2, 4), 0.02)]
    assert 300 <= len(picked) <= 500  # 2 % of 20000, within 5 sigma
    # Another key, or another window of the same request, is another draw.
    assert picked != [i for i in ids if selected(other, i, (2, 4), 0.02)]
    assert picked != [i for i in ids if selected(key, i, (4, 6), 0.02)]
    assert all(0.0 <= selection_value(key, i, (0, 2)) < 1.0 for i in range(100))
    assert not any(selected(key, i, (0, 2), 0.0) for i in ids) and all(selected(key, i, (0, 2), 1.0) for i in ids)


def _five_requests(rec: NodeRecorder) -> None:
    payload = bytes(range(256)) * 4
    for request in range(1, 6):
        rec.begin(request, last=False, sampling=GREEDY_PARAMS, history=())
        rec.on_input(request, 0, 1, 0, payload)
        rec.on_output(request, 0, 1, 0, payload)
        rec.on_input(request, 1, 1, 0, payload)  # the request ends before this step's output
        done = rec.end(request)
        assert done is not None
        rec.write(done)


def test_the_spool_is_bounded_and_an_interrupted_step_is_not_signed(tmp_path: Path) -> None:
    identity = Identity.generate()
    probe = NodeRecorder(tmp_path / "probe", identity, "ab" * 32, (2, 4), "CPU-0")
    _five_requests(probe)
    one = probe.spool_bytes // 5  # the logs differ only in their request id: the same size
    rec = NodeRecorder(tmp_path, identity, "ab" * 32, (2, 4), "CPU-0", keep_bytes=2 * one + one // 2)
    _five_requests(rec)
    assert rec.written == 5 and rec.evicted == 3 and rec.spool_bytes == 2 * one
    assert len(list((tmp_path / "receipts").glob("*.json"))) == 5  # receipts stay; only spooled inputs go
    kept = sorted((tmp_path / "pending").glob("*.log.json"))
    assert [p.name[:16] for p in kept] == [f"{4:016x}", f"{5:016x}"]
    log = WindowLog.from_wire(read_json(kept[-1]))
    log.receipt.verify()
    assert log.receipt.schedule == ((0, 1),) and len(log.inputs) == 1  # signed up to its last complete step
    # A node that restarts on the same directory counts the spool it left.
    assert NodeRecorder(tmp_path, identity, "ab" * 32, (2, 4), "CPU-0").spool_bytes == rec.spool_bytes
    rec.begin(9, last=False, sampling=GREEDY_PARAMS, history=())
    assert rec.end(9) is None  # nothing computed here: nothing to sign
    # The key's reveal decides by the logs' names: at f = 0 every spooled log goes, every receipt stays.
    key = new_key()
    done = reveal(tmp_path, key, 0.0)
    assert (done.selected, done.dropped) == ((), 2) and not list((tmp_path / "pending").iterdir())
    assert len(list((tmp_path / "receipts").glob("*.json"))) == 5


async def test_a_replay_after_a_broken_link_is_recorded_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """FakeStages over memory streams: the link 1 -> 2 breaks mid-answer and rank 1 replays into rank 2, which drops
    what it had seen. Every rank's receipt still lists each position once, and the windows' hashes chain."""
    from tests.test_failover_flow import PROMPT, answer
    from tests.test_failover_flow import WINDOWS as FOUR

    async with trio.open_nursery() as nursery:
        nodes = await _recording_ring(nursery, tmp_path, [True] * 4)

        async def cut() -> None:
            link = nodes[1].links.successor
            assert link is not None
            await link.aclose()

        tokens, end = await answer(nodes[0], 20, 5, cut)
        assert tokens == expected_tokens(PROMPT, 20) and end.reason == "max_tokens"
        assert nodes[1].failover.replays == 1 and nodes[2].failover.duplicates >= 1
        await wait_for(lambda: all(len(n.requests) == 0 for n in nodes), "every node to end the request")
        nursery.cancel_scope.cancel()  # the receipts' writes are shielded: they finish first
    receipts = [WindowReceipt.from_wire(read_json(p)) for p in sorted((tmp_path / "receipts").glob("*.json"))]
    assert len(receipts) == 4
    by_start = {r.start: r for r in receipts}
    for r in receipts:
        r.verify()
        positions = [pos for pos, _ in r.schedule]
        assert positions == sorted(set(positions)), "a replayed frame was recorded twice"
        assert positions == [0, *range(len(PROMPT), len(PROMPT) + 19)]  # the prompt, then 19 decode steps
    for (a, _), (b, _) in itertools.pairwise(FOUR):
        assert first_mismatch(by_start[a].output_hashes, by_start[b].input_hashes) is None
    assert by_start[6].tokens[-1] == tokens[-1]
    # The live chain check ran on every boundary taken once (the replayed duplicates were dropped before it).
    for rank, node in enumerate(nodes[1:], 1):
        assert node.recorder is not None and node.recorder.mismatches == 0
        assert node.recorder.checked == len(by_start[FOUR[rank][0]].input_hashes)


async def test_a_recording_ring_records_speculative_requests_row_by_row(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording nodes and a speculative request (verify batches and rollbacks): the answer is generate
    --speculate's; every verify row is a step of its own in every receipt (rank 0: one token each), stamped with its
    sender's chain head and checked by its successor; the receipts link window to window; the last rank's rows behind
    a rejected draft are skipped steps, each rolled back by the next step (what an audit accepts without computing)."""
    from tests.test_ring_speculate_flow import PERIOD, WINDOWS, answer, reference

    want, schedule = reference(4, 30)
    stages: list[FakeStage] = []
    sent: list[list[Boundary]] = [[], [], []]
    async with trio.open_nursery() as nursery:
        nodes = await _recording_ring(nursery, tmp_path, [True] * 4, WINDOWS, stages, period=PERIOD)
        for rank in range(3):
            await _sent_boundaries(nodes[rank], sent[rank], monkeypatch)
        assert await answer(nodes[0], 30, speculate=4) == want
        # It did speculate: the reference's rows and truncations (the reference made verify batches).
        assert [(s.forwards, s.truncations) for s in stages] == [(f, t) for _, _, f, t in schedule]
        assert schedule[-1][0] > 0 and schedule[0][3] > 0
        await wait_for(lambda: len(list((tmp_path / "receipts").glob("*.json"))) == 4, "the request's receipts")
        nursery.cancel_scope.cancel()
    receipts = {r.start: r for r in map(WindowReceipt.from_wire, map(read_json, (tmp_path / "receipts").glob("*")))}
    chain = [receipts[a] for a, _ in WINDOWS]
    for r in chain:
        r.verify()
    for pred, succ in itertools.pairwise(chain):
        assert first_mismatch(pred.output_hashes, succ.input_hashes) is None
    # One step per row: the frames each window sent (every row computed there), each with its chain head.
    for rank in range(3):
        assert len(chain[rank].schedule) == len(sent[rank]) == stages[rank].forwards
        assert all(n == 1 for _, n in chain[rank].schedule[1:])  # after the prompt: one row a step
        assert all(len(b.chain) == CHAIN_BYTES for b in sent[rank])
        assert [b.position for b in sent[rank]] == [p for p, _ in chain[rank].schedule]
    assert any(b.drafts and b.row > 0 for b in sent[0])  # verify rows past row 0 were recorded
    last = chain[-1]
    skipped = skipped_steps(last)
    # The last rank computed all but its skipped rows, and skipped some: they are the stale rows it dropped.
    assert sum(skipped) > 0 and len(skipped) - sum(skipped) == stages[-1].forwards
    assert legitimate_skips(last.schedule, skipped) == skipped
    assert [t for t, s in zip(last.tokens, skipped, strict=True) if s] == [NO_TOKEN] * sum(skipped)
    recorders = [n.recorder for n in nodes]
    assert all(r is not None and r.mismatches == 0 for r in recorders)
    assert [r.checked for r in recorders if r is not None] == [0, *(len(c.schedule) for c in chain[1:])]


async def test_a_speculative_request_replayed_after_a_broken_link_is_recorded_once(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """As above with verify rows: the link 1 -> 2 breaks mid-answer of a speculative request and rank 1 replays
    its rows into rank 2, which drops those it had. The answer is generate --speculate's; each rank's receipt lists
    one step per row it computed (the last rank: per row it took, skipped ones included), and the hashes chain."""
    from tests.test_ring_speculate_flow import PERIOD, WINDOWS, answer, reference

    want, _ = reference(4, 30)
    stages: list[FakeStage] = []
    async with trio.open_nursery() as nursery:
        nodes = await _recording_ring(nursery, tmp_path, [True] * 4, WINDOWS, stages, period=PERIOD)

        async def cut() -> None:
            link = nodes[1].links.successor
            assert link is not None
            await link.aclose()

        assert await answer(nodes[0], 30, at_token=8, fault=cut, speculate=4) == want
        assert nodes[1].failover.replays == 1 and nodes[2].failover.duplicates >= 1
        await wait_for(lambda: len(list((tmp_path / "receipts").glob("*.json"))) == 4, "the request's receipts")
        nursery.cancel_scope.cancel()
    chain = sorted(
        map(WindowReceipt.from_wire, map(read_json, (tmp_path / "receipts").glob("*"))), key=lambda r: r.start
    )
    for r in chain:
        r.verify()
    for pred, succ in itertools.pairwise(chain):
        assert first_mismatch(pred.output_hashes, succ.input_hashes) is None
    for rank in range(3):  # nothing twice: one step per forward (a replayed row is dropped before it is taken)
        assert len(chain[rank].schedule) == stages[rank].forwards
    last = chain[-1]
    skipped = skipped_steps(last)
    assert len(skipped) - sum(skipped) == stages[-1].forwards
    assert legitimate_skips(last.schedule, skipped) == skipped
    assert all(n.recorder is not None and n.recorder.mismatches == 0 for n in nodes)


async def test_rows_in_flight_when_a_speculative_request_ends_break_no_link(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """EOG sampled inside a verify batch: the last rank ends the request there and drops the rows still on their way,
    which its predecessor sent and signed. Those outputs nobody took are not a broken link: the successor check
    holds the successor's inputs against the start of the predecessor's outputs, and every window audits as usual."""
    from tests.test_ring_speculate_flow import PERIOD, WINDOWS, reference
    from tests.test_ring_speculate_flow import answer as spec_answer

    want, _ = reference(6, 60, eog_at=47)
    async with trio.open_nursery() as nursery:
        nodes = await _recording_ring(nursery, tmp_path, [True] * 4, WINDOWS, period=PERIOD, eog_at=47)
        assert await spec_answer(nodes[0], 60, speculate=6, reason="eog") == want
        await wait_for(lambda: len(list((tmp_path / "receipts").glob("*.json"))) == 4, "the request's receipts")
        nursery.cancel_scope.cancel()
    chain = sorted(
        map(WindowReceipt.from_wire, map(read_json, (tmp_path / "receipts").glob("*"))), key=lambda r: r.start
    )
    # The case at hand: the last window took fewer rows than its predecessor sent.
    assert len(chain[-2].output_hashes) > len(chain[-1].input_hashes)
    inputs = chain[-1].input_hashes
    assert successor_mismatch(chain[-2].output_hashes, inputs) is None
    # Never fewer: an input the predecessor did not sign is a mismatch at that step.
    assert successor_mismatch(chain[-2].output_hashes[: len(inputs)], (*inputs, "0" * 64)) == len(inputs)
    key = new_key()
    done = reveal(tmp_path, key, 1.0, commitment=key_commitment(key))
    assert len(done.selected) == 4 and done.linked == 3 and not done.broken_links


async def _recording_ring(
    nursery: trio.Nursery,
    tmp_path: Path,
    recording: list[bool],
    windows: list[tuple[int, int]] | None = None,
    stages: list[FakeStage] | None = None,
    **stage: Any,
) -> list[Node]:
    """FakeStages over memory streams (by default the four windows of tests/test_failover_flow.py); rank k records
    when ``recording[k]``. ``stages``, if given, receives the ring's FakeStages."""
    from tests.test_failover_flow import WINDOWS as FOUR

    windows = windows or FOUR
    net = MemoryNetwork()
    manifest, made = fake_ring(windows, net, compute_s=0.01, **stage)
    if stages is not None:
        stages.extend(made)
    nodes: list[Node] = []
    for rank, fake in enumerate(made):
        rec = NodeRecorder(tmp_path, Identity.generate(), manifest.model_sha256, windows[rank], "FAKE-0")
        config = NodeConfig(manifest, rank, node_id=f"node{rank}")
        nodes.append(await nursery.start(_run_node, config, fake, net, rec if recording[rank] else None))
    await wait_for(lambda: all(n.ready for n in nodes), "the ring to link")
    return nodes


async def _sent_boundaries(node: Node, sent: list[Boundary], monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every boundary ``node`` hands to its successor link in ``sent``."""
    send = node.links.send

    async def keep(frame: Frame) -> None:
        if isinstance(frame, Boundary):
            sent.append(frame)
        await send(frame)

    monkeypatch.setattr(node.links, "send", keep)


async def test_recording_nodes_stamp_boundaries_with_their_chain_and_successors_check_it(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every boundary a recording node sends carries its output chain head after it (FLAG_CHAIN); its recording
    successor checks each one as it arrives; the answer is the unrecorded ring's. A node that does not record sends
    plain boundaries, and one that does not record ignores the heads it gets."""
    from tests.test_failover_flow import PROMPT, answer

    async def nothing() -> None:
        pass

    async with trio.open_nursery() as nursery:
        nodes = await _recording_ring(nursery, tmp_path, [True, True, False, True])
        sent: list[list[Boundary]] = [[], [], [], []]
        for rank in range(3):
            await _sent_boundaries(nodes[rank], sent[rank], monkeypatch)
        tokens, end = await answer(nodes[0], 12, 1, nothing)
        assert tokens == expected_tokens(PROMPT, 12) and end.reason == "max_tokens"
        await wait_for(lambda: all(len(n.requests) == 0 for n in nodes), "every node to end the request")
        nursery.cancel_scope.cancel()
    n_steps = 1 + 11  # the prompt in one chunk, then a decode step per token but the last
    assert [len(s) for s in sent[:3]] == [n_steps] * 3
    assert all(len(b.chain) == CHAIN_BYTES and FLAG_CHAIN & b.to_wire()[4] for b in sent[0] + sent[1])
    assert not any(b.chain for b in sent[2])  # rank 2 does not record
    receipts = {r.start: r for r in map(WindowReceipt.from_wire, map(read_json, (tmp_path / "receipts").glob("*")))}
    assert sorted(receipts) == [0, 2, 6]
    # The heads sent are the chain each sender signed: the last one is its receipt's output head.
    assert sent[0][-1].chain.hex() == receipts[0].output_head and sent[1][-1].chain.hex() == receipts[2].output_head
    recorders = [n.recorder for n in nodes]
    assert recorders[1] is not None and recorders[1].checked == n_steps  # from recording rank 0
    assert recorders[3] is not None and recorders[3].checked == 0  # rank 2 sent no heads: nothing to check
    assert all(r is None or r.mismatches == 0 for r in recorders)


@pytest.mark.parametrize("successor_records", [True, False])
async def test_a_boundary_that_is_not_what_its_sender_committed_fails_the_request(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, successor_records: bool
) -> None:
    """Rank 1 commits each boundary, then one byte of a decode step's payload flips on its way (after the recorder
    saw it): its recording successor fails the request with CHAIN_MISMATCH at that frame, never computing on it. A
    successor that does not record takes the frame and goes on (nothing tells it)."""
    from tests.test_failover_flow import PROMPT, answer

    async def nothing() -> None:
        pass

    async with trio.open_nursery() as nursery:
        nodes = await _recording_ring(nursery, tmp_path, [True, True, successor_records, True])
        send, bad = nodes[1].links.send, len(PROMPT) + 3

        async def flip(frame: Frame) -> None:
            if isinstance(frame, Boundary) and frame.first_position == bad:
                payload = bytearray(frame.payload)
                payload[5] ^= 0x10
                frame = attrs.evolve(frame, payload=bytes(payload))
            await send(frame)

        monkeypatch.setattr(nodes[1].links, "send", flip)
        tokens, end = await answer(nodes[0], 12, 1, nothing)
        await wait_for(lambda: all(len(n.requests) == 0 for n in nodes), "every node to end the request")
        nursery.cancel_scope.cancel()
    rec = nodes[2].recorder
    if successor_records:
        assert end.reason == "error" and end.code == "chain_mismatch", end
        assert end.error is not None and f"position {bad}" in end.error
        steps = bad - len(PROMPT)  # good decode steps before the bad one
        assert rec is not None and (rec.checked, rec.mismatches) == (1 + steps + 1, 1)  # prompt, good steps, bad one
        assert len(tokens) == 1 + steps  # the tokens sampled before the bad step; none after
    else:
        assert end.reason == "max_tokens" and len(tokens) == 12 and rec is None


async def _run_node(
    config: NodeConfig,
    stage: FakeStage,
    net: MemoryNetwork,
    rec: NodeRecorder | None,
    task_status: trio.TaskStatus[Node],
) -> None:
    async with open_node(config, stage, transport=net, recorder=rec) as node:
        task_status.started(node)
        await trio.sleep_forever()


def test_recording_ring_keeps_answers_and_its_receipts_audit(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model("llama", "f32")
    record = tmp_path / "record"
    want = whole_model_tokens(model, PROMPT, 8)
    with running_ring(model, WINDOWS, cache_dir, extra_args=("--record", str(record))) as ring:
        greedy = [ring_generate(ring.sockets[k], PROMPT, 8) for k in (0, 2)]
        sampled = ring_generate(ring.sockets[1], "Once upon a time", 6, temperature=0.8, seed=77)
        files = _wait_receipts(record, 9)
    assert [g["tokens"] for g in greedy] == [want, want]  # recording never changes an answer
    assert len(sampled["tokens"]) == 6
    assert len(files) == 9  # 3 requests x 3 windows
    receipts = [WindowReceipt.from_wire(read_json(p)) for p in files]
    by_request: dict[int, dict[int, WindowReceipt]] = {}
    for r in receipts:
        r.verify()  # signed by the node's key, heads are the chains of the listed hashes
        by_request.setdefault(r.request, {})[r.start] = r
    assert len(by_request) == 3 and len({r.node_key for r in receipts}) == 3
    for chain in by_request.values():
        # The successor check: each window's input hashes are its predecessor's output hashes, step for step.
        assert first_mismatch(chain[0].output_hashes, chain[2].input_hashes) is None
        assert first_mismatch(chain[2].output_hashes, chain[4].input_hashes) is None
        assert chain[4].last and chain[4].tokens[-1] >= 0
    # Spooled inputs wait for the key; a key that is not the committed one is refused.
    assert len(list((record / "pending").glob("*.log.json"))) == 9
    key = new_key()
    with pytest.raises(VerificationError, match="commitment"):
        reveal(record, key, 1.0, commitment=key_commitment(new_key()))
    (record / "pending" / "notes.log.json").write_text("{}")  # not named like a log: left alone
    done = reveal(record, key, 1.0, commitment=key_commitment(key))
    assert done.skipped == (record / "pending" / "notes.log.json",)
    assert len(done.selected) == 9 and done.dropped == 0 and done.linked == 6 and not done.broken_links
    assert [p.name for p in (record / "pending").glob("*")] == ["notes.log.json"]
    stages = stage_files(model, WINDOWS, cache_dir)
    for path in done.selected:
        log = WindowLog.from_wire(read_json(path))
        result = audit_window(stages[WINDOWS.index((log.receipt.start, log.receipt.end))], log.inputs, log.receipt)
        assert result.ok and result.steps == len(log.receipt.schedule), path.name
        if log.receipt.last:
            assert result.token_step is None  # the sampled tokens re-sample to the same
    # The same through the command line, on one selected log of a middle window.
    middle = next(p for p in done.selected if "-2-4." in p.name)
    out = run_cli("audit", "run", str(middle), "--stage", str(stages[1]), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True


@pytest.mark.slow
def test_ring_up_record_and_audit_select(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "f32")
    record = tmp_path / "rec"
    out = run_cli(
        "ring", "up", str(model), "--splits", "0,2,4,6", "--record", str(record), "--threads", "1",
        "--prompt", PROMPT, "--max-tokens", "6", "--temperature", "0", "--json", "--ctx", "512",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["tokens"] == whole_model_tokens(model, PROMPT, 6)
    assert len(_wait_receipts(record, 3, timeout=5)) == 3
    key_file = tmp_path / "audit.key"
    made = run_cli("audit", "select", str(record), "--new-key", str(key_file))
    assert made.returncode == 0, made.stderr
    commitment = made.stdout.split()[-1]
    sel = run_cli(
        "audit", "select", str(record), "--key", str(key_file), "--fraction", "1", "--commitment", commitment, "--json"
    )
    assert sel.returncode == 0, sel.stderr
    assert json.loads(sel.stdout)["selected"] == 3
