"""The MTP block as a ring's drafter: :class:`~kvasir.stage.mtp.MtpDrafter` behind the drafter interface.

``kvasir node --draft-mtp`` at the last rank (``ring up --draft-mtp``): the last window is loaded with
``StageConfig(mtp=True)`` and each speculative request gets an :class:`MtpSource` on the window's own sequence id
(``kvasir.core.speculate.StageDraftSource``). The last rank tells the source each row it computed for the request, in
the worker call that computed it (``computed``: the source copies the rows' nextn hidden states, which the next
computation on the stage would overwrite), feeds it the emitted tokens, and runs ``propose`` on the stage's worker
(``Stage.run``), so MTP decodes never overlap the stage's own. Only rows of the true sequence are computed at the last
rank (it stops at a rejected draft), so every observed row is a true one. A replaced last rank rebuilds the drafter
from the replayed rows: the same computations in the same order, so the same hidden states and the same drafts.
See docs/mtp.md.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvasir.stage.engine import Stage
from kvasir.stage.mtp import MtpDrafter, MtpHead


class MtpSources:
    """The last stage's MTP head, shared by its requests' sources (``DraftSources``: call it with a prompt and the
    request's sequence id). The lock keeps a source's ``close`` (run in any thread) off a running MTP decode."""

    def __init__(self, stage: Stage) -> None:
        self.head = MtpHead(stage)
        self.lock = threading.Lock()
        self.closed = False

    def __call__(self, prompt: Sequence[int], seq: int) -> MtpSource:
        return MtpSource(self, seq, prompt)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.head.close()


class MtpSource:
    """One request's MTP drafts (``kvasir.core.speculate.StageDraftSource``)."""

    blocking = True

    def __init__(self, sources: MtpSources, seq: int, prompt: Sequence[int]) -> None:
        self.sources = sources
        self.drafter = MtpDrafter(sources.head, seq)
        self.drafter.accept(prompt)
        self.closed = False
        #: Whether the sequence's MTP cells were cleared (at the first proposal: off the event loop).
        self.fresh = False

    def computed(self, pos0: int, n: int) -> None:
        self.drafter.observe(pos0, self.sources.head.stage.nextn_hidden(n))

    def emitted(self, token: int) -> None:
        self.drafter.accept((token,))

    def propose(self, k: int, *, eager: bool = False) -> list[int]:
        with self.sources.lock:
            if self.closed or self.sources.closed:
                return []
            if not self.fresh:  # the sequence may hold an earlier request's MTP cells (sequence ids are reused)
                self.sources.head.free(self.drafter.seq)
                self.fresh = True
            return self.drafter.propose(k)

    def close(self) -> None:
        with self.sources.lock:
            if not self.closed and not self.sources.closed:
                self.drafter.close()
            self.closed = True
