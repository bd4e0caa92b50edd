"""MTP (nextn) layers: inspect reports them, slice gives them to the last window, the last rank drafts with them.

The fixture is the tiny random-weight qwen35moe with one MTP block (``n_nextn=1``): its drafts are noise (acceptance
says nothing about a real model), so these tests check the machinery and exactness, never acceptance.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvasir.core.errors import InputError, StageError
from kvasir.core.sampling import SamplingParams
from kvasir.core.speculate import K_LIMIT, RowSampler
from kvasir.shard.gguf_file import describe
from kvasir.shard.gguf_io import read_gguf
from kvasir.shard.slice import slice_model
from kvasir.stage.engine import FloatArray, Stage, StageConfig
from kvasir.stage.mtp import MtpDrafter, MtpHead
from kvasir.stage.mtp_pipeline import generate_mtp
from kvasir.stage.pipeline import LocalPipeline
from tests.conftest import run_cli

N_MAIN = 8
MTP_DIMS = {"n_layer": N_MAIN, "n_nextn": 1}


@pytest.fixture(scope="module")
def mtp_model(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("qwen35moe", "q8_0", **MTP_DIMS)


def _nextn_tensors(path: Path) -> set[str]:
    return {t.name for t in read_gguf(path).tensors if ".nextn." in t.name}


def test_fixture_carries_one_mtp_block(mtp_model: Path) -> None:
    info = describe(mtp_model)
    assert (info.n_layer, info.nextn_layers, info.n_main) == (N_MAIN + 1, 1, N_MAIN)
    assert _nextn_tensors(mtp_model) == {
        f"blk.{N_MAIN}.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")
    }


def test_inspect_says_whether_a_model_has_mtp_layers(mtp_model: Path, tiny_model: Callable[..., Path]) -> None:
    r = run_cli("inspect", str(mtp_model))
    assert r.returncode == 0, r.stderr
    assert f"{N_MAIN} (+1 MTP)" in r.stdout and "MTP layers" in r.stdout
    assert json.loads(run_cli("inspect", str(mtp_model), "--json").stdout)["nextn_layers"] == 1
    plain = run_cli("inspect", str(tiny_model("qwen35moe", "q8_0")))
    assert "MTP layers" in plain.stdout and "none" in plain.stdout


def test_only_the_last_window_carries_the_mtp_block(mtp_model: Path, tmp_path: Path) -> None:
    src = read_gguf(mtp_model)
    stages = [slice_model(mtp_model, a, b, tmp_path / f"{a}.gguf") for a, b in [(0, 3), (3, 5), (5, N_MAIN)]]
    for res in stages[:-1]:
        gg = read_gguf(res.path)
        assert not _nextn_tensors(res.path) and gg.get("qwen35moe.nextn_predict_layers") == 0
        assert describe(res.path).nextn_layers == 0
    last = stages[-1].path
    gg = read_gguf(last)
    n_stage = N_MAIN - 5  # the window's layers, then the MTP block renumbered after them
    assert gg.get("qwen35moe.nextn_predict_layers") == 1 and gg.get("qwen35moe.block_count") == n_stage + 1
    src_mtp = {t.name.replace(f"blk.{N_MAIN}.", f"blk.{n_stage}.", 1): t.nbytes for t in src.tensors}
    stage_mtp = {t.name: t.nbytes for t in gg.tensors if t.name.startswith(f"blk.{n_stage}.")}
    assert stage_mtp and all(src_mtp[name] == n for name, n in stage_mtp.items())
    assert len(stage_mtp) == sum(t.name.startswith(f"blk.{N_MAIN}.") for t in src.tensors)
    # The MTP block embeds its input token with the model's token embedding: the last window carries all of it.
    emb = {t.name: t.shape for t in gg.tensors}["token_embd.weight"]
    assert emb == next(t.shape for t in src.tensors if t.name == "token_embd.weight")
    # The explicit layer-kind array marks the MTP block as full attention (not recurrent).
    assert list(gg.get("qwen35moe.attention.recurrent_layers"))[-1] is False
    info = describe(last)
    assert info.stage_window == (5, N_MAIN) and info.nextn_layers == 1
    r = run_cli("inspect", str(last))
    assert "this last window carries them" in r.stdout
    with Stage.load(StageConfig(last, n_ctx=64, n_seq_max=1, n_threads=1)) as stage:
        assert stage.info.last and stage.info.start == 5


# ------------------------------------------------------------------------------------------ drafting and exactness

PROMPT = "The quick brown fox jumps over the lazy dog. A ring of devices runs one model"
SPLIT = [(0, 3), (3, 5), (5, N_MAIN)]


@pytest.fixture(scope="module")
def stage_files(mtp_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("mtp-stages")
    return [slice_model(mtp_model, a, b, out / f"{a}-{b}.gguf").path for a, b in SPLIT]


def _pipeline(paths: list[Path], *, mtp: bool = False, rollback: int = 0) -> LocalPipeline:
    stages = [
        Stage.load(
            StageConfig(p, n_ctx=256, n_seq_max=1, n_threads=1, mtp=mtp and i == len(paths) - 1, rollback=rollback)
        )
        for i, p in enumerate(paths)
    ]
    return LocalPipeline(stages)


def _close(pipe: LocalPipeline) -> None:
    for stage in pipe.stages:
        stage.close()


@pytest.fixture(scope="module")
def plain(stage_files: list[Path]) -> Iterator[LocalPipeline]:
    pipe = _pipeline(stage_files)
    yield pipe
    _close(pipe)


@pytest.fixture(scope="module")
def drafting(stage_files: list[Path]) -> Iterator[tuple[LocalPipeline, MtpHead]]:
    pipe = _pipeline(stage_files, mtp=True, rollback=K_LIMIT + 1)
    head = MtpHead(pipe.last)
    yield pipe, head
    head.close()
    _close(pipe)


def test_mtp_stage_keeps_the_plain_logits(stage_files: list[Path], mtp_model: Path, tmp_path: Path) -> None:
    """The nextn hidden state of every row is extra output: the last window's logits stay the plain ones, bit for
    bit, for a prefill chunk and a one-token step, on the last window and on the whole model as one stage."""
    whole = slice_model(mtp_model, 0, N_MAIN, tmp_path / "whole.gguf").path
    for path, hidden in [(stage_files[-1], True), (whole, False)]:
        logits = []
        for mtp in (False, True):
            with Stage.load(StageConfig(path, n_ctx=128, n_seq_max=1, n_threads=1, mtp=mtp)) as stage:
                rng = np.random.default_rng(3)
                if hidden:
                    stage.forward(0, 0, hidden=rng.standard_normal((37, stage.info.n_embd), dtype=np.float32))
                else:
                    stage.forward(0, 0, tokens=[int(t) for t in rng.integers(5, 500, 37)])
                first = stage.logits()
                if mtp:
                    assert stage.nextn_hidden(37).shape == (37, stage.info.n_embd)
                if hidden:
                    stage.forward(0, 37, hidden=rng.standard_normal((1, stage.info.n_embd), dtype=np.float32))
                else:
                    stage.forward(0, 37, tokens=[42])
                logits.append((first, stage.logits()))
        assert all(np.array_equal(a, b) for a, b in zip(logits[0], logits[1], strict=True))


def test_mtp_is_refused_where_there_is_no_mtp_block(stage_files: list[Path], tiny_model: Callable[..., Path]) -> None:
    with pytest.raises(StageError, match="MTP"):
        Stage.load(StageConfig(stage_files[0], n_ctx=64, n_seq_max=1, n_threads=1, mtp=True))
    with pytest.raises(StageError, match="MTP"):
        Stage.load(StageConfig(tiny_model("qwen35moe", "q8_0"), n_ctx=64, n_seq_max=1, n_threads=1, mtp=True))


def test_hybrid_windows_roll_back_exactly_with_snapshots(stage_files: list[Path], plain: LocalPipeline) -> None:
    """Recurrent layers cannot forget positions; with snapshots of their state a hybrid pipeline speculates exactly.
    Drafts here are the true continuation for 0..3 tokens and then a wrong one, so rollbacks land at every row."""
    prompt = plain.last.vocab.tokenize(PROMPT, add_special=True)
    want = plain.generate(prompt, SamplingParams(temperature=0.0), 24).tokens
    with pytest.raises(StageError, match="cannot roll"):
        _oracle_steps(plain, prompt, want)
    spec = _pipeline(stage_files, rollback=5)
    try:
        got, accepted = _oracle_steps(spec, prompt, want)
    finally:
        _close(spec)
    assert got == want and accepted > 0


def _oracle_steps(pipe: LocalPipeline, prompt: list[int], want: list[int]) -> tuple[list[int], int]:
    """Greedy speculative steps (``LocalPipeline``'s schedule) whose drafts are ``want``'s next 0, 1, 2, 3 tokens and
    then a wrong token: the tokens sampled, and the drafts accepted."""
    params = SamplingParams(temperature=0.0)
    sampler = pipe.last.new_sampler(params)
    try:
        pipe.prefill(0, prompt)
        got, accepted, pos = [pipe.last.sample(sampler)], 0, len(prompt)
        step = 0
        while len(got) < len(want):
            good = want[len(got) : len(got) + step % 4]
            drafts = [*good, (want[len(got) + len(good)] + 1) % 500 if len(got) + len(good) < len(want) else 7]
            rows = RowSampler(lambda: pipe.last.sample(sampler), drafts)
            pipe.verify(0, pos, [got[-1], *drafts], rows)
            n_ok = len(rows.tokens) - 1
            for stage in pipe.stages[:-1]:
                stage.truncate(0, pos + 1 + n_ok)
            got += rows.tokens
            accepted += n_ok
            pos += 1 + n_ok
            step += 1
    finally:
        sampler.close()
        pipe.free(0)
    return got[: len(want)], accepted


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=11)])
def test_mtp_drafting_answers_exactly_as_plain_generate(
    plain: LocalPipeline, drafting: tuple[LocalPipeline, MtpHead], params: SamplingParams, k: int
) -> None:
    pipe, head = drafting
    prompt = pipe.last.vocab.tokenize(PROMPT, add_special=True)
    want = plain.generate(prompt, params, 40)
    got, cost = generate_mtp(pipe, head, prompt, params, 40, k)
    assert got.tokens == want.tokens and got.text == want.text and got.stop_reason == want.stop_reason
    spec = got.speculation
    assert spec is not None and spec.drafted == cost.drafted > 0
    sampled = len(want.tokens) + (want.stop_reason == "eog")  # the prefill's sample, then accepted + 1 per step
    assert spec.verify_batches + spec.plain_steps == sampled - 1 - spec.accepted
    assert cost.draft_s > cost.prompt_s > 0


def test_mtp_needs_snapshots_on_hybrid_windows(stage_files: list[Path]) -> None:
    pipe = _pipeline(stage_files, mtp=True, rollback=2)
    try:
        with MtpHead(pipe.last) as head, pytest.raises(InputError, match="snapshots"):
            generate_mtp(pipe, head, [1, 300, 301], SamplingParams(temperature=0.0), 8, 4)
    finally:
        _close(pipe)


def test_chain_guesses_leave_no_trace(drafting: tuple[LocalPipeline, MtpHead], plain: LocalPipeline) -> None:
    """Drafting K tokens writes K - 1 guesses into the MTP cache; the next true pairs replace them, so a drafter that
    drafted chains of 5 at every step proposes what one that never chained proposes, its MTP state equal bit for bit."""
    pipe, head = drafting
    prompt = pipe.last.vocab.tokenize(PROMPT, add_special=True)
    out = plain.generate(prompt, SamplingParams(temperature=0.0), 12).tokens
    # The target's nextn rows of the true sequence, from a plain pass over prompt + output.
    pipe.prefill(0, prompt + out)
    rows = pipe.last.nextn_hidden(len(prompt + out))
    pipe.free(0)
    finals, seeds = [], []
    for k in (5, 1):  # one after the other on sequence 0: the first chains 5 drafts at every step
        drafter = MtpDrafter(head, 0)
        drafter.accept(prompt)
        drafter.observe(0, rows[: len(prompt)])
        for i, token in enumerate(out):
            drafter.accept([token])
            finals.append(drafter.propose(k))  # the same pairs per MTP decode either way: only the chains differ
            drafter.observe(len(prompt) + i, rows[len(prompt) + i : len(prompt) + i + 1])
        assert drafter._seed is not None
        seeds.append(drafter._seed[1])
        drafter.close()
    chained, straight = finals[: len(out)], finals[len(out) :]
    assert all(len(f) == 5 for f in chained) and [f[:1] for f in chained] == straight
    assert np.array_equal(seeds[0], seeds[1])


def test_dense_qwen35_drafts_with_its_mtp_block_exactly(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """The dense Qwen3.5 (``qwen35``: its MTP block has a dense feed-forward) drafts the same way, exactly."""
    model = tiny_model("qwen35", "q8_0", **MTP_DIMS)
    paths = [slice_model(model, a, b, tmp_path / f"{a}.gguf").path for a, b in [(0, 5), (5, N_MAIN)]]
    plain, spec = _pipeline(paths), _pipeline(paths, mtp=True, rollback=3)
    try:
        with MtpHead(spec.last) as head:
            prompt = plain.last.vocab.tokenize(PROMPT, add_special=True)
            for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3)):
                want = plain.generate(prompt, params, 24)
                got, cost = generate_mtp(spec, head, prompt, params, 24, 2)
                assert got.tokens == want.tokens and got.text == want.text and cost.drafted > 0
    finally:
        _close(plain)
        _close(spec)


# ------------------------------------------------------------------------------------------ the drafter's protocol


class _FakeMtp:
    """Records the MTP calls; drafts 1000 + the position drafted for, and a hidden row tagged with it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def decode(self, seq_id: int, pos0: int, tokens: Sequence[int], hidden: FloatArray) -> tuple[int, FloatArray]:
        self.calls.append(("decode", pos0, list(tokens), [float(r[0]) for r in hidden]))
        end = pos0 + len(tokens)
        return 1000 + end, np.full(4, -end, np.float32)

    def truncate(self, seq_id: int, pos: int) -> None:
        self.calls.append(("truncate", pos))

    def free(self, seq_id: int) -> None:
        self.calls.append(("free",))


def _rows(*positions: int) -> FloatArray:
    """Hidden rows standing for h at these positions (value = position)."""
    return np.array([[float(p)] * 4 for p in positions], np.float32)


def test_drafter_pairs_each_token_with_the_hidden_state_before_it() -> None:
    fake = _FakeMtp()
    d = MtpDrafter(fake, 0)
    d.accept([10, 11, 12])  # prompt x0..x2
    d.observe(0, _rows(0, 1, 2))
    d.accept([13])  # x3, sampled from row 2
    assert d.propose(3) == [1004, 1005, 1006]
    assert fake.calls == [
        ("decode", 1, [11, 12, 13], [0.0, 1.0, 2.0]),  # (x_q+1, h_q) at q + 1: the prompt's pairs and x3's
        ("decode", 4, [1004], [-4.0]),  # the chain: the MTP's own hidden state
        ("decode", 5, [1005], [-5.0]),
    ]
    fake.calls.clear()
    # The verify step fed x3, d1, d2 at 3..5: row 3 sampled d1 (accepted), row 4 sampled 77 (d2 rejected).
    d.observe(3, _rows(3))
    d.observe(4, _rows(4))
    d.accept([1004, 77])
    assert d.propose(2) == [1006, 1007]
    assert fake.calls == [
        ("truncate", 4),  # the chain's guesses at 4 and 5 go first
        ("decode", 4, [1004, 77], [3.0, 4.0]),
        ("decode", 6, [1006], [-6.0]),
    ]
    fake.calls.clear()
    assert d.propose(1) == [1006]  # asked again with nothing new: the chain is dropped, the true seed reused
    assert fake.calls == [("truncate", 6)]
    fake.calls.clear()
    d.accept([55])
    assert d.propose(2) == []  # x7 has no h_6 yet: no draft rather than a wrong pair
    d.rollback(6)  # the sequence ends before 6 after all (a failover replay, a cancelled step)
    assert d.tokens == [10, 11, 12, 13, 1004, 77] and d.committed == 6
    d.close()
    assert fake.calls[-1] == ("free",)


def test_generate_cli_drafts_with_mtp(mtp_model: Path, tiny_model: Callable[..., Path]) -> None:
    """``kvasir generate --mtp K`` on a split model answers as plain ``generate``; ``--speculate K`` works on the
    hybrid windows too (snapshots), and a model without an MTP block is refused in one line."""
    base = [str(mtp_model), "--splits", "0,3,8", "--prompt", "Hello ring", "--max-tokens", "12", "--json"]
    base += ["--threads", "1", "--temperature", "0.9", "--seed", "4"]
    runs = [run_cli("generate", *base, *extra) for extra in ([], ["--mtp", "2"], ["--speculate", "2"])]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    out = [json.loads(r.stdout) for r in runs]
    assert out[0]["tokens"] == out[1]["tokens"] == out[2]["tokens"] and out[0]["text"] == out[1]["text"]
    assert out[1]["speculation"]["drafted"] > 0
    r = run_cli("generate", str(tiny_model("qwen35moe", "q8_0")), "--prompt", "Hi", "--max-tokens", "2", "--mtp", "2")
    assert r.returncode != 0 and "MTP" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
