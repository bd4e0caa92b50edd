"""Admission by reproduction: a fixed probe per window whose output hash the publisher records per kernel class.

The probe is deterministic and needs nothing but the window: rank 0 gets seeded token ids, later windows a seeded
Gaussian boundary, run on the ring's schedule (a 64-token chunk, a 6-token chunk, then two single-token steps); the
last rank's output is each step's logits row and greedy token. A node that loaded corrupted or foreign weights, cut
its window wrong or runs another build computes another hash and is refused before any user sees it. A class the
publisher did not record cannot be checked this way (:func:`check_probe` says so; audits still apply).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from kvasir.core.errors import KvasirError
from kvasir.core.schedule import PREFILL_CHUNK
from kvasir.stage.engine import Stage
from kvasir.verify.audit import LoggedInput, execute
from kvasir.verify.kernel import stage_kernel_class

PROBE_SEED = 0x6B76_6173  # "kvas"
#: (position, n_tokens) of the probe's steps: the ring's prefill chunking, then decode steps.
PROBE_SCHEDULE: tuple[tuple[int, int], ...] = ((0, PREFILL_CHUNK), (PREFILL_CHUNK, 6), (PREFILL_CHUNK + 6, 1),
                                               (PREFILL_CHUNK + 7, 1))  # fmt: skip
#: Token ids the probe draws from: above the usual special tokens, within any vocabulary it runs on.
_FIRST_TOKEN = 8


class AdmissionRefused(KvasirError):
    """A window that does not reproduce the publisher's probe hash: it must not serve."""


def probe_inputs(stage: Stage, window: tuple[int, int] | None = None) -> list[LoggedInput]:
    """The probe's inputs for ``window`` (default: the stage's own), seeded by the window alone."""
    info = stage.info
    start, end = window or (info.start, info.end)
    rng = np.random.default_rng([PROBE_SEED, start, end])
    out: list[LoggedInput] = []
    for pos, n in PROBE_SCHEDULE:
        if start == 0:
            out.append(LoggedInput.of_tokens(pos, [int(t) for t in rng.integers(_FIRST_TOKEN, info.n_vocab, size=n)]))
        else:
            out.append(LoggedInput.of_hidden(pos, rng.standard_normal((n, info.n_embd), dtype=np.float32)))
    return out


def probe_hash(stage: Stage, window: tuple[int, int] | None = None) -> str:
    """The window's probe output hash on this machine (sha256 over the steps' output hashes)."""
    h = hashlib.sha256(b"kvasir-probe/v1\n")
    for step in execute(stage, probe_inputs(stage, window)):
        h.update(bytes.fromhex(step.hash))
    return h.hexdigest()


def check_probe(stage: Stage, probes: Mapping[str, str], window: tuple[int, int] | None = None) -> str | None:
    """Admission: raise AdmissionRefused when the publisher recorded a probe (``kernel class -> hash``) for this
    node's class and the window (the claimed one; default the stage's own) computes another. Returns the class when
    it was checked, None when the publisher recorded none for it."""
    cls = stage_kernel_class(stage)
    want = probes.get(cls)
    if want is None:
        return None
    start, end = window or (stage.info.start, stage.info.end)
    got = probe_hash(stage, (start, end))
    if got != want:
        raise AdmissionRefused(
            f"window {start}:{end} does not reproduce the publisher's probe for kernel class {cls} "
            f"(computed {got[:16]}…, recorded {want[:16]}…): corrupted or foreign weights, or another build"
        )
    return cls
