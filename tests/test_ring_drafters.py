"""Drafters in real rings (node processes on loopback): the last rank drafting with a draft model (``--draft-model``)
or the benchmark oracle (``--draft-oracle``) gives plain ``generate``'s tokens, greedy and seeded, from every entry;
the drafts really were verified (the last rank's counters). A bad drafter is refused at the node's start."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvasir.control.client import ControlClient
from kvasir.core.oracle import OracleRun, OracleSpec
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.wire import SamplingParams
from tests.conftest import run_cli
from tests.harness import faults
from tests.ringutil import ring_generate, running_ring

WINDOWS = [(0, 2), (2, 4), (4, 6)]
PROMPTS = ("one two three four five six seven", "a story about the sea and a ship")
SEEDED = {"temperature": 0.8, "seed": 3}
N = 64


def _plain(model: Path) -> dict[tuple[str, bool], list[int]]:
    """Plain generate's tokens per (prompt, seeded), the whole model in one context."""
    out = {}
    with Stage.load(StageConfig(model, n_ctx=512, n_seq_max=1, n_threads=1)) as stage:
        pipe = LocalPipeline([stage])
        for prompt in PROMPTS:
            tokens = stage.vocab.tokenize(prompt)
            for seeded in (False, True):
                params = SamplingParams.GREEDY.with_fields(SEEDED) if seeded else SamplingParams.GREEDY
                out[prompt, seeded] = pipe.generate(tokens, params, N).tokens
    return out


def _check_ring(model: Path, cache_dir: Path, extra: tuple[str, ...], want: dict[tuple[str, bool], list[int]]) -> int:
    """Every prompt, greedy and seeded, from every entry, equals ``want``; the drafts the last rank verified."""
    with running_ring(model, WINDOWS, cache_dir, extra_args=("--speculate", "4", *extra)) as ring:
        for (prompt, seeded), tokens in want.items():
            for entry in range(len(WINDOWS)):
                got = ring_generate(ring.sockets[entry], prompt, N, **(SEEDED if seeded else {}))
                assert got["tokens"] == tokens, (extra, prompt, seeded, entry)
        with ControlClient(ring.sockets[-1]) as c:
            drafted: int = c.status()["requests"]["drafted"]
    return drafted


def test_a_ring_drafting_with_a_draft_model_or_the_oracle_answers_as_plain_generate(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model("llama", "q8_0")
    want = _plain(model)
    # A draft model: the model itself (drafts mostly right) and another seed's weights (drafts mostly wrong).
    for draft in (model, tiny_model("llama", "f32", seed=1)):
        assert _check_ring(model, cache_dir, ("--draft-model", str(draft)), want) > 0
    # The oracle knows the greedy answers; for seeded requests it proposes them too (mostly wrong there).
    with Stage.load(StageConfig(model, n_ctx=64, n_seq_max=1, n_threads=1)) as stage:
        runs = tuple(OracleRun(tuple(stage.vocab.tokenize(p)), tuple(want[p, False])) for p in PROMPTS)
    oracle = tmp_path / "oracle.json"
    oracle.write_text(json.dumps(OracleSpec(0.6, 7, runs).to_wire()))
    assert _check_ring(model, cache_dir, ("--draft-policy", "eager", "--draft-oracle", str(oracle)), want) > 0


def test_a_node_refuses_a_bad_drafter(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "q8_0")
    bigger = tiny_model("llama", "f32", n_vocab=600)
    common = ["ring", "up", str(model), "--splits", "0,3,6", "--prompt", "x", "--max-tokens", "2", "--threads", "1"]
    got = run_cli(*common, "--speculate", "2", "--draft-model", str(bigger), timeout=120)
    assert got.returncode != 0 and "not the model's vocabulary" in got.stderr
    bad = tmp_path / "oracle.json"
    bad.write_text("[]")
    got = run_cli(*common, "--speculate", "2", "--draft-oracle", str(bad), timeout=120)
    assert got.returncode != 0 and "--draft-oracle" in got.stderr and "object" in got.stderr


def test_the_last_rank_killed_mid_speculation_with_a_draft_model_gives_the_fault_free_answer(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """SIGKILL of the last rank (which holds the draft model) at token 16 of 64: the supervisor restarts it, its
    predecessor replays the request, the new process re-drafts from the same tokens (rank 0 compares every replayed
    TOKEN, drafts included) and the client gets the fault-free tokens, which are plain generate's."""
    model = tiny_model("llama", "q8_0")
    want = _plain(model)[PROMPTS[0], False]
    extra = ("--speculate", "4", "--draft-model", str(model))
    with running_ring(model, WINDOWS, cache_dir, extra_args=extra, seqs=4) as ring:
        request: dict[str, Any] = {"prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0.0}
        assert faults.stream(ring.sockets[0], **request).tokens == want[:64]
        with faults.Supervised(ring) as sup:
            got = faults.stream(ring.sockets[0], fault=ring.processes[-1].kill, at=16, **request)
        assert got.end["reason"] == "max_tokens" and got.end.get("error") is None, got.end
        assert got.tokens == want[:64]
        assert any(f"rank {len(WINDOWS) - 1} exited" in n for n in sup.notes), sup.notes
        with ControlClient(ring.sockets[-1]) as c:
            assert c.status()["requests"]["drafted"] > 0  # the restarted last rank drafted too
