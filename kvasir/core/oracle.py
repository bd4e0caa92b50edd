"""THE ORACLE DRAFTER: a benchmark instrument, not a drafter for serving.

It knows the answer: the tokens a plain run of the same request produced. Each token it proposes is that true
continuation with probability ``alpha``, else a wrong token, independently per position, so a ring's speculation
machinery can be charted against the latency law (``kvasir.planner.speculation``) at any acceptance rate, whatever
a real drafter would achieve. The coin of output position ``j`` is a pure function of ``(seed, j)``: runs repeat,
a re-draft of a position whose coin was never looked at (it lay behind a rejected draft) is still a fresh i.i.d.
coin, and a replaced last rank proposes the same drafts. Like every drafter it cannot change the answer (each
verify row is the plain step); where it guesses wrong it only costs rows.

A ring node takes it as ``kvasir node --draft-oracle FILE`` (a JSON :class:`OracleSpec`), read afresh for every
request so a benchmark can change ``alpha`` between requests without restarting the ring (bench/speculation_law.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import attrs

from kvasir.core.errors import InputError
from kvasir.core.schema import Json, register_record, structure, unstructure
from kvasir.core.speculate import DraftSources
from kvasir.core.validators import number_in


def coin(seed: int, position: int) -> float:
    """A uniform number in [0, 1) for output position ``position``: the same for the same (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


@attrs.define
class Oracle:
    """The draft source (``kvasir.core.speculate.DraftSource``) of one request: proposes ``truth`` (the plain run's
    output, after this request's prompt), each token right with probability ``alpha``."""

    truth: Sequence[int]
    alpha: float
    seed: int
    n_vocab: int
    #: Output tokens emitted so far: the next draft stands at output position ``generated``.
    generated: int = 0
    blocking = False

    def emitted(self, token: int) -> None:
        self.generated += 1

    def propose(self, k: int, *, eager: bool = False) -> list[int]:
        out = []
        for j in range(self.generated, min(self.generated + k, len(self.truth))):
            true = self.truth[j]
            out.append(true if coin(self.seed, j) < self.alpha else (true + 1) % self.n_vocab)
        return out

    def close(self) -> None:
        pass


@attrs.frozen
class OracleRun:
    """One plain run the oracle knows: its prompt's token ids and the tokens it generated."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]


@attrs.frozen
class OracleSpec:
    """What ``--draft-oracle FILE`` holds (JSON): the acceptance rate, the coins' seed and the plain runs. A
    request whose prompt is none of the runs' gets no drafts."""

    alpha: float = attrs.field(validator=number_in(0.0, 1.0))
    seed: int
    runs: tuple[OracleRun, ...]

    def to_wire(self) -> Json:
        out: Json = unstructure(self)
        return out

    @classmethod
    def from_wire(cls, obj: object, where: str = "oracle file") -> OracleSpec:
        return structure(obj, cls, where=where)

    @classmethod
    def read(cls, path: Path) -> OracleSpec:
        try:
            obj = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InputError(f"--draft-oracle {path}: {exc}") from None
        return cls.from_wire(obj, f"--draft-oracle {path}")

    def source(self, prompt: Sequence[int], n_vocab: int) -> Oracle:
        truth = next((r.tokens for r in self.runs if r.prompt == tuple(prompt)), ())
        return Oracle(truth, self.alpha, self.seed, n_vocab)


def oracle_sources(path: Path, n_vocab: int) -> DraftSources:
    """``DraftSources`` for ``--draft-oracle FILE``: the file read afresh for each request (a benchmark may rewrite
    ``alpha`` between requests)."""

    def make(prompt: Sequence[int], _seq: int) -> Oracle:
        return OracleSpec.read(path).source(prompt, n_vocab)

    return make


register_record(OracleRun, forbid_extra=True)
register_record(OracleSpec, forbid_extra=True)
