"""A ring drafting with the model's own MTP block (``--draft-mtp``, docs/mtp.md): real node processes on loopback, the
tiny random-weight qwen35moe with one MTP block. Its drafts are noise (acceptance says nothing about a real model),
so every drafted row is mostly a rejection the hybrid windows must roll back from their snapshots: the answers must
still be plain ``generate``'s, token for token, greedy and seeded, from every entry, and the last rank must really
have drafted. A model without an MTP block is refused in one line; SIGKILL of the last rank (the MTP's holder)
mid-request gives the fault-free answer."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from kvasir.control.client import ControlClient
from kvasir.core.speculate import SpeculationStats
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.node import NodeConfig, open_node
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.shard.cache import stage_files
from kvasir.stage import mtp_pipeline
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.mtp import MtpDrafter, MtpHead
from kvasir.stage.mtp_pipeline import generate_mtp
from kvasir.stage.mtpsource import MtpSources
from kvasir.stage.pipeline import LocalPipeline
from kvasir.testing.fakestage import MemoryNetwork
from kvasir.wire import SamplingParams
from tests.conftest import run_cli
from tests.harness import faults
from tests.ringutil import ring_generate, running_ring
from tests.streams import wait_for

WINDOWS = [(0, 3), (3, 5), (5, 8)]
PROMPT = "The quick brown fox jumps over the lazy dog. A ring of devices runs one model"
SEEDED = {"temperature": 0.9, "seed": 11}
N = 32


@pytest.fixture(scope="module")
def mtp_model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("qwen35moe", "q8_0", n_layer=8, n_nextn=1)


def _params(seeded: bool) -> SamplingParams:
    return SamplingParams.GREEDY.with_fields(SEEDED) if seeded else SamplingParams.GREEDY


def _plain(model: Path) -> dict[bool, list[int]]:
    """Plain generate's tokens, greedy and seeded, the whole model in one context (its MTP block unused)."""
    out = {}
    with Stage.load(StageConfig(model, n_ctx=512, n_seq_max=1, n_threads=1)) as stage:
        tokens = stage.vocab.tokenize(PROMPT)
        for seeded in (False, True):
            out[seeded] = LocalPipeline([stage]).generate(tokens, _params(seeded), N).tokens
    return out


def _in_process_mtp(model: Path, cache_dir: Path, k: int) -> SpeculationStats:
    """``generate_mtp`` (the in-process reference of how the drafter is fed) on the ring's windows, K drafts every
    step: its counters summed over the greedy and the seeded request."""
    paths = stage_files(model, WINDOWS, cache_dir)
    with contextlib.ExitStack() as stack:
        stages = [
            stack.enter_context(
                Stage.load(StageConfig(p, n_ctx=512, n_seq_max=1, n_threads=1, mtp=i == len(paths) - 1, rollback=k + 1))
            )
            for i, p in enumerate(paths)
        ]
        head = stack.enter_context(MtpHead(stages[-1]))
        pipe = LocalPipeline(stages)
        total = SpeculationStats()
        for seeded in (False, True):
            got, _ = generate_mtp(pipe, head, stages[0].vocab.tokenize(PROMPT), _params(seeded), N, k)
            assert got.speculation is not None
            s = got.speculation
            total = attrs.evolve(
                total,
                verify_batches=total.verify_batches + s.verify_batches,
                drafted=total.drafted + s.drafted,
                accepted=total.accepted + s.accepted,
            )
    return total


def _counters(sock: Path) -> dict[str, int]:
    """The last rank's speculation counters (drafted, accepted, verify_batches)."""
    with ControlClient(sock) as c:
        requests: dict[str, int] = c.status()["requests"]
    return requests


def test_a_ring_drafting_with_its_mtp_block_answers_as_plain_generate(mtp_model: Path, cache_dir: Path) -> None:
    want = _plain(mtp_model)
    # fixed: K drafts every step whatever was accepted (rollbacks at every row); auto: the default schedule.
    # The last: prompt lookup (eager) on the same hybrid ring, which rolls back from snapshots too.
    for policy, k, drafter in (("fixed", 3, "--draft-mtp"), ("auto", 2, "--draft-mtp"), ("eager", 3, None)):
        extra = ("--speculate", str(k), "--draft-policy", policy, *((drafter,) if drafter else ()))
        with running_ring(mtp_model, WINDOWS, cache_dir, extra_args=extra) as ring:
            for seeded, tokens in want.items():
                for entry in range(len(WINDOWS)):
                    got = ring_generate(ring.sockets[entry], PROMPT, N, **(SEEDED if seeded else {}))
                    assert got["tokens"] == tokens, (policy, seeded, entry)
                    assert got.get("error") is None, got
            counters = _counters(ring.sockets[-1])
            assert counters["drafted"] > 0 and counters["verify_batches"] > 0, (policy, counters)
            if policy == "fixed":
                # K drafts every step, as generate_mtp: the same drafts, so the same acceptances, once per entry.
                ref = _in_process_mtp(mtp_model, cache_dir, k)
                for key in ("drafted", "accepted", "verify_batches"):
                    assert counters[key] == len(WINDOWS) * getattr(ref, key), (key, counters, ref)


def test_draft_mtp_is_refused_without_an_mtp_block_or_speculate(tiny_model: Callable[..., Path]) -> None:
    plain = tiny_model("qwen35moe", "q8_0")
    common = ["ring", "up", str(plain), "--splits", "0,3,6", "--prompt", "x", "--max-tokens", "2", "--threads", "1"]
    got = run_cli(*common, "--speculate", "2", "--draft-mtp", timeout=120)
    assert got.returncode != 0 and "--draft-mtp" in got.stderr and "MTP" in got.stderr, got.stderr
    assert "Traceback" not in got.stderr
    got = run_cli("node", "--manifest", "ring.toml", "--rank", "0", "--draft-mtp", timeout=60)
    assert got.returncode == 2 and "--draft-mtp drafts for --speculate K" in got.stderr, got.stderr


def test_the_last_rank_killed_while_drafting_with_mtp_gives_the_fault_free_answer(
    mtp_model: Path, cache_dir: Path
) -> None:
    """SIGKILL of the last rank at token 12 of 32: the restarted process rebuilds the MTP drafter from the replayed
    rows (the same computations, so the same hidden states and drafts: rank 0 compares every replayed TOKEN) and the
    client gets plain generate's tokens."""
    want = _plain(mtp_model)[False]
    extra = ("--speculate", "3", "--draft-mtp", "--draft-policy", "fixed")
    with running_ring(mtp_model, WINDOWS, cache_dir, extra_args=extra, seqs=4) as ring:
        request: dict[str, Any] = {"prompt": PROMPT, "max_tokens": N, "temperature": 0.0}
        with faults.Supervised(ring) as sup:
            got = faults.stream(ring.sockets[0], fault=ring.processes[-1].kill, at=12, **request)
        assert got.end["reason"] == "max_tokens" and got.end.get("error") is None, got.end
        assert got.tokens == want
        assert any(f"rank {len(WINDOWS) - 1} exited" in n for n in sup.notes), sup.notes
        assert _counters(ring.sockets[-1])["drafted"] > 0  # the restarted last rank drafted too


class _Recording:
    """Wraps a draft source and keeps what it proposed (for comparing the ring's drafts with generate_mtp's)."""

    def __init__(self, source: Any, log: list[list[int]]) -> None:
        self.source, self.log = source, log
        self.blocking = source.blocking

    def computed(self, pos0: int, n: int) -> None:
        self.source.computed(pos0, n)

    def emitted(self, token: int) -> None:
        self.source.emitted(token)

    def propose(self, k: int, *, eager: bool = False) -> list[int]:
        drafts: list[int] = self.source.propose(k, eager=eager)
        self.log.append(drafts)
        return drafts

    def close(self) -> None:
        self.source.close()


async def test_the_ring_last_rank_drafts_what_generate_mtp_drafts(
    mtp_model: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process nodes on real windows (memory streams): the last rank's MTP drafts, step by step, are the ones
    ``generate_mtp`` proposes on the same windows (the drafter is fed the same rows and tokens), and the answer is
    plain generate's. Random weights: nearly every draft is rejected, so this checks the feeding, not acceptance."""
    k = 3
    want = _plain(mtp_model)
    paths = stage_files(mtp_model, WINDOWS, cache_dir)
    # The reference: generate_mtp's proposals, recorded.
    ref_log: list[list[int]] = []

    class RecordingDrafter(MtpDrafter):
        def propose(self, k: int) -> list[int]:
            drafts = super().propose(k)
            if k > 0:  # generate_mtp asks for 0 at max_tokens; the ring's Drafter does not ask then
                ref_log.append(drafts)
            return drafts

    monkeypatch.setattr(mtp_pipeline, "MtpDrafter", RecordingDrafter)
    ref_tokens = {}
    with contextlib.ExitStack() as stack:
        stages = [
            stack.enter_context(
                Stage.load(StageConfig(p, n_ctx=512, n_seq_max=1, n_threads=1, mtp=i == 2, rollback=k + 1))
            )
            for i, p in enumerate(paths)
        ]
        head = stack.enter_context(MtpHead(stages[-1]))
        prompt = stages[0].vocab.tokenize(PROMPT)
        for seeded in (False, True):
            got, _ = generate_mtp(LocalPipeline(stages), head, prompt, _params(seeded), N, k)
            ref_tokens[seeded] = got.tokens
    assert ref_tokens == want
    # The ring: three in-process nodes, the last drafting with MTP through the drafter interface.
    net = MemoryNetwork()
    ring_log: list[list[int]] = []
    async with contextlib.AsyncExitStack() as astack:
        stages = []
        for i, p in enumerate(paths):
            cfg = StageConfig(p, n_ctx=512, n_seq_max=2, n_threads=1, mtp=i == 2, rollback=0 if i == 2 else k + 1)
            stage = await trio.to_thread.run_sync(Stage.load, cfg)
            astack.callback(stage.close)
            stages.append(stage)
        sha = stages[0].info.model_sha256
        assert sha is not None
        ranks = tuple(RankEntry(r, a, b, "mem", net.port()) for r, (a, b) in enumerate(WINDOWS))
        manifest = Manifest(sha, WINDOWS[-1][1], ranks, model_name="qwen35moe")
        mtp = MtpSources(stages[-1])
        astack.callback(mtp.close)

        def sources(prompt: Sequence[int], seq: int) -> _Recording:
            return _Recording(mtp(prompt, seq), ring_log)

        nodes = []
        for r in range(len(WINDOWS)):
            extra: dict[str, Any] = {"draft_sources": sources, "draft_policy": "fixed"} if r == 2 else {}
            config = NodeConfig(manifest, r, node_id=f"node{r}", speculate=k, **extra)
            nodes.append(await astack.enter_async_context(open_node(config, stages[r], transport=net)))
        await wait_for(lambda: all(n.ready for n in nodes), "the ring to link")
        for seeded in (False, True):
            tokens: list[int] = []
            async with (
                nodes[0].request(prompt, _params(seeded), N) as handle,
                contextlib.aclosing(nodes[0].events(handle)) as events,
            ):
                async for ev in events:
                    if isinstance(ev, TokenEvent) and ev.token >= 0:
                        tokens.append(ev.token)
                    elif isinstance(ev, EndEvent):
                        assert ev.error is None, ev
                        break
            assert tokens == want[seeded], seeded
    assert ring_log == ref_log and sum(map(len, ring_log)) > 0
