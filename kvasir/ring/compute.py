"""What a ring node needs from its stage: the parts of :class:`kvasir.stage.engine.Stage` it calls.

A structural protocol, so the real ``Stage`` satisfies it unchanged and fast tests can run a node on
:class:`kvasir.testing.fakestage.FakeStage` (a deterministic forward, no model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from kvasir.core.sampling import SamplingParams

T = TypeVar("T")


class TokenSampler(Protocol):
    """One request's sampler chain on the last rank (kvasir.stage.sampling.Sampler)."""

    def accept(self, token: int) -> None: ...

    def close(self) -> None: ...


class RingVocab(Protocol):
    @property
    def n_tokens(self) -> int: ...

    def piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def check_tokens(self, tokens: Sequence[int]) -> None:
        """InputError when a token id is outside the vocabulary."""
        ...

    def tokenize(self, text: str, *, add_special: bool = ..., parse_special: bool = ...) -> list[int]: ...

    def chat_tokens(self, messages: Sequence[tuple[str, str]], template: str | None) -> list[int]: ...

    def longest_piece(self) -> int: ...


class RingStageInfo(Protocol):
    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    @property
    def first(self) -> bool: ...

    @property
    def last(self) -> bool: ...

    @property
    def n_embd(self) -> int: ...

    @property
    def model_sha256(self) -> str | None: ...

    @property
    def backend(self) -> str: ...

    @property
    def n_threads(self) -> int: ...


class RingStageConfig(Protocol):
    @property
    def n_ctx(self) -> int: ...

    @property
    def n_seq_max(self) -> int: ...

    @property
    def n_batch(self) -> int: ...


class RingStage(Protocol):
    @property
    def info(self) -> RingStageInfo: ...

    @property
    def config(self) -> RingStageConfig: ...

    @property
    def vocab(self) -> RingVocab: ...

    @property
    def busy_s(self) -> float: ...

    @property
    def handoff_s(self) -> float: ...

    def chat_template(self) -> str | None: ...

    def new_sampler(self, params: SamplingParams) -> TokenSampler: ...

    def sample(self, sampler: Any, index: int = -1) -> int:
        """The next token of the request whose sampler this is (last stage; after a final forward), from the last
        output row or from row ``index`` of a batched decode."""
        ...

    def forward(self, seq_id: int, pos0: int, *, tokens: Sequence[int] | None = ..., hidden: Any = ...) -> Any:
        """The boundary ``[n, n_embd]`` for this chunk (None on the last stage)."""
        ...

    def logits(self, index: int = -1) -> Any:
        """A copy of the last row's logits (last stage, after a forward): what a receipt hashes."""
        ...

    def forward_batch(self, items: Sequence[Any]) -> list[Any]:
        """Several sequences' chunks (``BatchItem``: ascending ids, equal token counts) in one decode: each item's
        boundary (Nones on the last stage, where item ``i``'s logits row is :meth:`batch_index`)."""
        ...

    def batch_index(self, item: int, n: int) -> int:
        """The output row of item ``item``'s last token in a :meth:`forward_batch` of ``n``-token items."""
        ...

    def truncate(self, seq_id: int, pos: int) -> None:
        """Keep positions ``[0, pos)`` of one sequence's cache (rejected drafts); StageError where it cannot."""
        ...

    def free_sequence(self, seq_id: int) -> None: ...

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking stage call off the event loop, one at a time per stage."""
        ...
