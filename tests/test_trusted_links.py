"""Trusted ring links (protocol v2): each attack on a keyed ring is refused and the real answer is unchanged.

In-process rings use FakeStage over memory streams (fast, deterministic); the last tests attack a real ring of node
processes on loopback TCP.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from pathlib import Path

import pytest
import trio

from kvasir.control.client import ControlClient
from kvasir.core.errors import InputError
from kvasir.core.identity import Identity
from kvasir.ring.manifest import Manifest
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.ring.secure import MAGIC, Credentials, LinkAuthError, Refusal, dial_secure
from kvasir.testing.fakestage import FakeStage, MemoryNetwork, expected_tokens, fake_ring
from kvasir.wire import Boundary, BoundaryDType, FrameDecoder, Hello, SamplingParams, StartRequest
from tests.ringutil import ring_generate, running_ring, whole_model_tokens
from tests.streams import Tap, wait_for

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [1, 5, 9, 17, 33, 41, 50, 63]
WINDOWS = [(0, 2), (2, 4), (4, 6)]


class TappedNetwork(MemoryNetwork):
    """A memory network that records every byte a dialer sends: what an on-path observer would capture."""

    def __init__(self) -> None:
        super().__init__()
        self.captured = bytearray()

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        return Tap(await super().connect(host, port), self.captured)


@asynccontextmanager
async def keyed_ring(net: MemoryNetwork) -> AsyncIterator[tuple[list[Node], Manifest, list[Identity]]]:
    manifest, stages = fake_ring(WINDOWS, net)
    identities = [Identity.generate() for _ in WINDOWS]
    manifest = manifest.with_keys([i.public for i in identities])
    async with AsyncExitStack() as stack:
        nodes = [
            await stack.enter_async_context(
                open_node(
                    NodeConfig(manifest, r, identity=identities[r], idle_timeout=5.0),
                    stages[r],
                    transport=net,
                    rng=random.Random(r),
                )
            )
            for r in range(len(WINDOWS))
        ]
        await wait_for(lambda: all(n.ready for n in nodes), "the ring to link", 20)
        yield nodes, manifest, identities


async def generate(node: Node, prompt: list[int], max_tokens: int) -> list[int]:
    tokens: list[int] = []
    async with node.request(prompt, GREEDY, max_tokens) as handle, aclosing(node.events(handle)) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent) and ev.token >= 0:
                tokens.append(ev.token)
            elif isinstance(ev, EndEvent):
                return tokens
    raise AssertionError("no end event")


async def test_a_keyed_ring_answers_and_the_wire_holds_no_prompt() -> None:
    net = TappedNetwork()
    with trio.fail_after(30):
        async with keyed_ring(net) as (nodes, _, identities):
            assert [n.config.node_id for n in nodes] == [i.node_id for i in identities]  # ids are key fingerprints
            assert all(n.links.predecessor_key == identities[(k - 1) % 3].public for k, n in enumerate(nodes))
            assert await generate(nodes[0], PROMPT, 8) == expected_tokens(PROMPT, 8)
    prompt_bytes = struct.pack(f"<{len(PROMPT)}i", *PROMPT)
    assert len(net.captured) > 1000
    assert prompt_bytes not in net.captured  # START would carry exactly these bytes in clear
    assert b"KV\x01" not in net.captured  # no v1 frame header ever crossed in clear


async def test_a_stranger_cannot_take_the_predecessor_slot_or_inject() -> None:
    net = MemoryNetwork()
    with trio.fail_after(30):
        async with keyed_ring(net) as (nodes, manifest, identities):
            target = manifest.rank(1)
            # v1 attacker: plays rank 0 with its public node id and HELLO; gets a v2 challenge and nothing else.
            stream = await net.connect(target.host, target.port)
            hello = Hello(
                node_id=identities[0].node_id,
                model_id=manifest.model_sha256,
                rank=0,
                ring_size=3,
                window_start=0,
                window_end=2,
                n_layers=6,
                n_embd=nodes[0].links.hello.n_embd,
                dtypes=frozenset(BoundaryDType),
            )
            await stream.send_all(hello.to_wire())
            got = b""
            with trio.move_on_after(2):
                while chunk := await stream.receive_some():
                    got += chunk
            assert got.startswith(MAGIC + b"\x01") and identities[1].node_id.encode() not in got
            assert nodes[1].links.predecessor_key == identities[0].public
            # v2 attacker with its own key: refused before TLS, the slot stays with rank 0.
            stranger = Credentials.of(Identity.generate())
            with pytest.raises(LinkAuthError) as info:
                await dial_secure(await net.connect(target.host, target.port), stranger, identities[1].public)
            assert info.value.refusal is Refusal.UNKNOWN_KEY
            # An attacker who stole nothing but rank 0's public key cannot prove it either.
            assert nodes[1].links.predecessor_key == identities[0].public
            assert await generate(nodes[0], PROMPT, 8) == expected_tokens(PROMPT, 8)


async def test_huge_frames_and_silent_sockets_before_authentication() -> None:
    net = MemoryNetwork()
    with trio.fail_after(30):
        async with keyed_ring(net) as (nodes, manifest, _):
            target = manifest.rank(1)
            # A 60 MiB BOUNDARY as the first bytes: refused at its header, nothing of it buffered.
            bomb = Boundary(1, 0, 1, 16, BoundaryDType.F32, bytes(64)).to_wire()[:24]
            stream = await net.connect(target.host, target.port)
            await stream.send_all(bomb)
            with trio.move_on_after(5):
                while await stream.receive_some():
                    pass
            # Silent sockets: at most 4 handshakes in progress per address; the rest are closed at once.
            silent = [await net.connect(target.host, target.port) for _ in range(6)]
            await trio.sleep(0.2)
            closed = 0
            for s in silent:
                data = b""
                with trio.move_on_after(0.2):
                    while chunk := await s.receive_some():
                        data += chunk
                    closed += 1  # end of stream without the full challenge
            assert closed >= 2
            assert await generate(nodes[0], PROMPT, 8) == expected_tokens(PROMPT, 8)


async def test_a_node_whose_key_is_not_its_rank_s_refuses_to_start() -> None:
    net = MemoryNetwork()
    manifest, stages = fake_ring(WINDOWS, net)
    manifest = manifest.with_keys([Identity.generate().public for _ in WINDOWS])
    with pytest.raises(InputError, match="not rank 1's key"):
        async with open_node(NodeConfig(manifest, 1, identity=Identity.generate()), stages[1], transport=net):
            pass
    with pytest.raises(InputError, match="--identity"):
        async with open_node(NodeConfig(manifest, 1), FakeStage(2, 4, 6, model_sha256="f" * 64), transport=net):
            pass


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_real_ring_refuses_strangers_and_keeps_its_answer(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("llama", "f32")
    windows = [(0, 2), (2, 4), (4, 6)]
    expected = whole_model_tokens(model, "The capital of France is", 10)
    with running_ring(model, windows, cache_dir) as ring:
        assert ring.manifest.secured and (ring.run_dir / "rank1.pem").stat().st_mode & 0o777 == 0o600
        target = ring.manifest.rank(1)
        rss_before = _rss_kib(ring.processes[1].pid)
        # Four connections each start a 60 MiB frame and hold it open.
        bombs: list[socket.socket] = []
        header = Boundary(1, 0, 1, 16, BoundaryDType.F32, bytes(64)).to_wire()[:24]
        refused = 0
        try:
            for _ in range(4):
                s = socket.create_connection((target.host, target.port), timeout=5)
                bombs.append(s)
                try:
                    s.sendall(header + os.urandom(1 << 20))
                except (ConnectionResetError, BrokenPipeError):
                    refused += 1  # the node dropped the stranger before the megabyte was in: as good
            time.sleep(1.0)
            grown_mib = (_rss_kib(ring.processes[1].pid) - rss_before) / 1024
        finally:
            for s in bombs:
                s.close()
        print(f"{refused} of 4 pre-auth senders were cut off mid-frame")
        print(f"rank 1 grew {grown_mib:.1f} MiB under 4 pre-auth 60 MiB frames")
        assert grown_mib < 16, f"rank 1 grew {grown_mib:.1f} MiB under pre-auth frames"
        # A v1 peer gets the v2 challenge and nothing that names the node.
        with socket.create_connection((target.host, target.port), timeout=5) as s:
            first = s.recv(64)
        assert first.startswith(MAGIC + b"\x01") and len(first) == 36
        result = ring_generate(ring.sockets[0], "The capital of France is", 10)
        assert result["tokens"] == expected
        with ControlClient(ring.sockets[1], 10) as c:
            links = c.status()["links"]
        assert links["predecessor"]["secure"] and links["successor"]["secure"]


# ------------------------------------------------------------------------------------------ less in clear


def test_start_needs_tokens_rule() -> None:
    from kvasir.ring.requests import start_needs_tokens

    # Entry at rank 0 of 4: nobody after rank 0 needs the ids, unless penalties need them at the last rank.
    assert [start_needs_tokens(r, 0, 4, penalties=False) for r in (1, 2, 3)] == [False, False, False]
    assert [start_needs_tokens(r, 0, 4, penalties=True) for r in (1, 2, 3)] == [True, True, True]
    # Entry at rank 2: ranks 3 and 0 are on the way to rank 0; rank 1 comes after it.
    assert [start_needs_tokens(r, 2, 4, penalties=False) for r in (3, 0, 1)] == [True, True, False]


class PerLinkNetwork(MemoryNetwork):
    """Records what each dialer sends, per destination port (keyless ring: frames in clear, to decode)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: dict[int, bytearray] = {}

    async def connect(self, host: str, port: int) -> trio.abc.Stream:
        return Tap(await super().connect(host, port), self.sent.setdefault(port, bytearray()))


def _starts(data: bytes | bytearray) -> list[StartRequest]:
    decoder = FrameDecoder()
    return [f for f in decoder.feed(bytes(data)) if isinstance(f, StartRequest)]


@pytest.mark.parametrize("penalties", [False, True])
async def test_middle_ranks_get_the_prompt_length_not_its_tokens(penalties: bool) -> None:
    net = PerLinkNetwork()
    windows = [(0, 1), (1, 2), (2, 3), (3, 4)]
    manifest, stages = fake_ring(windows, net)
    params = SamplingParams(temperature=0.7, seed=3, repeat_penalty=1.3 if penalties else 1.0)
    with trio.fail_after(30):
        async with AsyncExitStack() as stack:
            nodes = [
                await stack.enter_async_context(open_node(NodeConfig(manifest, r), stages[r], transport=net))
                for r in range(4)
            ]
            await wait_for(lambda: all(n.ready for n in nodes), "the ring to link", 20)
            for entry in (0, 2):
                async with nodes[entry].request(PROMPT, params, 4) as handle:
                    async for ev in handle.events:
                        if isinstance(ev, EndEvent):
                            assert ev.reason == "max_tokens"
                            break
    got = {k: _starts(net.sent[manifest.rank(k).port]) for k in range(4)}
    # Entry 0: ranks 1 to 3 get the length only, unless penalties read the prompt at the last rank (rank 3), which the
    # ids then reach through ranks 1 and 2. Entry 2: ranks 3 and 0 get them (rank 0 embeds), rank 1 the length only.
    by_entry = {k: {s.entry_rank: s for s in got[k]} for k in range(4)}
    for k in (1, 2, 3):
        assert (by_entry[k][0].prompt == tuple(PROMPT)) is penalties
        assert by_entry[k][0].prompt_length == len(PROMPT)
    assert by_entry[3][2].prompt == tuple(PROMPT) and by_entry[0][2].prompt == tuple(PROMPT)
    assert by_entry[1][2].prompt == () and by_entry[1][2].prompt_length == len(PROMPT)
