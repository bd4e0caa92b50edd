"""A draft model: a small GGUF with the target's vocabulary, held beside the last window, drafting greedily.

``--draft-model FILE`` (``kvasir generate``, ``kvasir node`` at the last rank, ``ring up``). One llama.cpp context
(:class:`~kvasir.stage.engine.Stage` on the whole file) with a cache sequence per request, indexed like the
window's own sequences. Each request's :class:`DraftModelSource` keeps what its sequence holds: on a proposal it
keeps the cache's longest prefix that is still the request's history (accepted drafts stay: they were fed as
drafts), feeds the rest, then drafts greedily one token at a time. Its drafts are a function of the calls it made,
so a replaced last rank replaying the same steps proposes the same drafts. The answer never depends on them (each
verify row is the plain step, docs/speculation.md); a draft model only decides how many rows a ring pass verifies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np

from kvasir.core.errors import InputError
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.vocab import Vocab


def vocab_mismatch(target: Vocab, draft: Vocab) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (token ids must mean the same text), or None."""
    if target.n_tokens != draft.n_tokens:
        return f"its vocabulary has {draft.n_tokens} tokens, the model's has {target.n_tokens}"
    for token in range(target.n_tokens):
        if target.token_text(token) != draft.token_text(token):
            return f"its token {token} is {draft.token_text(token)!r}, the model's is {target.token_text(token)!r}"
    return None


class DraftModel:
    """The loaded draft model; thread-safe (one computation at a time, whichever request's)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.lock = threading.Lock()
        #: Seconds spent drafting (feeding and greedy steps), for benchmarks.
        self.busy_s = 0.0
        self.closed = False

    @classmethod
    def load(
        cls, path: Path, target: Vocab, *, n_ctx: int, n_seq_max: int = 1, n_threads: int | None = None
    ) -> DraftModel:
        """Load ``path`` for drafting for a model of vocabulary ``target``; InputError (one line) when it is not a
        whole model or its vocabulary differs."""
        if not path.is_file():
            raise InputError(f"--draft-model {path}: no such file")
        stage = Stage.load(StageConfig(path, n_ctx=n_ctx, n_seq_max=n_seq_max, n_threads=n_threads))
        try:
            if not (stage.info.first and stage.info.last):
                raise InputError(f"--draft-model {path}: a stage file, not a whole model")
            why = vocab_mismatch(target, stage.vocab)
            if why is not None:
                raise InputError(f"--draft-model {path}: not the model's vocabulary: {why}")
        except BaseException:
            stage.close()
            raise
        return cls(stage)

    def source(self, prompt: Sequence[int], seq: int) -> DraftModelSource:
        """A request's source over cache sequence ``seq`` (the request's own sequence at this node)."""
        return DraftModelSource(self, seq, list(prompt))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.stage.close()


@attrs.define
class DraftModelSource:
    """One request's draft source (``kvasir.core.speculate.DraftSource``) on a :class:`DraftModel`."""

    model: DraftModel
    seq: int
    history: list[int]
    #: The tokens the draft cache of ``seq`` holds, from position 0 (None: not touched yet, clear it first).
    cached: list[int] | None = None
    closed: bool = False
    blocking = True

    def emitted(self, token: int) -> None:
        self.history.append(token)

    def propose(self, k: int, *, eager: bool = False) -> list[int]:
        if k <= 0 or not self.history:
            return []
        with self.model.lock:
            if self.closed or self.model.closed:
                return []
            t0 = time.perf_counter()
            try:
                return self._propose(k)
            finally:
                self.model.busy_s += time.perf_counter() - t0

    def _propose(self, k: int) -> list[int]:
        stage, h = self.model.stage, self.history
        n_ctx = stage.config.n_ctx
        if self.cached is None:  # the sequence may hold an earlier request's cells
            stage.free_sequence(self.seq)
            self.cached = []
        keep = 0
        for a, b in zip(self.cached, h, strict=False):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(h) - 1)  # the last token is fed again: its logits give the first draft
        if keep < len(self.cached):
            stage.truncate(self.seq, keep)
            del self.cached[keep:]
        chunk = stage.config.n_batch
        for i in range(keep, len(h), chunk):
            stage.forward(self.seq, i, tokens=h[i : i + chunk])
        self.cached.extend(h[keep:])
        drafts: list[int] = []
        for _ in range(k):
            token = int(np.argmax(stage.logits()))
            drafts.append(token)
            pos = len(self.cached)
            if len(drafts) == k or pos >= n_ctx:
                break
            stage.forward(self.seq, pos, tokens=[token])
            self.cached.append(token)
        return drafts

    def close(self) -> None:
        with self.model.lock:
            if not self.closed and self.cached is not None and not self.model.closed:
                self.model.stage.free_sequence(self.seq)
            self.closed = True
