"""A request served through a chain of real stages with receipts, for the verification tests and bench.

Each rank runs its window with :class:`kvasir.verify.audit.WindowRunner` and records what it received and sent with
a :class:`kvasir.verify.commit.Recorder`, as a ring node does; a ``cheat`` hook lets a rank send (and sign) other
outputs than it computed. The result is each rank's :class:`~kvasir.verify.audit.WindowLog`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs

from kvasir.core.identity import Identity
from kvasir.core.sampling import SamplingParams
from kvasir.core.schedule import PREFILL_CHUNK
from kvasir.stage.engine import Stage
from kvasir.verify.audit import LoggedInput, StepOutput, WindowLog, WindowRunner
from kvasir.verify.commit import NO_TOKEN, Recorder
from kvasir.verify.kernel import stage_kernel_class

#: (rank, step index, what the window computed) -> (what the rank sends on, what it signs).
Cheat = Callable[[int, int, StepOutput], tuple[StepOutput, StepOutput]]


@attrs.frozen
class Served:
    logs: list[WindowLog]
    tokens: list[int]
    #: Per rank: CPU seconds of the process (all llama.cpp threads) in the window's steps (llama.cpp, encoding, the
    #: output hash), and in hashing the inputs.
    compute_s: list[float]
    hash_s: list[float]


def serve_request(
    stages: Sequence[Stage],
    identities: Sequence[Identity],
    model_sha256: str,
    request: int,
    prompt: Sequence[int],
    n_decode: int,
    *,
    sampling: SamplingParams = SamplingParams.GREEDY,
    windows: Sequence[tuple[int, int]] | None = None,
    cheat: Cheat | None = None,
) -> Served:
    """Prefill ``prompt`` in the ring's chunks, then decode ``n_decode`` tokens; every rank keeps its log.

    ``windows`` are the windows the ranks claim (default: their stages' own; a cheater may run another file).
    """
    wins = list(windows or [(s.info.start, s.info.end) for s in stages])
    recorders = [
        Recorder(request, model_sha256, w, stage_kernel_class(s), sampling=sampling if s.info.last else None)
        for s, w in zip(stages, wins, strict=True)
    ]
    inputs: list[list[LoggedInput]] = [[] for _ in stages]
    runners = [WindowRunner(s, sampling=sampling) for s in stages]
    steps: list[tuple[LoggedInput, bool]] = []
    for i in range(0, len(prompt), PREFILL_CHUNK):
        chunk = list(prompt[i : i + PREFILL_CHUNK])
        steps.append((LoggedInput.of_tokens(i, chunk), i + len(chunk) == len(prompt)))
    n_prefill = len(steps)
    compute_s, hash_s = [0.0] * len(stages), [0.0] * len(stages)
    tokens: list[int] = []
    try:
        k = 0
        while k < len(steps):
            b, sample = steps[k]
            for rank, (runner, rec) in enumerate(zip(runners, recorders, strict=True)):
                inputs[rank].append(b)
                t0 = time.process_time()
                rec.on_input(b.pos, b.n_tokens, b.payload, b.dtype)
                t1 = time.process_time()
                computed = runner.step(b, sample=sample)
                hash_s[rank] += t1 - t0
                compute_s[rank] += time.process_time() - t1
                sent, signed = cheat(rank, k, computed) if cheat is not None else (computed, computed)
                if runner.stage.info.last:
                    rec.on_sample(
                        signed.pos, signed.n_tokens, signed.payload, NO_TOKEN if signed.token is None else signed.token
                    )
                    if sent.token is not None and sent.token != NO_TOKEN:
                        tokens.append(sent.token)
                        if len(steps) - n_prefill < n_decode:
                            steps.append((LoggedInput.of_tokens(sent.pos + sent.n_tokens, [sent.token]), True))
                else:
                    rec.on_output(signed.pos, signed.n_tokens, signed.payload, signed.dtype)
                    b = sent.as_input()
            k += 1
    finally:
        for r in runners:
            r.close()
    logs = [
        WindowLog(rec.receipt(ident), tuple(inp), None)
        for rec, ident, inp in zip(recorders, identities, inputs, strict=True)
    ]
    logs = [attrs.evolve(log, predecessor=logs[i - 1].receipt if i else None) for i, log in enumerate(logs)]
    return Served(logs, tokens, compute_s, hash_s)
