"""Speculative decoding: the pure draft and K decisions, and `generate --speculate K` on the real Gemma 3 270M."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvasir.core.errors import InputError
from kvasir.core.speculate import (
    Drafter,
    NgramIndex,
    SpeculationStats,
    adapt_k,
    draft_lookup,
    eager_k,
    initial_k,
    latency_bound,
    resume_k,
)
from kvasir.ring.speculation import RingPace
from kvasir.shard.cache import parse_splits, stage_files
from kvasir.stage.engine import BatchItem, Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.wire import SamplingParams
from tests.conftest import run_cli


def test_draft_lookup_continues_the_most_recent_longest_match() -> None:
    # Suffix 3-gram (1, 2, 3) occurred at 0 and 5; the most recent (5) is followed by 9, 9.
    history = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 1, 2, 3]
    assert draft_lookup(history, 4) == [9, 9, 1, 2]
    assert draft_lookup(history, 1) == [9]
    # A longer match wins over a more recent shorter one: (7, 8) last occurs at 4 but (6, 7, 8) at 0.
    assert draft_lookup([6, 7, 8, 1, 7, 8, 2, 6, 7, 8], 2) == [1, 7]


def test_draft_lookup_falls_back_to_shorter_ngrams_and_stops_at_the_end() -> None:
    assert draft_lookup([5, 1, 2, 6, 2], 3, ngram_min=1) == [6, 2]  # only the 1-gram (2,) matches, 2 tokens follow
    assert draft_lookup([5, 1, 2, 6, 2], 3) == []  # by default a single token is too weak a match
    assert draft_lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert draft_lookup([7, 7, 7], 5) == [7]  # the match may overlap the suffix
    assert draft_lookup([4, 1, 2, 5, 1, 2], 3) == [5, 1, 2]  # a 2-gram is enough
    assert draft_lookup([1, 2, 1, 2], 0) == []
    assert draft_lookup([3], 4) == []
    assert draft_lookup([], 4) == []


def test_draft_lookup_respects_the_ngram_bounds() -> None:
    history = [4, 1, 2, 9, 2]
    assert draft_lookup(history, 2, ngram_min=2) == []  # (9, 2) never occurred before
    assert draft_lookup(history, 2, ngram_max=1, ngram_min=1) == [9, 2]


def test_adapt_k_grows_on_full_acceptance_and_shrinks_to_what_was_accepted() -> None:
    assert adapt_k(4, 4, 4, 8) == 6
    assert adapt_k(7, 7, 7, 8) == 8  # capped at k_max
    assert adapt_k(6, 6, 2, 8) == 3  # one more than accepted
    assert adapt_k(6, 6, 5, 8) == 5  # but always shrinks after a rejection
    assert adapt_k(3, 3, 0, 8) == 1  # not below 1 while more than one draft was tried
    assert adapt_k(1, 1, 0, 8) == 0  # a lone draft rejected: drafting off (resume_k turns it back on)
    assert adapt_k(2, 2, 1, 8) == 1
    assert adapt_k(5, 0, 0, 8) == 5  # no drafts: nothing learned
    assert adapt_k(4, 2, 2, 8) == 6  # fewer drafts than k (short match), all accepted: still grows


@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.integers(0, 8),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_the_ngram_index_answers_as_the_lookup_does(history: list[int], k: int, ngram_max: int, extra: int) -> None:
    """Small alphabets, so n-grams repeat often: built from a prompt, then grown token by token, the index gives
    draft_lookup's drafts after every token."""
    ngram_min = max(1, ngram_max - extra)
    split = len(history) // 2
    index = NgramIndex(history[:split], ngram_max=ngram_max, ngram_min=ngram_min)
    for i in range(split, len(history) + 1):
        assert index.lookup(k) == draft_lookup(history[:i], k, ngram_max=ngram_max, ngram_min=ngram_min)
        # A lookup may narrow the bounds (the drafter indexes single tokens and looks up pairs when not eager).
        narrow = ngram_min + 1
        assert index.lookup(k, narrow) == draft_lookup(history[:i], k, ngram_max=ngram_max, ngram_min=narrow)
        if i < len(history):
            index.append(history[i])


def test_drafting_resumes_when_its_shadow_guess_is_right() -> None:
    def shadow(k: int, k_max: int) -> list[int]:
        d = Drafter.for_prompt([4, 1, 2, 5, 1, 2], k_max)
        d.k = k
        d.drafts(may_emit=10)
        return d.shadow

    assert shadow(0, 6) == [5] and shadow(2, 6) == [] and shadow(0, 0) == []
    assert resume_k([5], 5, 6) == 1 and resume_k([5], 6, 6) == 0 and resume_k([], 5, 6) == 0
    assert initial_k(6) == 1 and initial_k(0) == 0


def test_eager_drafting_guesses_from_single_tokens_and_never_stops() -> None:
    assert eager_k(4, 4, 6) == 6 and eager_k(0, 0, 6) == 6  # all accepted, or nothing drafted: back to the maximum
    assert eager_k(6, 1, 6) == 3 and eager_k(6, 5, 6) == 6 and eager_k(3, 0, 6) == 2  # never off
    d = Drafter.for_prompt([5, 1, 2, 6, 2], 6)
    assert d.drafts(may_emit=10) == []  # adaptive: a single-token match is too weak
    assert d.drafts(may_emit=10, eager=True) == [6] and d.eager  # a request starts at k = 1
    d.verified(1, 0, 9)
    assert d.k == 2 and d.stats.eager_steps == 1  # a lone draft rejected: still on, two more than accepted
    assert d.drafts(may_emit=10, eager=True) == [6, 2]
    d.k = 0
    d.drafts(may_emit=10, eager=True)
    assert d.k == 6  # drafting was off: a latency-bound ring turns it on at once


def test_a_ring_is_latency_bound_when_a_pass_outweighs_wasted_rows() -> None:
    assert latency_bound(0.050, 0.002, 6)  # a WAN ring of a small model: 50 ms round trip, 2 ms rows
    assert not latency_bound(0.010, 0.010, 6)  # loopback, rows cost as much as the pass
    assert not latency_bound(0.020, 0.002, 6)  # 24 ms of rejected rows outweigh a 20 ms pass
    pace = RingPace()
    assert not pace.eager("auto", 6) and pace.eager("eager", 6) and not pace.eager("adaptive", 6)
    pace.rows.extend([0.002] * 5)
    pace.waits.extend([0.060, 0.200, 0.055])
    assert not pace.eager("auto", 6)  # too few passes seen to judge
    pace.waits.append(0.070)
    assert pace.eager("auto", 6)
    pace.waits.append(0.010)  # the least wait stands for the latency: one fast pass shows the ring is not bound
    assert not pace.eager("auto", 6)


def test_speculation_stats_count_batches_and_plain_steps() -> None:
    stats = SpeculationStats().after(4, 3).after(0, 0).after(2, 2)
    assert (stats.verify_batches, stats.drafted, stats.accepted, stats.plain_steps) == (2, 6, 5, 1)
    assert stats.to_json()["acceptance"] == pytest.approx(5 / 6, abs=1e-4)
    assert SpeculationStats().acceptance == 0.0


REPEATING = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog sat on the log. The cat"
STORY = "Write a short story about a lighthouse keeper who finds a strange map"


def test_speculative_generation_on_gemma(gemma_path: Path) -> None:
    """Greedy: `--speculate K` reruns are identical, K=0 is the plain loop, and the output equals the plain loop's
    (every verify row is the plain step's computation). Seeded sampling: the sampler sees the plain loop's calls,
    so its output equals the plain loop's too."""
    with Stage.load(StageConfig(gemma_path, n_ctx=512, n_seq_max=1, n_threads=1)) as stage:
        pipe = LocalPipeline([stage])
        greedy = SamplingParams.GREEDY
        for text in (REPEATING, STORY):
            prompt = stage.vocab.tokenize(text)
            plain = pipe.generate(prompt, greedy, 40)
            k0 = pipe.generate(prompt, greedy, 40, speculate=0)
            assert k0.tokens == plain.tokens and k0.speculation is not None and k0.speculation.drafted == 0
            first = pipe.generate(prompt, greedy, 40, speculate=6)
            again = pipe.generate(prompt, greedy, 40, speculate=6)
            assert first.tokens == again.tokens and first.speculation == again.speculation
            assert first.tokens == plain.tokens
            assert first.speculation is not None
            if text is REPEATING:
                assert first.speculation.accepted >= 20, first.speculation
        seeded = SamplingParams.GREEDY.with_fields({"temperature": 0.8, "seed": 11})
        prompt = stage.vocab.tokenize(REPEATING)
        spec = pipe.generate(prompt, seeded, 32, speculate=4)
        assert spec.tokens == pipe.generate(prompt, seeded, 32, speculate=4).tokens
        assert spec.tokens == pipe.generate(prompt, seeded, 32).tokens


def test_verify_rows_are_the_plain_steps_bits(gemma_path: Path, cache_dir: Path) -> None:
    """A verify batch through two windows gives, byte for byte, the boundary rows and logits of the one-token
    steps it stands for; the last window stops at ``until``'s word and computes nothing after it."""
    paths = stage_files(gemma_path, parse_splits("0,9,18", 18), cache_dir)
    configs = [StageConfig(p, n_ctx=128, n_seq_max=1, n_threads=1) for p in paths]
    with Stage.load(configs[0]) as a, Stage.load(configs[1]) as b:
        prompt = a.vocab.tokenize(REPEATING)
        fed = a.vocab.tokenize(" The dog sat on")[:4]
        hidden = a.forward(0, 0, tokens=prompt)
        assert hidden is not None
        b.forward(0, 0, hidden=hidden)
        n = len(prompt)
        steps, logits = [], []
        for i, t in enumerate(fed):
            row = a.forward(0, n + i, tokens=[t])
            assert row is not None
            steps.append(row)
            b.forward(0, n + i, hidden=row)
            logits.append(b.logits())
        a.truncate(0, n)
        b.truncate(0, n)
        rows = a.forward_verify(0, n, tokens=fed)
        assert rows is not None and rows.tobytes() == np.concatenate(steps).tobytes()
        seen: list[bytes] = []

        def until(i: int) -> bool:
            seen.append(b.logits().tobytes())
            return i == 1  # as a rejected second draft: rows 2 and 3 are not computed

        assert b.forward_verify(0, n, hidden=rows, until=until) is None
        assert seen == [x.tobytes() for x in logits[:2]]
        b.forward(0, n + 2, hidden=rows[2:3])  # the cache ended right after row 1: the next row fits there
        assert b.logits().tobytes() == logits[2].tobytes()


def test_generate_cli_speculate(gemma_path: Path) -> None:
    common = ["generate", str(gemma_path), "--prompt", REPEATING, "--max-tokens", "24", "--threads", "1", "--json"]
    spec = run_cli(*common, "--speculate", "4", "--splits", "0,9,18")
    assert spec.returncode == 0, spec.stderr
    out = json.loads(spec.stdout)
    assert out["speculation"]["accepted"] > 0
    plain = run_cli(*common)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["tokens"] == out["tokens"] and "speculation" not in json.loads(plain.stdout)
    bad = run_cli(*common, "--speculate", "99")
    assert bad.returncode != 0 and "--speculate" in bad.stderr


def test_forward_batch_rows_follow_items_and_truncate_rolls_back(
    tiny_model: Callable[..., Path], cache_dir: Path
) -> None:
    """The engine calls a ring will use: a batched step's rows belong to their items (same argmax, close numbers:
    batching is not bit-exact, docs/speculation.md), and truncate() restores a sequence's cache exactly."""
    paths = stage_files(tiny_model("llama", "q8_0"), parse_splits("0,3,6", 6), cache_dir)
    configs = [StageConfig(p, n_ctx=64, n_seq_max=3, n_threads=1) for p in paths]
    with Stage.load(configs[0]) as a, Stage.load(configs[1]) as b:
        prompts = [[1, 5, 9, 2], [7, 3, 3, 8], [4, 4, 6, 2]]
        for s, p in enumerate(prompts):
            hidden = a.forward(s, 0, tokens=p)
            assert hidden is not None
            b.forward(s, 0, hidden=hidden)

        def alone(s: int) -> tuple[np.ndarray, np.ndarray]:
            hidden = a.forward(s, 4, tokens=[s + 10])
            assert hidden is not None
            b.forward(s, 4, hidden=hidden)
            out = hidden.copy(), b.logits()
            a.truncate(s, 4)
            b.truncate(s, 4)
            return out

        ref = [alone(s) for s in range(3)]
        assert all(np.array_equal(alone(s)[1], ref[s][1]) for s in range(3))  # rolled back: the same bits again
        members = [0, 1, 2]
        batch = a.forward_batch([BatchItem(s, 4, tokens=[s + 10]) for s in members])
        assert b.forward_batch([BatchItem(s, 4, hidden=h) for s, h in zip(members, batch, strict=True)]) == [None] * 3
        for i, s in enumerate(members):
            h, logits = batch[i], b.logits(Stage.batch_index(i, 1))
            assert h is not None and np.allclose(h, ref[s][0], atol=1e-3)
            assert np.allclose(logits, ref[s][1], atol=1e-2) and np.argmax(logits) == np.argmax(ref[s][1])
        with pytest.raises(InputError):
            a.forward_batch([BatchItem(0, 5, tokens=[1]), BatchItem(0, 6, tokens=[2])])
        with pytest.raises(InputError):  # llama.cpp would hand the boundary rows back in id order
            a.forward_batch([BatchItem(2, 5, tokens=[1]), BatchItem(1, 5, tokens=[2])])
        with pytest.raises(InputError):
            a.forward_batch([BatchItem(0, 5, tokens=[1]), BatchItem(1, 5, tokens=[2, 3])])
