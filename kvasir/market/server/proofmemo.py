"""What the market's judge already knows, so a rejected fraud proof is never re-executed twice (security review 2,
N15): re-executing loads a window and runs llama.cpp for seconds, one proof at a time, so a holder resending a
rejected proof (or variants of it) would otherwise keep real proofs waiting.

- A rejected proof's id, and the suspect receipt it was about with the last step re-executed: re-execution checks
  steps 0..``step``, so any proof against that receipt up to that step is answered ``proof_rejected`` at once.
- Per submitter, the times of its rejected proofs: after :data:`REJECTED_PER_WINDOW` within
  :data:`REJECTION_WINDOW_S`, its proofs are refused (429) until the oldest ages out. The operator is exempt.

Bounded: at most :data:`MAX_REMEMBERED` entries in each table, the oldest forgotten first. Pure: time is passed in.
"""

from __future__ import annotations

import collections
import hashlib
from typing import TypeVar

from kvasir.verify.audit import FraudProof

#: Rejected proofs one submitter may have within REJECTION_WINDOW_S before its proofs are refused.
REJECTED_PER_WINDOW = 3
REJECTION_WINDOW_S = 3600.0
MAX_REMEMBERED = 100_000
V = TypeVar("V")


def receipt_id(proof: FraudProof) -> str:
    """The suspect receipt's identity: sha256 of what its key signed (not of the signature's spelling)."""
    return hashlib.sha256(proof.suspect.message()).hexdigest()


class ProofMemo:
    """The judge's memory of rejected proofs and of who sent them."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self._proofs: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._honest: collections.OrderedDict[str, int] = collections.OrderedDict()  # receipt -> last honest step
        self._rejections: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()

    def rejected(self, proof: FraudProof, pid: str) -> bool:
        """True when the judge already found this proof, or its receipt up to its step, honest."""
        return pid in self._proofs or self._honest.get(receipt_id(proof), -1) >= proof.step

    def retry_after(self, submitter: str, now: float) -> float:
        """Seconds until ``submitter`` may have a proof judged again (0: now)."""
        times = self._rejections.get(submitter)
        if times is None:
            return 0.0
        while times and times[0] <= now - REJECTION_WINDOW_S:
            times.popleft()
        if len(times) < REJECTED_PER_WINDOW:
            return 0.0
        return times[0] + REJECTION_WINDOW_S - now

    def reject(self, proof: FraudProof, pid: str, submitter: str, now: float) -> None:
        """Remember a proof the judge rejected, against its receipt and its submitter."""
        _put(self._proofs, pid, None, self.limit)
        rid = receipt_id(proof)
        _put(self._honest, rid, max(proof.step, self._honest.get(rid, -1)), self.limit)
        times = self._rejections.pop(submitter, collections.deque(maxlen=REJECTED_PER_WINDOW))
        times.append(now)
        _put(self._rejections, submitter, times, self.limit)


def _put(table: collections.OrderedDict[str, V], key: str, value: V, limit: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
