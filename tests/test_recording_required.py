"""Recording required, as in a market ring (issue 24 item 2; security review 2, N9): every node of a real ring on
loopback records with ``required``; a member that does not record (it sends no chain head) cannot change answers
unseen: its successor refuses its boundaries, and the entry refuses the last rank's END without its head, with
CHAIN_MISMATCH; such a request earns no window anything (the ledger keeps no receipt for it). Honest requests through
the same ring get the whole model's exact answer and their receipts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import trio

from kvasir.market.agent.ledger import Ledger
from kvasir.ring.events import RequestEnded
from kvasir.ring.node import Node
from kvasir.verify.audit import read_json
from kvasir.verify.commit import WindowReceipt
from kvasir.wire import Boundary, End, Frame, StartRequest
from tests.test_request_integrity import HONEST_MAX, VICTIM_MAX, all_freed, ask, honest_answer, reference, three_nodes


def ledger_of(node: Node) -> Ledger:
    """The entry's witness receipts, wired as kvasir.market.agent.session wires them."""
    ledger = Ledger(node.config.node_id)
    ledger.holders = [f"node{r}" for r in range(node.manifest.size)]

    def ended(event: RequestEnded) -> None:
        # Every request here counts as paid (only paid requests get receipts; the payment is not what is tested).
        ledger.request_ended(attrs.evolve(event, client_auth="ka1.paid"), node.rank, node.manifest.size)

    node.requests.on_end.add(ended)
    return ledger


def stop_recording(node: Node, monkeypatch: pytest.MonkeyPatch, *, noise: bool) -> set[int]:
    """Make ``node`` a member that does not record for the victim's requests (those asking VICTIM_MAX tokens): its
    boundaries and END go out without chain heads, and, ``noise``, with one payload byte of each boundary changed."""
    send = node.links.send
    victims: set[int] = set()

    async def unrecorded(frame: Frame) -> None:
        if isinstance(frame, StartRequest) and frame.max_tokens == VICTIM_MAX:
            victims.add(frame.request_id)
        elif isinstance(frame, Boundary) and frame.request_id in victims:
            payload = bytearray(frame.payload)
            if noise:
                payload[5] ^= 0x10
            frame = attrs.evolve(frame, payload=bytes(payload), chain=b"")
        elif isinstance(frame, End) and (frame.request_id in victims or frame.generated_tokens == VICTIM_MAX):
            victims.add(frame.request_id)  # the last rank forwards no START: it knows its victims by their length
            frame = attrs.evolve(frame, chain=b"")
        await send(frame)

    monkeypatch.setattr(node.links, "send", unrecorded)
    return victims


async def test_a_member_that_does_not_record_is_refused_by_its_successor(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """N9: rank 1 does not record for the victim's request and changes its boundaries. A recording successor used to
    take a boundary without a chain head unchecked: the review's greedy answer changed (``… The number of people in
    Paris …``), 0 errors, receipts from ranks 0 and 2 only, so nothing to audit and witnesses paid every window.
    Recording required, rank 2 refuses the first such boundary (CHAIN_MISMATCH) before computing on it: no token
    reaches the client, the entry keeps no receipt for it; an honest request gets its exact answer and receipts from
    every window."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir, tmp_path, required=True) as nodes:
        ledger = ledger_of(nodes[0])
        victims = stop_recording(nodes[1], monkeypatch, noise=True)
        tokens, end = await ask(nodes[0], VICTIM_MAX)
        assert victims and end.reason == "error" and end.code == "chain_mismatch", end
        assert "rank 2" in (end.error or "") and "carries no chain head" in (end.error or "")
        assert tokens == [] and end.generated_tokens == 0
        await all_freed(nodes)
        assert ledger.receipts == []
        await honest_answer(nodes, expected, text)
        await all_freed(nodes)
    (receipt,) = ledger.receipts
    assert receipt.request not in victims and receipt.tokens == HONEST_MAX
    windows = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "receipts").glob(f"{receipt.request:016x}-*"))
    assert windows == ["0-2.json", "2-4.json", "4-6.json"]
    recorder = nodes[2].recorder
    assert recorder is not None and recorder.mismatches == 1


async def test_a_last_rank_that_does_not_record_is_refused_at_the_entry(
    tiny_model: Callable[..., Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """N9, the last rank: its output is tokens, not boundaries, so no successor can check its chain. It used to be
    free not to record (no receipt, nothing to audit) and be paid all the same. Now END carries the head its receipt
    signs; without it the entry fails the request (CHAIN_MISMATCH) and keeps no receipt for it, so the window earns
    nothing. An honest request gets its exact answer, and its END's head is the last rank's signed output head."""
    model = tiny_model("llama", "f32")
    expected, text = await trio.to_thread.run_sync(reference, model, HONEST_MAX)
    async with three_nodes(model, cache_dir, tmp_path, required=True) as nodes:
        ledger = ledger_of(nodes[0])
        victims = stop_recording(nodes[2], monkeypatch, noise=False)
        ends: list[End] = []
        send = nodes[2].links.send  # the member's: what it sends before its heads are stripped

        async def keep(frame: Frame) -> None:
            if isinstance(frame, End):
                ends.append(frame)
            await send(frame)

        monkeypatch.setattr(nodes[2].links, "send", keep)
        tokens, end = await ask(nodes[0], VICTIM_MAX)
        assert end.reason == "error" and end.code == "chain_mismatch", end
        assert "END from rank 2 carries no chain head" in (end.error or "")
        assert len(tokens) <= VICTIM_MAX
        await all_freed(nodes)
        assert ledger.receipts == []
        await honest_answer(nodes, expected, text)
        await all_freed(nodes)
    assert victims and len(ends) == 2 and all(e.chain for e in ends)  # sent with heads: stripped on the way
    (receipt,) = ledger.receipts
    last = WindowReceipt.from_wire(read_json(tmp_path / "receipts" / f"{receipt.request:016x}-4-6.json"))
    assert ends[1].chain.hex() == last.output_head and ends[1].params_hash.hex() == last.params_hash
