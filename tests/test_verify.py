"""Verifiable contribution on real llama.cpp: receipts, audits, fraud proofs, probes and token receipts.

A tiny random llama (6 layers, f32) is split 0:2, 2:4, 4:6; requests are served through the three windows with
receipts (tests.harness.audits), and an auditor holding its own copy of each window (loaded separately, other
thread count and context size) re-executes them. Cheaters run rank 1 (or the last rank) dishonestly.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity
from kvasir.core.sampling import SamplingParams
from kvasir.shard.cache import default_cache_dir, model_sha256, stage_files
from kvasir.shard.gguf_io import read_gguf
from kvasir.stage.engine import Stage, StageConfig
from kvasir.testing.tinymodels import tiny_model_cached
from kvasir.verify.audit import (
    FraudProof,
    LoggedInput,
    StepOutput,
    WindowLog,
    audit_window,
    check_tokens,
    legitimate_skips,
    make_proof,
    verify_proof,
    write_json,
)
from kvasir.verify.commit import (
    LOGITS_TOKEN,
    VerificationError,
    WindowReceipt,
    chain_head,
    first_mismatch,
    sample_payload,
    step_hash,
    successor_mismatch,
)
from kvasir.verify.kernel import stage_kernel_class
from kvasir.verify.probe import AdmissionRefused, check_probe, probe_hash
from tests.conftest import run_cli
from tests.harness.audits import Cheat, Served, serve_request

WINDOWS = [(0, 2), (2, 4), (4, 6)]
SAMPLING = SamplingParams(temperature=0.8, seed=1234)


@attrs.frozen
class Fixture:
    sha: str
    files: list[Path]
    servers: list[Stage]
    auditors: list[Stage]
    ids: list[Identity]
    probes: list[dict[str, str]]
    cheat_files: dict[str, Path]


def _load(path: Path, threads: int, n_ctx: int) -> Stage:
    return Stage.load(StageConfig(path, n_ctx=n_ctx, n_seq_max=2, n_threads=threads))


def _perturb(src: Path, dst: Path) -> Path:
    """A copy of a stage file with 16 weights of its last layer's ffn_down nudged by 1e-3."""
    shutil.copyfile(src, dst)
    gg = read_gguf(dst)
    last = max((t for t in gg.tensors if t.name.endswith("ffn_down.weight")), key=lambda t: int(t.name.split(".")[1]))
    data = np.memmap(dst, dtype=np.float32, mode="r+", offset=last.offset, shape=(last.nbytes // 4,))
    data[:16] += np.float32(1e-3)
    data.flush()
    del data
    return dst


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fixture]:
    cache = default_cache_dir()
    model = tiny_model_cached(cache / "tiny", "llama")
    q8 = tiny_model_cached(cache / "tiny", "llama", "q8_0")  # the same weights, quantized
    files = stage_files(model, WINDOWS, cache)
    tmp = tmp_path_factory.mktemp("verify")
    cheat_files = {
        "perturbed": _perturb(files[1], tmp / "perturbed.gguf"),
        "q8_0": stage_files(q8, [(0, 2), (2, 4), (4, 6)], cache)[1],
        "skipped": stage_files(model, [(2, 3)], cache)[0],
    }
    servers = [_load(f, 2, 1024) for f in files]
    auditors = [_load(f, 1, 512) for f in files]
    probes = [{stage_kernel_class(s): probe_hash(s)} for s in auditors]  # what the publisher records
    try:
        yield Fixture(
            model_sha256(model, cache), files, servers, auditors, [Identity.generate() for _ in files], probes,
            cheat_files,
        )  # fmt: skip
    finally:
        for s in servers + auditors:
            s.close()


def _serve(fx: Fixture, request: int, prompt_len: int, n_decode: int, **kw: object) -> Served:
    rng = np.random.default_rng(request)
    prompt = [int(t) for t in rng.integers(8, 512, size=prompt_len)]
    return serve_request(fx.servers, fx.ids, fx.sha, request, prompt, n_decode, sampling=SAMPLING, **kw)  # type: ignore[arg-type]


def _audit(fx: Fixture, served: Served, rank: int) -> tuple[WindowLog, object]:
    log = served.logs[rank]
    return log, audit_window(fx.auditors[rank], log.inputs, log.receipt)


# ---------------------------------------------------------------------------------------------- commitments


def test_receipt_wire_signature_and_chain(fx: Fixture) -> None:
    served = _serve(fx, 1, 70, 3)
    for log in served.logs:
        r = log.receipt
        again = WindowReceipt.from_wire(json.loads(json.dumps(r.to_wire())))
        assert again == r
        again.verify()
        assert len(r.schedule) == 2 + 3 and r.schedule[:2] == ((0, 64), (64, 6))
    last = served.logs[2].receipt
    assert last.tokens[0] == -1 and last.tokens[1:] == tuple(served.tokens[:4]) and last.sampling == SAMPLING
    forged = attrs.evolve(last, tokens=(last.tokens[0], last.tokens[1] + 1, *last.tokens[2:]))
    with pytest.raises(VerificationError, match="signature"):
        forged.verify()
    other = Identity.generate()
    moved = attrs.evolve(last, output_hashes=(last.output_hashes[1], *last.output_hashes[1:]), signature="")
    with pytest.raises(VerificationError, match="output head"):
        attrs.evolve(moved, node_key=other.public.to_text()).signed(other).verify()
    # Successors: each rank's inputs are its predecessor's outputs, step for step.
    for a, b in zip(served.logs, served.logs[1:], strict=False):
        assert first_mismatch(a.receipt.output_hashes, b.receipt.input_hashes) is None


def test_logged_inputs_are_checked_before_use() -> None:
    good = LoggedInput.of_tokens(3, [5, 6]).to_wire()
    assert LoggedInput.from_wire(good).tokens() == [5, 6]
    for bad, why in (
        ({**good, "n_tokens": 3}, "input: payload: of 3 token ids takes 12 bytes"),
        ({**good, "dtype": 7}, "input: dtype: 7 is neither a boundary dtype"),
        ({**good, "pos": -1}, r"input: pos: must be in \[0, 2\^32\)"),
        ({**good, "dtype": 0, "n_tokens": 3}, "input: payload: of 8 bytes is not 3 rows of F32"),
        ({**good, "payload": 5}, "input: payload: must be base64url text"),
        ({**good, "pos": "3"}, "input: pos: must be an integer"),
        ({**good, "n_tokens": True}, "input: n_tokens: must be an integer"),
        ([good], "input: must be an object"),
    ):
        with pytest.raises(InputError, match=why):
            LoggedInput.from_wire(bad)


def test_first_mismatch() -> None:
    assert first_mismatch(["a", "b"], ["a", "b"]) is None
    assert first_mismatch(["a", "b"], ["a", "c"]) == 1
    assert first_mismatch(["a", "b"], ["a"]) == 1
    assert first_mismatch([], ["x"]) == 0
    # The successor check: the successor's inputs are the start of the predecessor's outputs, never more.
    assert successor_mismatch(["a", "b", "c"], ["a", "b"]) is None
    assert successor_mismatch(["a", "b"], ["a", "c"]) == 1
    assert successor_mismatch(["a"], ["a", "b"]) == 1


def test_legitimate_skips() -> None:
    """A skipped step (a last rank's stale verify row) stands when the next computed step rolls it back, or when
    nothing is computed after it; a skip the next step builds on does not."""
    # Prompt chunk, a batch at 8 with rows 8..11: row 0 rejected its draft, rows 1-3 skipped, the next step at 9.
    schedule = [(0, 8), (8, 1), (9, 1), (10, 1), (11, 1), (9, 1), (10, 1)]
    skipped = [False, False, True, True, True, False, False]
    assert legitimate_skips(schedule, skipped) == skipped
    # Skipped rows at the end of a request (it ended before the next step).
    assert legitimate_skips(schedule[:5], skipped[:5]) == skipped[:5]
    # A skip followed by a step past it: the cache would have a hole there.
    assert legitimate_skips([(0, 8), (8, 1), (9, 1)], [False, True, False]) == [False, False, False]
    # A plain request skips nothing.
    assert legitimate_skips([(0, 8), (8, 1), (9, 1)], [False] * 3) == [False] * 3


# ---------------------------------------------------------------------------------------------- honest nodes


def test_no_honest_node_is_accused(fx: Fixture) -> None:
    """102 honest audits (34 requests x 3 windows): prompts of 1-100 tokens, 0-3 decode steps, seeded sampling
    (bench/verify_audits.py runs 1000)."""
    rng = np.random.default_rng(7)
    audits = 0
    for request in range(34):
        served = _serve(fx, 100 + request, int(rng.integers(1, 101)), int(rng.integers(0, 4)))
        for rank in range(3):
            _, result = _audit(fx, served, rank)
            assert result.ok, (request, rank, result)  # type: ignore[attr-defined]
            audits += 1
        assert check_tokens(fx.auditors[2], served.logs[2].inputs, served.logs[2].receipt) is None
    assert audits == 102


# ---------------------------------------------------------------------------------------------- cheaters


@pytest.mark.parametrize("cheat", ["perturbed", "q8_0", "skipped"])
def test_wrong_weights_are_caught_by_audit_and_probe(fx: Fixture, cheat: str) -> None:
    with _load(fx.cheat_files[cheat], 2, 1024) as bad:
        stages = [fx.servers[0], bad, fx.servers[2]]
        for request in range(5):
            rng = np.random.default_rng(request)
            prompt = [int(t) for t in rng.integers(8, 512, size=20 + 30 * request)]
            served = serve_request(stages, fx.ids, fx.sha, 200 + request, prompt, 3, sampling=SAMPLING, windows=WINDOWS)
            _, result = _audit(fx, served, 1)
            assert not result.ok and result.step == 0  # type: ignore[attr-defined]
            for rank in (0, 2):  # the honest neighbours, fed the cheater's outputs, still pass
                assert _audit(fx, served, rank)[1].ok  # type: ignore[attr-defined]
        with pytest.raises(AdmissionRefused, match="does not reproduce"):
            check_probe(bad, fx.probes[1], WINDOWS[1])
    assert check_probe(fx.servers[1], fx.probes[1]) == stage_kernel_class(fx.servers[1])
    assert check_probe(fx.servers[1], {"CUDA-0000000000000000": "0" * 64}) is None  # a class nobody recorded


def _noise(rank_: int, step_: int, sign_noisy: bool) -> Cheat:
    def cheat(rank: int, step: int, out: StepOutput) -> tuple[StepOutput, StepOutput]:
        if rank != rank_ or step != step_:
            return out, out
        arr = np.frombuffer(out.payload, np.float32).copy()
        arr += np.random.default_rng(step).normal(0, 1e-3, arr.shape).astype(np.float32)
        payload = arr.tobytes()
        noisy = attrs.evolve(out, payload=payload, hash=step_hash(out.pos, out.n_tokens, out.dtype, payload))
        return noisy, noisy if sign_noisy else out

    return cheat


def test_boundary_noise_signed_is_caught_by_audit(fx: Fixture) -> None:
    served = _serve(fx, 300, 90, 4, cheat=_noise(1, 2, sign_noisy=True))
    _, result = _audit(fx, served, 1)
    assert not result.ok and result.step == 2  # type: ignore[attr-defined]
    assert _audit(fx, served, 2)[1].ok  # type: ignore[attr-defined]


def test_boundary_noise_unsigned_is_caught_by_the_successor(fx: Fixture) -> None:
    served = _serve(fx, 301, 90, 4, cheat=_noise(1, 3, sign_noisy=False))
    assert _audit(fx, served, 1)[1].ok  # type: ignore[attr-defined]  # it signed what it computed...
    # ...but sent something else: the successor's input hash is not the predecessor's signed output hash.
    assert first_mismatch(served.logs[1].receipt.output_hashes, served.logs[2].receipt.input_hashes) == 3


def _lie_about_token(step_: int) -> Cheat:
    def cheat(rank: int, step: int, out: StepOutput) -> tuple[StepOutput, StepOutput]:
        if rank != 2 or step != step_ or out.token is None or out.token < 0:
            return out, out
        token = (out.token + 1) % 512
        lie = attrs.evolve(
            out, token=token, hash=step_hash(out.pos, out.n_tokens, LOGITS_TOKEN, sample_payload(out.payload, token))
        )
        return lie, lie

    return cheat


def test_last_rank_lying_about_its_token_is_caught(fx: Fixture) -> None:
    served = _serve(fx, 400, 30, 5, cheat=_lie_about_token(3))
    log = served.logs[2]
    assert check_tokens(fx.auditors[2], log.inputs, log.receipt) == 3
    _, result = _audit(fx, served, 2)
    assert not result.ok and result.step == 3  # type: ignore[attr-defined]


def test_a_schedule_with_a_hole_fails_its_audit_at_the_hole(fx: Fixture) -> None:
    """A receipt whose steps skip a position (no window computes that: its cache holds no such prefix) is a mismatch
    at that step, not an error the auditor cannot judge by."""
    log = _serve(fx, 410, 30, 5).logs[1]
    r, cut = log.receipt, 3  # drop step 3: step 4 then starts one position past the end of the cache
    keep = [i for i in range(len(r.schedule)) if i != cut]
    forger = Identity.generate()
    ins, outs = [r.input_hashes[i] for i in keep], [r.output_hashes[i] for i in keep]
    forged = attrs.evolve(
        r, schedule=tuple(r.schedule[i] for i in keep), input_hashes=tuple(ins), output_hashes=tuple(outs),
        input_head=chain_head(r.request, "in", ins), output_head=chain_head(r.request, "out", outs),
        node_key=forger.public.to_text(), signature="",
    ).signed(forger)  # fmt: skip
    result = audit_window(fx.auditors[1], [log.inputs[i] for i in keep], forged)
    assert not result.ok and result.step == cut and result.recomputed_hash is not None
    assert "hole" in result.recomputed_hash


# ---------------------------------------------------------------------------------------------- fraud proofs


@pytest.mark.slow
def test_fraud_proof_verifies_on_a_third_node(fx: Fixture, tmp_path: Path) -> None:
    served = _serve(fx, 500, 100, 3, cheat=_noise(1, 1, sign_noisy=True))
    log = served.logs[1]
    write_json(tmp_path / "log.json", log.to_wire())
    # The auditor, from files, with the CLI: the mismatch, and the proof written.
    audit = run_cli("audit", "run", str(tmp_path / "log.json"), "--stage", str(fx.files[1]),
                    "--proof-out", str(tmp_path / "proof.json"))  # fmt: skip
    assert audit.returncode == 1, audit.stderr
    assert "MISMATCH" in audit.stdout and "step 1" in audit.stdout
    # A third node, in its own process with its own copy of the window: the proof holds.
    check = run_cli("audit", "verify-proof", str(tmp_path / "proof.json"), "--stage", str(fx.files[1]))
    assert check.returncode == 0, check.stderr
    assert check.stdout.startswith("proof holds:") and log.receipt.key.fingerprint in check.stdout
    proof = FraudProof.from_wire(json.loads((tmp_path / "proof.json").read_text()))
    assert proof.predecessor == served.logs[0].receipt and len(proof.inputs) == 2
    assert not verify_proof(proof, fx.auditors[1]).ok
    # An honest node's receipt makes no proof: a "proof" against it does not hold (exit 1).
    honest = served.logs[2]
    fake = FraudProof(honest.receipt, honest.inputs[:2], 1, served.logs[1].receipt)
    write_json(tmp_path / "fake.json", fake.to_wire())
    check = run_cli("audit", "verify-proof", str(tmp_path / "fake.json"), "--stage", str(fx.files[2]))
    assert check.returncode == 1 and "does NOT hold" in check.stdout
    # A proof whose receipt was altered after signing is refused (exit 2, one line), as is the wrong window.
    data = proof.to_wire()
    data["suspect"]["output_hashes"][1] = "0" * 64
    (tmp_path / "forged.json").write_text(json.dumps(data))
    check = run_cli("audit", "verify-proof", str(tmp_path / "forged.json"), "--stage", str(fx.files[1]))
    assert check.returncode == 2 and "signature" in check.stderr and check.stderr.count("\n") == 1
    with pytest.raises(VerificationError, match="layers"):  # another window cannot judge it
        verify_proof(proof, fx.auditors[2])
    # Honest work audited from files: exit 0.
    write_json(tmp_path / "ok.json", served.logs[0].to_wire())
    ok = run_cli("audit", "run", str(tmp_path / "ok.json"), "--stage", str(fx.files[0]))
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")
    with pytest.raises(Exception, match="proves nothing"):
        make_proof(honest.receipt, honest.inputs, audit_window(fx.auditors[2], honest.inputs, honest.receipt))
