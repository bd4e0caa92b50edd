"""What audits cost and what they catch (docs/verification.md).

Run: ``python bench/verify_audits.py [--model M.gguf] [--requests N] [--honest-audits N] [--part cost|tiny]``
(``--part cost`` about 4 minutes; the 1000 honest audits took 19 minutes on a shared 2-vCPU VM, 100 take 2).

1. Cost, on the demo model (Gemma 3 270M Q4_K_M) split 3 ways: N requests (150-token prompt, 32 decode steps) are
   served through the three windows with receipts; an auditor holding its own copy of each window re-executes
   every request from the logged inputs. Times are CPU seconds of the process (all llama.cpp threads), so that
   other load on the machine does not move them. Printed per window: serving compute (the baseline, same run), the
   re-execution, their ratio, the commitment hashing, the logged input bytes, and what auditing a fraction
   f = 2% of requests adds to the window's compute (f x re-execution / serving).
2. Honest audits at scale, on a tiny llama (6 layers, 3 windows): ``--honest-audits`` audits of honest requests
   (random prompt lengths 1-150, 0-8 decode steps, seeded sampling); any accusation is a false positive.
3. Detection, on the same tiny model: each cheater serves 20 requests on rank 1 (or the last rank); printed, the
   share of audits that flag it and the share of admissions (probe) that refuse it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)

from kvasir.core.identity import Identity  # noqa: E402
from kvasir.core.sampling import SamplingParams  # noqa: E402
from kvasir.demo import demo_model_path  # noqa: E402
from kvasir.shard.cache import default_cache_dir, model_sha256, stage_files  # noqa: E402
from kvasir.shard.gguf_file import describe  # noqa: E402
from kvasir.shard.gguf_io import read_gguf  # noqa: E402
from kvasir.stage.engine import Stage, StageConfig  # noqa: E402
from kvasir.testing.tinymodels import tiny_model_cached  # noqa: E402
from kvasir.verify.audit import StepOutput, audit_window  # noqa: E402
from kvasir.verify.commit import LOGITS_TOKEN, first_mismatch, sample_payload, step_hash  # noqa: E402
from kvasir.verify.kernel import stage_kernel_class  # noqa: E402
from kvasir.verify.probe import AdmissionRefused, check_probe, probe_hash  # noqa: E402
from tests.harness.audits import Cheat, serve_request  # noqa: E402

SAMPLING = SamplingParams(temperature=0.8, seed=99)
F = 0.02


def _prompt(rng: np.random.Generator, n: int, n_vocab: int) -> list[int]:
    return [int(t) for t in rng.integers(8, min(n_vocab, 20000), size=n)]


def _spread(xs: list[float], fmt: str = "{:.3g}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def cost(model: Path, requests: int, threads: int) -> None:
    cache = default_cache_dir()
    n = describe(model).n_main
    cuts = [(0, n // 3), (n // 3, 2 * n // 3), (2 * n // 3, n)]
    files = stage_files(model, cuts, cache)
    sha = model_sha256(model, cache)
    ids = [Identity.generate() for _ in files]
    servers = [Stage.load(StageConfig(f, n_ctx=512, n_seq_max=2, n_threads=threads)) for f in files]
    auditors = [Stage.load(StageConfig(f, n_ctx=256, n_seq_max=1, n_threads=threads)) for f in files]
    rng = np.random.default_rng(1)
    serve_s: list[list[float]] = [[] for _ in files]
    audit_s: list[list[float]] = [[] for _ in files]
    hash_s: list[list[float]] = [[] for _ in files]
    log_bytes: list[int] = [0] * len(files)
    receipt_bytes: list[int] = [0] * len(files)
    ok = 0
    try:
        for r in range(requests):
            served = serve_request(servers, ids, sha, r, _prompt(rng, 150, servers[0].info.n_vocab), 32,
                                   sampling=SAMPLING)  # fmt: skip
            for k, log in enumerate(served.logs):
                t0 = time.process_time()
                result = audit_window(auditors[k], log.inputs, log.receipt)
                audit_s[k].append(time.process_time() - t0)
                ok += result.ok
                serve_s[k].append(served.compute_s[k])
                # Commitment cost: the input hashes (timed in serving) plus the output hashes, timed here.
                if k + 1 < len(files):
                    outs = [len(b.payload) for b in served.logs[k + 1].inputs]
                else:  # the last rank hashes each step's logits row and token
                    outs = [servers[k].info.n_vocab * 4 + 4] * len(log.inputs)
                blobs = [bytes(size) for size in outs]
                t1 = time.process_time()
                for blob in blobs:
                    step_hash(0, 1, 0, blob)
                hash_s[k].append(served.hash_s[k] + time.process_time() - t1)
                log_bytes[k] = sum(len(b.payload) for b in log.inputs)
                receipt_bytes[k] = len(str(log.receipt.to_wire()))
    finally:
        for s in servers + auditors:
            s.close()
    print(f"\n1. cost: {model.name}, windows {cuts}, {requests} requests of 150 prompt + 32 decode tokens, "
          f"{threads} threads; {ok}/{requests * len(files)} audits equal")  # fmt: skip
    print(f"{'window':<10}{'serve CPU s/req':>22}{'re-exec CPU s/req':>22}{'re-exec/serve':>22}"
          f"{'hash CPU ms/req':>20}{'log KiB/req':>13}{'receipt KiB':>13}{'f=2% adds':>11}")  # fmt: skip
    for k, (a, b) in enumerate(cuts):
        ratio = [x / y for x, y in zip(audit_s[k], serve_s[k], strict=True)]
        adds = F * statistics.median(ratio)
        print(f"{f'{a}:{b}':<10}{_spread(serve_s[k]):>22}{_spread(audit_s[k]):>22}{_spread(ratio):>22}"
              f"{_spread([h * 1e3 for h in hash_s[k]], '{:.2f}'):>20}{log_bytes[k] / 1024:>13.0f}"
              f"{receipt_bytes[k] / 1024:>13.1f}{adds:>11.1%}")  # fmt: skip


def _perturb(src: Path, dst: Path) -> Path:
    shutil.copyfile(src, dst)
    gg = read_gguf(dst)
    t = max((t for t in gg.tensors if t.name.endswith("ffn_down.weight")), key=lambda t: int(t.name.split(".")[1]))
    data = np.memmap(dst, dtype=np.float32, mode="r+", offset=t.offset, shape=(t.nbytes // 4,))
    data[:16] += np.float32(1e-3)
    data.flush()
    del data
    return dst


def _noise(signed: bool) -> Cheat:
    def cheat(rank: int, step: int, out: StepOutput) -> tuple[StepOutput, StepOutput]:
        if rank != 1 or step != 1:
            return out, out
        arr = np.frombuffer(out.payload, np.float32) + np.float32(1e-3)
        p = arr.astype(np.float32).tobytes()
        noisy = attrs.evolve(out, payload=p, hash=step_hash(out.pos, out.n_tokens, out.dtype, p))
        return noisy, noisy if signed else out

    return cheat


def _token_lie(rank: int, step: int, out: StepOutput) -> tuple[StepOutput, StepOutput]:
    if rank != 2 or step != 2 or out.token is None or out.token < 0:
        return out, out
    t = (out.token + 1) % 512
    lie = attrs.evolve(
        out, token=t, hash=step_hash(out.pos, out.n_tokens, LOGITS_TOKEN, sample_payload(out.payload, t))
    )
    return lie, lie


def tiny(honest_audits: int) -> None:
    cache = default_cache_dir()
    model = tiny_model_cached(cache / "tiny", "llama")
    q8 = tiny_model_cached(cache / "tiny", "llama", "q8_0")
    wins = [(0, 2), (2, 4), (4, 6)]
    files = stage_files(model, wins, cache)
    sha = model_sha256(model, cache)
    ids = [Identity.generate() for _ in files]
    servers = [Stage.load(StageConfig(f, n_ctx=512, n_seq_max=2, n_threads=2)) for f in files]
    auditors = [Stage.load(StageConfig(f, n_ctx=256, n_seq_max=1, n_threads=1)) for f in files]
    probes = [{stage_kernel_class(s): probe_hash(s)} for s in auditors]
    rng = np.random.default_rng(3)
    t0 = time.perf_counter()
    audits = accused = 0
    r = 0
    while audits < honest_audits:
        served = serve_request(servers, ids, sha, r, _prompt(rng, int(rng.integers(1, 151)), 512),
                               int(rng.integers(0, 9)), sampling=SAMPLING)  # fmt: skip
        r += 1
        for k, log in enumerate(served.logs):
            accused += not audit_window(auditors[k], log.inputs, log.receipt).ok
            audits += 1
            if k and first_mismatch(served.logs[k - 1].receipt.output_hashes, log.receipt.input_hashes) is not None:
                accused += 1
    print(f"\n2. honest: {audits} audits of {r} requests on a tiny llama, {accused} accusations "
          f"({time.perf_counter() - t0:.1f} s)")  # fmt: skip

    with tempfile.TemporaryDirectory() as tmp:
        bad_files = {
            "perturbed weights (16 of ffn_down +1e-3)": _perturb(files[1], Path(tmp) / "p.gguf"),
            "window cut from the q8_0 file": stage_files(q8, wins, cache)[1],
            "skipped layer (2:3 run as 2:4)": stage_files(model, [(2, 3)], cache)[0],
        }
        print(f"\n3. detection over 20 requests each\n{'cheater':<44}{'audits flag':>12}{'admission refuses':>19}")
        for name, path in bad_files.items():
            with Stage.load(StageConfig(path, n_ctx=512, n_seq_max=2, n_threads=2)) as bad:
                flagged = sum(
                    not audit_window(auditors[1], log.inputs, log.receipt).ok
                    for log in (
                        serve_request(
                            [servers[0], bad, servers[2]],
                            ids,
                            sha,
                            1000 + i,
                            _prompt(rng, 40, 512),
                            4,
                            sampling=SAMPLING,
                            windows=wins,
                        ).logs[1]
                        for i in range(20)
                    )
                )
                try:
                    check_probe(bad, probes[1], wins[1])
                    refused = "no"
                except AdmissionRefused:
                    refused = "yes"
            print(f"{name:<44}{f'{flagged}/20':>12}{refused:>19}")
        for name, cheat, rank in (
            ("noise on the boundary, signed", _noise(True), 1),
            ("noise on the boundary, unsigned", _noise(False), 1),
            ("last rank lies about a token", _token_lie, 2),
        ):
            flagged = 0
            for i in range(20):
                served = serve_request(servers, ids, sha, 2000 + i, _prompt(rng, 40, 512), 4, sampling=SAMPLING,
                                       cheat=cheat)  # fmt: skip
                log = served.logs[rank]
                bad_audit = not audit_window(auditors[rank], log.inputs, log.receipt).ok
                succ = served.logs[rank + 1] if rank + 1 < len(served.logs) else None
                bad_link = succ is not None and (
                    first_mismatch(log.receipt.output_hashes, succ.receipt.input_hashes) is not None
                )
                flagged += bad_audit or bad_link
            print(f"{name:<44}{f'{flagged}/20':>12}{'n/a (serve time)':>19}")
    for s in servers + auditors:
        s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="whole GGUF (default: the demo Gemma 3 270M)")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads (1: no spinning workers)")
    parser.add_argument("--honest-audits", type=int, default=1000)
    parser.add_argument("--part", choices=("all", "cost", "tiny"), default="all")
    args = parser.parse_args()
    if args.part in ("all", "cost"):
        cost(args.model or demo_model_path(default_cache_dir()), args.requests, args.threads)
    if args.part in ("all", "tiny"):
        tiny(args.honest_audits)


if __name__ == "__main__":
    main()
