"""Speculative decoding across a real ring: node processes on loopback running the real Gemma 3 270M give exactly
``kvasir generate --speculate K`` (the whole model in one context, the same schedule), greedy and seeded, from any
entry node; ``--speculate 0`` and a request asking K=0 are the plain ring. Fast orderings: test_ring_speculate_flow.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from kvasir.control.client import ControlClient
from kvasir.core.identity import Identity
from kvasir.shard.cache import stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.verify.audit import WindowLog, audit_window, read_json, skipped_steps
from kvasir.verify.commit import NO_TOKEN, chain_head, skip_hash
from kvasir.verify.select import key_commitment, reveal
from kvasir.wire import SamplingParams
from tests.conftest import run_cli
from tests.ringutil import ring_generate, running_ring
from tests.test_speculate import REPEATING, STORY

SEEDED = {"temperature": 0.8, "seed": 11}
KEY = bytes(range(32))  # the auditor's key: with a fraction of 1.0 it selects every log


#: The schedule generate drafts by: a ring on loopback drafts so by itself (auto), but a loaded machine could make a
#: ring look latency-bound, and these tests compare verify batches too.
ADAPTIVE = ("--draft-policy", "adaptive")


@pytest.mark.slow
def test_gemma_ring_equals_generate_speculate(gemma_path: Path, cache_dir: Path) -> None:
    with Stage.load(StageConfig(gemma_path, n_ctx=512, n_seq_max=1, n_threads=2)) as stage:
        pipe = LocalPipeline([stage])
        repeating = stage.vocab.tokenize(REPEATING)
        story = stage.vocab.tokenize(STORY)
        greedy = SamplingParams.GREEDY
        want = pipe.generate(repeating, greedy, 40, speculate=4)
        want_story = pipe.generate(story, greedy, 24, speculate=4)
        want_seeded = pipe.generate(repeating, greedy.with_fields(SEEDED), 32, speculate=4)
        plain = pipe.generate(repeating, greedy, 40)
        plain_seeded = pipe.generate(repeating, greedy.with_fields(SEEDED), 32)
    assert want.speculation is not None and want.speculation.accepted >= 20  # the drafts really are verified
    # Verify rows are computed as plain steps: speculation changes no answer, greedy or sampled.
    assert want.tokens == plain.tokens and want_seeded.tokens == plain_seeded.tokens
    with running_ring(
        gemma_path, [(0, 6), (6, 12), (12, 18)], cache_dir, extra_args=("--speculate", "4", *ADAPTIVE)
    ) as ring:
        last = ring.sockets[-1]
        for entry in (0, 1, 2):
            with ControlClient(last) as c:
                before = c.status()["requests"]
            got = ring_generate(ring.sockets[entry], REPEATING, 40)
            assert got["tokens"] == want.tokens and got["reason"] == "max_tokens", entry
            assert got["generated_tokens"] == 40
            with ControlClient(last) as c:
                after = c.status()["requests"]
            spec = want.speculation
            # The last rank ran generate's schedule: the same verify batches, drafts and acceptances.
            assert after["verify_batches"] - before["verify_batches"] == spec.verify_batches
            assert after["drafted"] - before["drafted"] == spec.drafted
            assert after["accepted"] - before["accepted"] == spec.accepted
        assert ring_generate(ring.sockets[1], STORY, 24)["tokens"] == want_story.tokens
        assert ring_generate(ring.sockets[0], REPEATING, 32, **SEEDED)["tokens"] == want_seeded.tokens
        # K=0 asked by the request: the plain ring, no verify batch.
        with ControlClient(last) as c:
            before = c.status()["requests"]
        assert ring_generate(ring.sockets[2], REPEATING, 40, speculate=0)["tokens"] == plain.tokens
        with ControlClient(last) as c:
            counters = c.status()["requests"]
            assert counters["verify_batches"] == before["verify_batches"]
        # `kvasir status` at the last rank says what speculation did; adaptive drafting: no eager step.
        shown = run_cli("status", "--socket", str(last))
        assert shown.returncode == 0, shown.stderr
        accepted, drafted = counters["accepted"], counters["drafted"]
        assert f"speculation: {counters['verify_batches']} verify batches · {accepted}/{drafted}" in shown.stdout
        assert "· 0 steps drafted eagerly" in shown.stdout


def test_ring_up_speculate_matches_generate(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    """The CLI end to end: `ring up --speculate K --prompt` (every node's default K) prints `generate --speculate
    K`'s tokens on a tiny llama; an out-of-range K is refused."""
    model = tiny_model("llama", "q8_0")
    prompt = "one two three one two three one two three one two"
    common = ["--prompt", prompt, "--max-tokens", "24", "--threads", "1", "--json", "--ctx", "256"]
    want = run_cli("generate", str(model), *common, "--speculate", "3")
    assert want.returncode == 0, want.stderr
    assert json.loads(want.stdout)["speculation"]["verify_batches"] > 0  # this prompt's drafts are verified
    # Drafting eagerly (generate drafts adaptively): another schedule, the same answer.
    spec = ("--speculate", "3", "--draft-policy", "eager")
    got = run_cli("ring", "up", str(model), "--splits", "0,3,6", *common, *spec, timeout=300)
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["tokens"] == json.loads(want.stdout)["tokens"]
    assert run_cli("ring", "up", "--speculate", "99", str(model), "--prompt", "x").returncode != 0
    bad = run_cli("ring", "up", "--draft-policy", "sometimes", str(model), "--prompt", "x")
    assert bad.returncode != 0 and "invalid choice: 'sometimes'" in bad.stderr


@pytest.mark.slow
def test_a_recording_speculative_ring_audits_and_a_false_skip_is_caught(
    gemma_path: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """Real Gemma windows in node processes with ``--speculate 4 --record DIR``: answers stay generate's; every
    window's receipt of every request links to its predecessor's and re-executes to the same bytes (verify rows,
    rollbacks and the last rank's skipped stale rows included); a receipt that claims a skip where the next step does
    not roll it back fails its audit at that step."""
    windows = [(0, 6), (6, 12), (12, 18)]
    requests = [(0, REPEATING, 40, {}), (1, REPEATING, 32, SEEDED), (2, STORY, 24, {})]
    with Stage.load(StageConfig(gemma_path, n_ctx=512, n_seq_max=1, n_threads=2)) as stage:
        pipe = LocalPipeline([stage])
        want = [
            pipe.generate(stage.vocab.tokenize(text), SamplingParams.GREEDY.with_fields(params), n).tokens
            for _, text, n, params in requests
        ]
    record = tmp_path / "record"
    extra = ("--speculate", "4", *ADAPTIVE, "--record", str(record))
    with running_ring(gemma_path, windows, cache_dir, extra_args=extra) as ring:
        got = [ring_generate(ring.sockets[e], text, n, **params)["tokens"] for e, text, n, params in requests]
        deadline = time.monotonic() + 30
        while len(list((record / "receipts").glob("*.json"))) < 9 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert got == want  # recording a speculative request changes no answer
    done = reveal(record, KEY, 1.0, commitment=key_commitment(KEY))
    assert len(done.selected) == 9 and done.linked == 6 and not done.broken_links
    logs = [WindowLog.from_wire(read_json(p)) for p in done.selected]
    lasts = [log for log in logs if log.receipt.last]
    skips = sum(map(_skips_of, lasts))
    assert skips > 0  # stale rows were skipped (and are audited as such below)
    paths = stage_files(gemma_path, windows, cache_dir)
    audited_skips = 0
    for k, path in enumerate(paths):
        with Stage.load(StageConfig(path, n_ctx=512, n_seq_max=1, n_threads=2)) as window:
            for log in (log for log in logs if log.receipt.start == windows[k][0]):
                result = audit_window(window, log.inputs, log.receipt)
                assert result.ok and result.token_step is None, (k, result)
                audited_skips += result.skipped
            if k == len(windows) - 1:
                # A last rank that skips a row the next step builds on (not a stale one): caught at that step.
                log = max(lasts, key=lambda log: len(log.receipt.schedule))
                r = log.receipt
                i = next(
                    i for i in range(len(r.schedule) - 1)
                    if r.schedule[i + 1][0] > r.schedule[i][0] >= r.schedule[0][1] and r.tokens[i] != NO_TOKEN
                )  # fmt: skip
                hashes = list(r.output_hashes)
                hashes[i] = skip_hash(*r.schedule[i])
                tokens = list(r.tokens)
                tokens[i] = NO_TOKEN
                forger = Identity.generate()
                forged = attrs.evolve(
                    r, output_hashes=tuple(hashes), output_head=chain_head(r.request, "out", hashes),
                    tokens=tuple(tokens), node_key=forger.public.to_text(), signature="",
                ).signed(forger)  # fmt: skip
                result = audit_window(window, log.inputs, forged)
                assert not result.ok and result.step == i
    assert audited_skips == skips  # every skip the last rank signed was taken as one, none computed
    # The command line says so too, on the last rank's log with the most skips.
    last_logs = [(p, log) for p, log in zip(done.selected, logs, strict=True) if log.receipt.last]
    path, log = max(last_logs, key=lambda pl: _skips_of(pl[1]))
    shown = run_cli("audit", "run", str(path), "--stage", str(paths[-1]))
    assert shown.returncode == 0, shown.stderr
    assert f"{len(log.receipt.schedule)} steps equal ({_skips_of(log)} of them verify rows" in shown.stdout


def _skips_of(log: WindowLog) -> int:
    """How many steps of a last rank's log are skipped verify rows."""
    return sum(skipped_steps(log.receipt))
