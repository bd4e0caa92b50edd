"""What the HTTP API needs from a ring node: exactly the parts of :class:`kvasir.ring.node.Node` it uses.

Written as structural protocols so the real ``Node`` satisfies them unchanged and tests can serve a small fake.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar

from kvasir.core.sampling import SamplingParams
from kvasir.ring.requests import ClientEvent

#: The backend's handle for one submitted request (``RequestHandle`` on a real node); opaque to the API.
HandleT = TypeVar("HandleT")


class ApiVocab(Protocol):
    def tokenize(self, text: str, *, add_special: bool = ..., parse_special: bool = ...) -> list[int]: ...

    def chat_tokens(self, messages: Sequence[tuple[str, str]], template: str | None) -> list[int]: ...

    def longest_piece(self) -> int: ...


class ApiStageConfig(Protocol):
    @property
    def n_ctx(self) -> int: ...

    @property
    def n_seq_max(self) -> int: ...


class ApiStage(Protocol):
    @property
    def vocab(self) -> ApiVocab: ...

    @property
    def config(self) -> ApiStageConfig: ...

    def chat_template(self) -> str | None: ...


class ApiManifest(Protocol):
    @property
    def model_name(self) -> str: ...

    @property
    def model_sha256(self) -> str: ...


class ApiBackend(Protocol[HandleT]):
    """A node that accepts requests: ``Node`` is an ``ApiBackend[RequestHandle]``."""

    @property
    def manifest(self) -> ApiManifest: ...

    @property
    def stage(self) -> ApiStage: ...

    def request(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        stop: Sequence[str] = ...,
        *,
        speculate: int | None = ...,
        client_auth: str = ...,
    ) -> AbstractAsyncContextManager[HandleT]:
        """Submit a request; raises InputError (bad input) or RingError (ring trouble) on entry. ``speculate``: drafts
        per step (None: the node's default); ``client_auth``: the client's signed authorisation (START carries it).

        Leaving the context before the request ended cancels it.
        """
        ...

    def events(self, handle: HandleT) -> AsyncIterator[ClientEvent]:
        """TokenEvents (text deltas, possibly empty), then exactly one EndEvent."""
        ...
