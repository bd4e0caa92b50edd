"""Standby nodes: a manifest lists, per rank, nodes that hold the same window, loaded and linked to nothing; when the
rank's node dies its predecessor dials the standby and replays the requests in flight into it."""

from __future__ import annotations

import functools
import os
import random
import signal
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from kvasir.commands.node import standby_view
from kvasir.control.client import ControlClient
from kvasir.core.errors import InputError, RingError
from kvasir.core.identity import Identity
from kvasir.local.launcher import LocalRing
from kvasir.relay.grant import read_grant
from kvasir.relay.ringlink import grant_relay_edges
from kvasir.relay.token import Role
from kvasir.ring.edges import RingEdges, relay_edge_id
from kvasir.ring.manifest import Manifest, RankEntry, StandbyEntry, load_manifest, parse_manifest
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.testing.fakestage import MemoryNetwork, expected_tokens, fake_ring
from tests.ringutil import running_ring
from tests.streams import wait_for
from tests.test_failover import FAULT_AT, MAX_TOKENS, WINDOWS, failover_status, wait_ready
from tests.test_failover import answer as stream
from tests.test_failover_flow import PROMPT as FLOW_PROMPT
from tests.test_failover_flow import WINDOWS as FLOW_WINDOWS
from tests.test_failover_flow import Ring, answer, fresh


def _manifest(*, keyed: bool) -> Manifest:
    def key() -> Any:
        return Identity.generate().public if keyed else None

    ranks = tuple(
        RankEntry(
            k,
            a,
            b,
            "127.0.0.1",
            7100 + k,
            standby=tuple(StandbyEntry("127.0.0.1", 7200 + 10 * k + i, key()) for i in range(k)),
            key=key(),
        )
        for k, (a, b) in enumerate(WINDOWS)
    )
    return Manifest("ab" * 32, 18, ranks, "gemma")


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_standbys_round_trip_through_the_toml(tmp_path: Path, keyed: bool) -> None:
    m = _manifest(keyed=keyed)
    m.write(tmp_path / "ring.toml")
    text = (tmp_path / "ring.toml").read_text()
    assert text.count('listen = "127.0.0.1:72') == 3 and text.count("key = ") == (6 if keyed else 0)
    back = load_manifest(tmp_path / "ring.toml")
    assert back == m
    assert [len(r.standby) for r in back.ranks] == [0, 1, 2]
    assert back.ranks[2].standby[1] == m.ranks[2].standby[1]
    # Every holder of a window, as its predecessor dials them: the primary, then the standbys in order.
    holders = back.ranks[2].holders()
    assert [h.port for h in holders] == [7102, 7220, 7221] and {h.rank for h in holders} == {2}
    assert back.ranks[2].keys() == (
        frozenset({m.ranks[2].key, *(s.key for s in m.ranks[2].standby)}) if keyed else set()
    )


def test_standbys_as_an_operator_writes_them(tmp_path: Path) -> None:
    text = f"""
[model]
sha256 = "{"ab" * 32}"
layers = 18

[[rank]]
layers = [0, 9]
listen = "10.0.0.1:7100"

[[rank]]
layers = [9, 18]
listen = "10.0.0.2:7100"

[[rank.standby]]
listen = "10.0.0.3:7100"

[[rank.standby]]
listen = "10.0.0.4:7100"
"""
    (tmp_path / "ring.toml").write_text(text)
    m = load_manifest(tmp_path / "ring.toml")
    assert m.ranks[0].standby == () and m.ranks[1].standby == (
        StandbyEntry("10.0.0.3", 7100),
        StandbyEntry("10.0.0.4", 7100),
    )
    assert parse_manifest(tomllib.loads(m.to_toml())) == m


def test_a_standby_runs_the_ring_with_its_own_address_and_key() -> None:
    m = _manifest(keyed=True)
    view = m.as_standby(2, 1)
    me, primary = view.ranks[2], m.ranks[2]
    assert (me.port, me.key) == (7221, primary.standby[1].key) and (me.start, me.end) == (primary.start, primary.end)
    # The primary and the other standby are the holders it defers to; the other ranks are untouched.
    assert [s.port for s in me.standby] == [7102, 7220] and me.standby[0].key == primary.key
    assert view.ranks[:2] == m.ranks[:2]
    with pytest.raises(InputError, match="rank 1 has 1 standby"):
        m.as_standby(1, 1)


def _rank_table(m: Manifest, **rank2: Any) -> dict[str, Any]:
    data = tomllib.loads(m.to_toml())
    data["rank"][2].update(rank2)
    return data


def test_standby_entries_are_checked() -> None:
    keyed, keyless = _manifest(keyed=True), _manifest(keyed=False)
    other = Identity.generate().public.to_text()
    bad = [
        (_rank_table(keyed, standby=[{"listen": "127.0.0.1:7300"}]), "every standby names its key"),
        (_rank_table(keyless, standby=[{"listen": "127.0.0.1:7300", "key": other}]), "no standby names a key"),
        (_rank_table(keyed, standby=[{"listen": "127.0.0.1:7300", "key": str(keyed.ranks[0].key)}]), "same key"),
        (_rank_table(keyless, standby=[{"listen": "127.0.0.1:7102"}]), "same address"),
        (_rank_table(keyless, standby=[{"listen": "nowhere"}]), r"rank\[2\].standby\[0\].listen"),
    ]
    for data, message in bad:
        with pytest.raises(InputError, match=message):
            parse_manifest(data)
    assert parse_manifest(_rank_table(keyless, standby=[])).ranks[2].standby == ()
    # A relayed rank may have standbys: each has an edge in of its own (docs/protocol.md § Relay edges).
    assert len(parse_manifest(_rank_table(keyless, link="relay")).ranks[2].standby) == 2


def test_relay_grants_for_standbys_name_each_holder_its_own_edge_in_and_the_edges_to_the_next_holders() -> None:
    """`ring up --relay --standby`'s grants: every holder of a window (primary or standby, each under its own key)
    is downstream on its own edge in and upstream on the edge to each holder of the successor's window; a standby's
    view keeps the ring's id, so its grants and edge ids are the ring's."""
    operator = Identity.generate()
    m = grant_relay_edges(_manifest(keyed=True), operator, 2_000_000_000)
    ring = m.ring_id
    for entry in m.ranks:
        succ = m.successor(entry.rank)
        for i, holder in enumerate(entry.holders()):
            grants = [read_grant(g) for g in holder.grants]
            assert {g.holder for g in grants} == {holder.key} and {g.ring for g in grants} == {ring}
            downstream = [g.edge for g in grants if g.role is Role.DOWNSTREAM]
            upstream = [g.edge for g in grants if g.role is Role.UPSTREAM]
            assert downstream == [relay_edge_id(m, entry.rank, i)]
            assert upstream == [relay_edge_id(m, succ.rank, j) for j in range(len(succ.holders()))]
    assert relay_edge_id(m, 2, 0) == f"{ring[:12]}-e2" and relay_edge_id(m, 2, 2) == f"{ring[:12]}-e2-s1"
    back = parse_manifest(tomllib.loads(m.to_toml()))
    assert back == m and back.ranks[2].standby[1].grants == m.ranks[2].standby[1].grants

    view = standby_view(m, 2, 1, "ws://127.0.0.1:1")
    assert view.ring_id == ring and view.ranks[2].grants == m.ranks[2].standby[1].grants
    edges = RingEdges.for_node(view, 2, "ws://127.0.0.1:1")
    assert (edges.edge_in, edges.edges_out) == (f"{ring[:12]}-e2-s1", (f"{ring[:12]}-e0",))
    primary = RingEdges.for_node(m, 1, "ws://127.0.0.1:1")
    assert primary.edge_in == f"{ring[:12]}-e1" and primary.edges_out == tuple(
        f"{ring[:12]}-e2{s}" for s in ("", "-s0", "-s1")
    )
    # A keyless ring (v1 tokens under its secret) names each holder's edge the same way.
    secret = attrs.evolve(_manifest(keyed=False), secret="cd" * 16)
    keyless = RingEdges.for_node(standby_view(secret, 2, 1, "ws://127.0.0.1:1"), 2, "ws://127.0.0.1:1")
    assert keyless.edge_in == relay_edge_id(secret, 2, 2) and keyless.edge_in.endswith("-e2-s1")
    # Without grants of its own a relayed standby is refused at start, with the reason.
    standby = attrs.evolve(m.ranks[2].standby[1], grants=())
    bare = attrs.evolve(m, ranks=(*m.ranks[:2], attrs.evolve(m.ranks[2], standby=(m.ranks[2].standby[0], standby))))
    with pytest.raises(InputError, match="no edge grants of its own"):
        standby_view(bare, 2, 1, "ws://127.0.0.1:1")


# ---------------------------------------------------------------------------------------------- real processes


def _status(ring: LocalRing, i: int) -> dict[str, Any]:
    with ControlClient(ring.sockets[i], timeout=30) as c:
        status: dict[str, Any] = c.status()
        return status


def _wait_status(ring: LocalRing, i: int, cond: Any, limit: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + limit
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = _status(ring, i)
            if cond(last):
                found: dict[str, Any] = last
                return found
        except (RingError, OSError) as exc:
            last = exc
        time.sleep(0.3)
    raise AssertionError(f"{ring.label(i)}: condition not met after {limit:.0f} s; last status {last}")


@pytest.fixture(scope="module")
def standby_ring(gemma_path: Path, cache_dir: Path) -> Iterator[LocalRing]:
    with running_ring(gemma_path, WINDOWS, cache_dir, standby=True) as ring:
        yield ring


@pytest.mark.slow
def test_a_standby_takes_over_the_window_and_the_answer_is_unchanged(standby_ring: LocalRing) -> None:
    """A 3-rank ring with one standby per rank; SIGKILL of the middle primary at token 16 of 64, with nothing to
    restart it: rank 0 dials the standby, replays the request into it, and the client gets the fault-free text. Then
    the primary comes back: its successor refuses it (the standby is linked there), it stays dormant, and the ring
    keeps serving exactly."""
    ring = standby_ring
    assert ring.standby_start == len(WINDOWS)
    primary, standby = 1, ring.standby_start + 1
    wait_ready(ring)
    # The standbys start once the primaries are linked: each is loaded and dormant.
    for i in range(ring.standby_start, len(ring.processes)):
        st = _status(ring, i)
        assert not st["ready"] and st["links"]["successor"]["state"].startswith("dormant"), st
    started = time.monotonic()
    want, end = stream(ring.sockets[0])
    fault_free = time.monotonic() - started
    assert end["reason"] == "max_tokens" and len(want) == MAX_TOKENS
    before = failover_status(ring, 0)["replays"]

    started = time.monotonic()
    got, end = stream(ring.sockets[0], fault=lambda: ring.processes[primary].kill())
    took = time.monotonic() - started
    assert end["reason"] == "max_tokens" and end.get("error") is None, end
    assert got == want, f"diverged at {next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)}"
    status = failover_status(ring, 0)
    assert status["replays"] > before and status["last_window"] == list(WINDOWS[1]), status
    assert _status(ring, standby)["ready"]
    assert ring.processes[primary].poll() is not None  # nothing restarted it: the standby holds the window
    load = os.getloadavg()
    print(
        f"standby took over layers 6:12: answer took {took:.2f} s (fault-free {fault_free:.2f} s), "
        f"stall {status['last_stall_s']} s "
        f"(fault at token {FAULT_AT}; load average {load[0]:.2f} {load[1]:.2f} on {os.cpu_count()} cpus)"
    )

    # The primary comes back while the standby holds the window: it is refused at its successor and stays dormant.
    ring.restart(primary)
    st = _wait_status(ring, primary, lambda s: s["links"]["successor"]["state"].startswith("dormant"))
    assert not st["ready"] and st["links"]["predecessor"]["state"] == "waiting", st
    ring.wait_ready(timeout=60)  # rank 1 counts as ready: its standby holds the window
    again, end = stream(ring.sockets[0])
    assert end.get("error") is None and again == want
    assert _status(ring, standby)["ready"] and not _status(ring, primary)["ready"]
    # Entered at the last rank, the request also goes round through the standby.
    want2, _ = stream(ring.sockets[2])
    assert want2 == want

    # A second fault: rank 0's primary dies mid-answer. Rank 2 dials rank 0's standby, which dials rank 1's holders in
    # order: the dormant primary first, which its successor refuses (the standby is linked there), so it hands its
    # predecessor back and rank 0's standby goes on to rank 1's standby. The answer does not change.
    got, end = stream(ring.sockets[2], fault=lambda: ring.processes[0].kill())
    assert end.get("error") is None and got == want2, end
    assert _status(ring, ring.standby_start)["ready"] and _status(ring, standby)["ready"]
    assert _wait_status(ring, primary, lambda s: s["links"]["successor"]["state"].startswith("dormant"))
    assert stream(ring.sockets[2])[0] == want2


@pytest.mark.slow
def test_a_standby_takes_over_a_relayed_window_and_the_answer_is_unchanged(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """`ring up --relay --standby`: every link through the relay, each holder under its own key and grants. Rank 1
    SIGKILLed mid-answer: the relay drops its ends, rank 0 dials rank 1's standby on that standby's own edge, and the
    standby joins rank 2's edge in; the answer is the fault-free one. The primary restarted is refused that edge by
    the relay (the standby holds it) and turns dormant."""
    model = tiny_model("llama", "q8_0")
    windows = [(0, 2), (2, 4), (4, 6)]
    with running_ring(model, windows, cache_dir, relay=True, standby=True, run_dir=tmp_path) as ring:
        assert ring.standby_start == len(windows) and ring.relay is not None
        primary, standby = 1, ring.standby_start + 1
        wait_ready(ring)
        for i in range(ring.standby_start, len(ring.processes)):
            st = _status(ring, i)
            assert not st["ready"] and st["links"]["successor"]["state"].startswith("dormant"), st
        started = time.monotonic()
        want, want_end = stream(ring.sockets[0])
        fault_free = time.monotonic() - started
        assert want_end.get("error") is None and len(want) > FAULT_AT, want_end
        before = failover_status(ring, 0)["replays"]

        started = time.monotonic()
        got, end = stream(ring.sockets[0], fault=lambda: ring.processes[primary].kill())
        took = time.monotonic() - started
        assert end.get("error") is None and end["reason"] == want_end["reason"], end
        assert got == want, f"diverged at {next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)}"
        status = failover_status(ring, 0)
        assert status["replays"] > before and status["last_window"] == list(windows[1]), status
        st = _status(ring, standby)
        assert st["ready"] and st["links"]["predecessor"]["kind"] == "relay", st
        assert st["links"]["successor"]["kind"] == "relay", st
        assert ring.processes[primary].poll() is not None  # nothing restarted it: the standby holds the window
        load = os.getloadavg()
        print(
            f"standby took over a relayed window: answer took {took:.2f} s (fault-free {fault_free:.2f} s), "
            f"stall {status['last_stall_s']} s (load average {load[0]:.2f} {load[1]:.2f} on {os.cpu_count()} cpus)"
        )

        # The primary comes back while the standby holds the window: the relay refuses it rank 2's edge in (another
        # key holds that end), so it turns dormant and the ring goes on through the standby.
        ring.restart(primary)
        st = _wait_status(ring, primary, lambda s: s["links"]["successor"]["state"].startswith("dormant"))
        assert not st["ready"], st
        again, end = stream(ring.sockets[0])
        assert end.get("error") is None and again == want
        assert _status(ring, standby)["ready"] and not _status(ring, primary)["ready"]
        assert stream(ring.sockets[2])[0] == want  # entered at the last rank, round through the standby too

        # A second fault: rank 0's primary dies mid-answer. Rank 2 dials rank 0's standby on its edge, which dials
        # rank 1's holders in order: the dormant primary first, which the relay refuses rank 2's edge in (the standby
        # holds it), so it hands its predecessor back and rank 0's standby goes on to rank 1's standby's edge.
        got, end = stream(ring.sockets[2], fault=lambda: ring.processes[0].kill())
        assert end.get("error") is None and got == want, end
        assert _status(ring, ring.standby_start)["ready"] and _status(ring, standby)["ready"]
        assert _wait_status(ring, primary, lambda s: s["links"]["successor"]["state"].startswith("dormant"))
        assert stream(ring.sockets[2])[0] == want


@pytest.mark.slow
def test_a_standby_takes_over_a_hung_relayed_window(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 SIGSTOPped mid-answer over the relay: its TCP connections stay open, so the relay holds its ends until
    a neighbour's idle timeout drops them. Rank 0 drops it first and wakes the standby, which the relay refuses rank
    2's edge in until rank 2 drops the hung primary too: the standby, just woken, retries rather than turning
    dormant, and the answer is the fault-free one, long before the failover wait."""
    model = tiny_model("llama", "q8_0")
    windows = [(0, 2), (2, 4), (4, 6)]
    with running_ring(model, windows, cache_dir, relay=True, standby=True, run_dir=tmp_path) as ring:
        assert ring.standby_start is not None
        wait_ready(ring)
        want, want_end = stream(ring.sockets[0])
        assert want_end.get("error") is None and len(want) > FAULT_AT, want_end
        hung = ring.processes[1]
        started = time.monotonic()
        try:
            got, end = stream(ring.sockets[0], fault=lambda: os.kill(hung.pid, signal.SIGSTOP))
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        took = time.monotonic() - started
        assert end.get("error") is None and got == want, end
        assert took < 10, took  # the idle timeout (3 s) and the replay; the failover wait is 15 s
        assert _status(ring, ring.standby_start + 1)["ready"]
        print(f"standby took over a hung relayed window: answer took {took:.2f} s")


# ---------------------------------------------------------------------------------------------- fast, in one process


async def _start_standby(ring: Ring, rank: int) -> Node:
    """Rank ``rank``'s standby 0 on a fresh (empty) stage, as ``kvasir node --standby 0`` runs it."""

    async def run(task_status: trio.TaskStatus[Node]) -> None:
        view = ring.manifest.as_standby(rank, 0)
        config = NodeConfig(view, rank, node_id=f"standby{rank}", standby=True, **ring.config)
        async with open_node(config, fresh(FLOW_WINDOWS, rank), transport=ring.net, rng=random.Random(10 + rank)) as n:
            task_status.started(n)
            await trio.sleep_forever()

    node: Node = await ring.nursery.start(run)
    return node


async def test_standbys_take_windows_over_and_two_holders_never_fight(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Four ranks with a standby each (FakeStages on memory streams): standbys stay dormant; rank 1 dies mid-answer
    and rank 0 fails over to its standby; the primary, restarted, turns dormant at its successor's refusal; then
    rank 0 dies mid-answer, its standby takes over and reaches rank 1's standby after the dormant primary hands it
    back. Both answers are the fault-free ones."""
    net = MemoryNetwork()
    manifest, stages = fake_ring(FLOW_WINDOWS, net, compute_s=0.01)
    manifest = attrs.evolve(
        manifest, ranks=tuple(attrs.evolve(r, standby=(StandbyEntry("mem", net.port() + 100),)) for r in manifest.ranks)
    )
    async with trio.open_nursery() as nursery:
        ring = Ring(nursery, manifest, net)
        for rank, stage in enumerate(stages):
            await ring.start(rank, stage)
        await wait_for(lambda: all(n.ready for n in ring.live()), "the ring to link")
        standbys = [await _start_standby(ring, k) for k in range(len(FLOW_WINDOWS))]
        await trio.sleep(5)
        assert all(s.links.dormant and s.links.successor is None and s.links.predecessor is None for s in standbys)

        async def kill(rank: int) -> None:
            ring.kill(rank)

        n0 = ring.nodes[0]
        assert n0 is not None
        tokens, end = await answer(n0, 40, 8, functools.partial(kill, 1))
        assert end.reason == "max_tokens" and end.error is None, end
        assert tokens == expected_tokens(FLOW_PROMPT, 40)
        assert standbys[1].ready and n0.failover.last_window == FLOW_WINDOWS[1]

        back = await ring.start(1, fresh(FLOW_WINDOWS, 1))  # the primary restarted: its successor refuses it
        await wait_for(lambda: back.links.dormant, "the restarted primary to turn dormant")
        assert standbys[1].ready and not back.ready

        n2 = ring.nodes[2]
        assert n2 is not None
        tokens, end = await answer(n2, 40, 8, functools.partial(kill, 0))
        assert end.reason == "max_tokens" and end.error is None, end
        assert tokens == expected_tokens(FLOW_PROMPT, 40)
        await wait_for(lambda: standbys[0].ready and standbys[1].ready, "rank 0's and rank 1's standbys to hold on")
        assert back.links.dormant and not back.ready
        refusals = [r for r in caplog.records if "refused this node's link" in r.getMessage()]
        assert [r.getMessage().split(":")[0] for r in refusals] == ["rank 1"] * 2  # restarted; then woken, handed back
        nursery.cancel_scope.cancel()


async def test_a_node_that_hands_its_window_over_fails_the_requests_that_entered_it_after_the_failover_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Rank 0's primary, the entry of a streaming request, turns dormant mid-answer (its successor refused it: the
    standby it woke is linked there; here the refusal's handling is called directly). The ring goes on through the
    standby, where that request's tokens now go: its client hears so after the failover wait, not after the 120 s
    stall timeout (the chaos benchmark's 3 hung streams). A request entering elsewhere gets the fault-free answer."""
    net = MemoryNetwork()
    manifest, stages = fake_ring(FLOW_WINDOWS, net, compute_s=0.01)
    manifest = attrs.evolve(
        manifest, ranks=tuple(attrs.evolve(r, standby=(StandbyEntry("mem", net.port() + 100),)) for r in manifest.ranks)
    )
    async with trio.open_nursery() as nursery:
        ring = Ring(nursery, manifest, net)
        for rank, stage in enumerate(stages):
            await ring.start(rank, stage)
        await wait_for(lambda: all(n.ready for n in ring.live()), "the ring to link")
        standbys = [await _start_standby(ring, k) for k in range(len(FLOW_WINDOWS))]
        n0 = ring.nodes[0]
        assert n0 is not None
        handed: list[float] = []

        async def hand_over() -> None:
            handed.append(trio.current_time())
            await n0.links._go_dormant()
            link = n0.links.successor  # as after a refusal: no successor link (rank 3 then wakes the standby)
            assert link is not None
            await link.aclose()

        tokens, end = await answer(n0, 40, 8, hand_over)
        assert end.reason == "error" and end.code == "link_lost", end
        assert end.error is not None and "handed its window to another holder" in end.error
        waited = trio.current_time() - handed[0]
        assert 15.0 <= waited < 17.0, waited  # the failover wait; was the stall timeout, 120 s
        assert tokens == expected_tokens(FLOW_PROMPT, 40)[: len(tokens)]
        assert standbys[0].ready and n0.links.dormant
        n2 = ring.nodes[2]
        assert n2 is not None
        tokens, end = await answer(n2, 40, 99, lambda: None)
        assert end.reason == "max_tokens" and tokens == expected_tokens(FLOW_PROMPT, 40)
        nursery.cancel_scope.cancel()
