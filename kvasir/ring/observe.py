"""What a node tells an observer of each request as its frames pass: the seam receipts plug into.

The node calls a :class:`RequestObserver` at fixed points of the data path, always, and never asks whether anyone
records: :data:`NO_RECORDING` does nothing, :class:`kvasir.ring.record.NodeRecorder` signs receipts
(docs/verification.md § The ring records). Every call but the work :meth:`RequestObserver.ended` hands back is cheap
enough for the event loop; that work (signing, writing) runs in a worker thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import trio

from kvasir.core.sampling import SamplingParams
from kvasir.wire import Boundary, End


class RequestObserver(Protocol):
    def begin(
        self, request: int, *, last: bool, sampling: SamplingParams, history: Sequence[int], params: bytes = b""
    ) -> None:
        """A request registered here (``last``: this is the last rank, which samples; ``params``: its START's
        parameters hash)."""
        ...

    def records(self, request: int) -> bool:
        """Whether ``request`` is observed (then the last rank hands over each sampled row's logits)."""
        ...

    def take(self, frame: Boundary) -> str | None:
        """An input boundary taken for compute; why its chain head (FLAG_CHAIN) is wrong, or None."""
        ...

    def seal(self, frame: Boundary) -> Boundary:
        """An output boundary about to be sent: the frame to send (stamped with a chain head, or unchanged)."""
        ...

    def head(self, request: int) -> bytes:
        """Last rank, as it ends ``request``: its output chain head for END (FLAG_CHAIN), or b"" (not recorded)."""
        ...

    def closes(self, frame: End) -> str | None:
        """An END passing: why it must be refused (recording required and no chain head from the last rank), or
        None."""
        ...

    def on_tokens(self, request: int, pos: int, tokens: Sequence[int]) -> None:
        """Rank 0: token ids it embeds at ``pos`` (a prompt chunk, or a step's token)."""
        ...

    def on_sample(self, request: int, pos: int, n_tokens: int, logits: bytes, token: int | None) -> None:
        """Last rank, in its worker thread: the last row's logits and the token sampled from it (None: none)."""
        ...

    def on_skip(self, request: int, pos: int, n_tokens: int) -> None:
        """Last rank: a verify row taken and dropped uncomputed (behind a rejected draft)."""
        ...

    def ended(self, request: int) -> Callable[[], None] | None:
        """The request ended here: the blocking work to finish its record with (run off the loop), or None."""
        ...


class NoRecording:
    """The observer of a node that records nothing."""

    def begin(
        self, request: int, *, last: bool, sampling: SamplingParams, history: Sequence[int], params: bytes = b""
    ) -> None:
        pass

    def records(self, request: int) -> bool:
        return False

    def take(self, frame: Boundary) -> str | None:
        return None

    def seal(self, frame: Boundary) -> Boundary:
        return frame

    def head(self, request: int) -> bytes:
        return b""

    def closes(self, frame: End) -> str | None:
        return None

    def on_tokens(self, request: int, pos: int, tokens: Sequence[int]) -> None:
        pass

    def on_sample(self, request: int, pos: int, n_tokens: int, logits: bytes, token: int | None) -> None:
        pass

    def on_skip(self, request: int, pos: int, n_tokens: int) -> None:
        pass

    def ended(self, request: int) -> Callable[[], None] | None:
        return None


NO_RECORDING: RequestObserver = NoRecording()


def finish_off_loop(nursery: trio.Nursery, work: Callable[[], None]) -> None:
    """Run an ended request's record work in a worker thread (the request is answered already)."""

    async def run() -> None:
        with trio.CancelScope(shield=True):  # a node shutting down still writes what it answered (milliseconds)
            await trio.to_thread.run_sync(work)

    try:
        nursery.start_soon(run)
    except RuntimeError:  # the node has stopped (a request ended in its teardown): do it here
        work()
