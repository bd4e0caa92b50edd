"""How the market judges a fraud proof (``POST /v1/fraud``, docs/market.md § Fraud).

The cheap part runs on every proof (:func:`kvasir.verify.audit.check_proof`): both receipts' signatures, the inputs
against the suspect's committed hashes and schedule, the predecessor's signed outputs against the suspect's inputs.
The verdict needs the window itself, re-executed on the suspect's kernel class: a market started with
``--judge-stages DIR`` holds stage files and runs that part too (:class:`StageJudge`), so nobody, the operator
included, can have an honest node punished. A market without the window (or of another class) cannot tell a true
proof from a forged one with valid signatures, so it acts only on the operator's word (the operator checked the proof
with ``kvasir audit verify-proof``) and refuses anyone else's with 422 ``cannot_judge``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from kvasir.core.errors import KvasirError
from kvasir.shard.gguf_file import STAGE_PREFIX
from kvasir.shard.gguf_io import read_gguf
from kvasir.verify.audit import FraudProof, verify_proof
from kvasir.verify.commit import VerificationError

log = logging.getLogger("kvasir.market")

#: A proof's verdict: True the proof holds, False the window computes what the suspect signed, None cannot judge.
ProofJudge = Callable[[FraudProof], bool | None]
#: Stage files a judge indexes at most.
MAX_JUDGE_STAGES = 4096


class StageJudge:
    """Re-executes proofs on the stage files in a directory (their model, window and this machine's class)."""

    def __init__(self, directory: Path) -> None:
        self.stages: dict[tuple[str, int, int], Path] = {}
        for path in sorted(directory.glob("*.gguf"))[:MAX_JUDGE_STAGES]:
            try:
                gg = read_gguf(path)
            except KvasirError as exc:
                log.warning("judge: skipping %s: %s", path, exc)
                continue
            sha, start, end = (gg.get(STAGE_PREFIX + k) for k in ("source_sha256", "layer_start", "layer_end"))
            if isinstance(sha, str) and isinstance(start, int) and isinstance(end, int):
                self.stages[(sha, start, end)] = path

    def __call__(self, proof: FraudProof) -> bool | None:
        s = proof.suspect
        path = self.stages.get((s.model_sha256, s.start, s.end))
        if path is None:
            return None
        try:
            return not verify_proof(proof, path).ok
        except VerificationError as exc:  # another kernel class: this machine cannot judge
            log.info("judge: cannot judge a proof against %s: %s", s.key.fingerprint, exc)
            return None
