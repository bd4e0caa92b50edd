"""Drafters behind one interface (docs/speculation.md § Drafters): prompt lookup, a draft model, the benchmark oracle.

Whatever drafts, the answer is plain ``generate``'s byte for byte (greedy and seeded): in one process on real models
(tiny llamas, SmolLM2 and Gemma drafting for themselves), and in real rings of node processes
(test_ring_drafters.py). The oracle's coins are pure; a draft model with another vocabulary is refused in one line.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from kvasir.core.errors import InputError
from kvasir.core.oracle import Oracle, OracleRun, OracleSpec, coin, oracle_sources
from kvasir.core.speculate import Drafter, PromptLookup
from kvasir.demo import chat_model_path
from kvasir.ring.speculation import PAYOFF_TRIPS, DraftPayoff, RingPace
from kvasir.stage.draftmodel import DraftModel
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.pipeline import LocalPipeline
from kvasir.wire import SamplingParams
from tests.conftest import run_cli

SEEDED = SamplingParams.GREEDY.with_fields({"temperature": 0.8, "seed": 5})
PROMPT = "one two three four five six seven"


def test_oracle_coins_are_pure_and_uniform() -> None:
    assert coin(3, 17) == coin(3, 17) and coin(3, 17) != coin(4, 17)
    xs = [coin(1, j) for j in range(4000)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert abs(sum(x < 0.3 for x in xs) / len(xs) - 0.3) < 0.03


def test_oracle_proposes_the_truth_with_probability_alpha_per_position() -> None:
    truth = list(range(100, 200))
    right = Oracle(truth, 1.0, 0, 512)
    assert right.propose(4) == [100, 101, 102, 103]
    right.emitted(100)
    assert right.propose(3) == [101, 102, 103]
    wrong = Oracle(truth, 0.0, 0, 512).propose(3)
    assert wrong == [101, 102, 103]  # the true token + 1: never the truth
    half = Oracle(truth, 0.5, 9, 512)
    drafts = half.propose(100)
    hits = [d == t for d, t in zip(drafts, truth, strict=True)]
    assert hits == [coin(9, j) < 0.5 for j in range(100)] and 30 < sum(hits) < 70
    # Position-keyed: after 10 emitted tokens, the draft of position j is the same coin as before.
    for t in truth[:10]:
        half.emitted(t)
    assert half.propose(5) == drafts[10:15]
    assert Oracle(truth[:2], 1.0, 0, 512).propose(5) == truth[:2]  # never past the known answer


def test_oracle_file_round_trips_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    spec = OracleSpec(0.7, 3, (OracleRun((1, 2, 3), (4, 5, 6)),))
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps(spec.to_wire()))
    assert OracleSpec.read(path) == spec
    source = oracle_sources(path, 512)((1, 2, 3), 0)
    assert isinstance(source, Oracle) and source.truth == (4, 5, 6) and source.alpha == 0.7
    assert oracle_sources(path, 512)((9,), 0).propose(3) == []  # a prompt it does not know: no drafts
    path.write_text(json.dumps({"alpha": 2.0, "seed": 1, "runs": []}))
    with pytest.raises(InputError, match=r"alpha: must be a number in \[0, 1\]"):
        OracleSpec.read(path)
    path.write_text("[]")
    with pytest.raises(InputError, match=r"oracle\.json"):
        OracleSpec.read(path)


class ListSource:
    """A fake source for the schedule: proposes the next tokens of a fixed list."""

    blocking = False

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.at, self.asked = tokens, 0, list[int]()

    def emitted(self, token: int) -> None:
        self.at += 1

    def propose(self, k: int, *, eager: bool = False) -> list[int]:
        self.asked.append(k)
        return self.tokens[self.at : self.at + k + 3]  # more than asked: the drafter cuts it

    def close(self) -> None:
        pass


def test_the_drafter_schedules_any_source() -> None:
    source = ListSource(list(range(50)))
    drafter = Drafter.for_prompt([7, 7], 4, source)
    assert drafter.drafts(100) == [0]  # K starts at 1
    drafter.verified(1, 1, 0)
    for t in (0, 1):
        drafter.emitted(t)
    assert drafter.drafts(100) == [2, 3, 4]  # full acceptance: K + 2
    assert drafter.drafts(2) == [2]  # at most may_emit - 1 drafts
    assert isinstance(Drafter.for_prompt([1, 2], 3).source, PromptLookup)  # the default: prompt lookup
    fixed = Drafter.for_prompt([7, 7], 4, ListSource(list(range(50))), fixed=True)
    for drafted, accepted in ((4, 0), (4, 1), (0, 0), (4, 4)):
        assert len(fixed.drafts(100)) == 4 and fixed.eager  # K at its maximum whatever was accepted
        fixed.verified(drafted, accepted, 0)


def _generate(pipe: LocalPipeline, prompt: list[int], params: SamplingParams, n: int, **kw: object) -> list[int]:
    return pipe.generate(prompt, params, n, **kw).tokens  # type: ignore[arg-type]


def _oracle_source(spec: OracleSpec, prompt: Sequence[int], _seq: int) -> Oracle:
    return spec.source(prompt, 512)


def test_draft_model_and_oracle_answers_equal_plain_generate(tiny_model: Callable[..., Path]) -> None:
    """A tiny llama drafted for by itself (every draft right), by another tiny llama with its vocabulary (drafts
    mostly wrong) and by the oracle at α 0.3 and 0.9: greedy and seeded tokens equal the plain loop's."""
    target = tiny_model("llama", "f32")
    other = tiny_model("llama", "f32", seed=1)
    with Stage.load(StageConfig(target, n_ctx=256, n_seq_max=1, n_threads=1)) as stage:
        pipe = LocalPipeline([stage])
        prompt = stage.vocab.tokenize(PROMPT)
        plain = {p: _generate(pipe, prompt, p, 40) for p in (SamplingParams.GREEDY, SEEDED)}
        for path in (target, other):
            draft = DraftModel.load(path, stage.vocab, n_ctx=256, n_threads=1)
            try:
                for params, want in plain.items():
                    got = pipe.generate(prompt, params, 40, speculate=4, draft_sources=draft.source)
                    assert got.tokens == want, (path, params)
                    spec = got.speculation
                    assert spec is not None and spec.drafted > 0
                    if path == target and params is SamplingParams.GREEDY:
                        # Drafting for itself, greedily: right but where a near tie falls the other way (its cache
                        # was computed in other batch shapes than the target's, so its last bits differ).
                        assert spec.accepted >= 0.9 * spec.drafted
            finally:
                draft.close()
        for alpha in (0.3, 0.9):
            oracle = OracleSpec(alpha, 1, (OracleRun(tuple(prompt), tuple(plain[SamplingParams.GREEDY])),))
            sources = functools.partial(_oracle_source, oracle)
            got = pipe.generate(prompt, SamplingParams.GREEDY, 40, speculate=6, draft_sources=sources)
            assert got.tokens == plain[SamplingParams.GREEDY]
            assert got.speculation is not None and got.speculation.drafted > 0
            assert (got.speculation.acceptance > 0.6) == (alpha > 0.5)


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model: Callable[..., Path]) -> None:
    target = tiny_model("llama", "f32")
    bigger = tiny_model("llama", "f32", n_vocab=600)
    with (
        Stage.load(StageConfig(target, n_ctx=64, n_seq_max=1, n_threads=1)) as stage,
        pytest.raises(InputError, match="600 tokens, the model's has 512"),
    ):
        DraftModel.load(bigger, stage.vocab, n_ctx=64)
    out = run_cli("generate", str(target), "--prompt", "x", "--speculate", "2", "--draft-model", str(bigger))
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "not the model's vocabulary" in out.stderr


@pytest.mark.slow
def test_real_models_draft_for_themselves_and_refuse_each_other(gemma_path: Path) -> None:
    """SmolLM2 and Gemma 3 270M each drafting for itself through `generate --speculate 4 --draft-model`: the plain
    answer, (nearly) every draft accepted (greedy); SmolLM2 drafting for Gemma (49k against 262k tokens): one line,
    exit 2."""
    smol, gemma = chat_model_path(), gemma_path
    common = ["--max-tokens", "24", "--threads", "1", "--json", "--ctx", "256"]
    for model, prompt in ((smol, "The best way to learn a language is"), (gemma, "The capital of France is")):
        plain = run_cli("generate", str(model), "--prompt", prompt, *common)
        spec = run_cli(
            "generate", str(model), "--prompt", prompt, *common, "--speculate", "4", "--draft-model", str(model)
        )
        assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
        got = json.loads(spec.stdout)
        assert got["tokens"] == json.loads(plain.stdout)["tokens"]
        assert got["speculation"]["accepted"] >= 0.9 * got["speculation"]["drafted"] > 0
    bad = run_cli("generate", str(gemma), "--prompt", "x", "--speculate", "2", "--draft-model", str(smol))
    assert bad.returncode == 2 and "its vocabulary has 49152 tokens, the model's has 262144" in bad.stderr
    assert bad.stderr.count("\n") == 1


def test_the_acceptance_gate_closes_when_drafting_trips_are_slower_than_plain_ones() -> None:
    pace = RingPace()
    assert pace.plain_trip_s() is None  # too few passes to judge
    for wait in (0.050, 0.060, 0.055, 0.070):
        pace.waits.append(wait)
    pace.rows.append(0.005)
    plain = pace.plain_trip_s()
    assert plain == pytest.approx(0.0575 + 0.005)
    paying = DraftPayoff()
    for _ in range(PAYOFF_TRIPS):  # 3 tokens per 80 ms trip: 37.5 tokens/s against 16 plain
        assert paying.pays(plain)
        paying.trip(3, 0.080)
    assert paying.pays(plain) and not paying.closed
    losing = DraftPayoff()
    for _ in range(PAYOFF_TRIPS):  # 1.1 tokens per 75 ms trip: 14.7 tokens/s, below 0.95 × 16
        assert losing.pays(plain)  # too few trips yet: no judgement
        losing.trip(1, 0.068)
    assert not losing.pays(plain) and losing.closed
    losing.trip(9, 0.001)
    assert not losing.pays(plain)  # closed for the rest of the request
