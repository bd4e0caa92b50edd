"""Kvasir's one error tree.

Every error Kvasir raises on purpose derives from :class:`KvasirError`; the CLI turns any of them into one line on
stderr and exit code 2, and the protocols map them to documented error replies::

    KvasirError
    ├── InputError                 bad input from a user or a file (CLI exit code 2)
    │   ├── ModelFileError         missing, truncated or corrupt GGUF
    │   ├── UnsupportedArchitecture
    │   ├── WindowError            layer window empty, out of range, or not joining its neighbour
    │   └── OutputError            cannot write the requested output
    ├── StageError                 llama.cpp refused or failed a stage operation
    │   └── ShapeError             hidden state of the wrong width or length
    ├── ProtocolError              a peer sent a malformed, oversized or wrong-version frame
    ├── RingError                  ring-level failure (neighbour mismatch, request failed, link down)
    │   └── RequestRefused         a node cannot take a request; ``code`` is the ERROR code it answers with
    │       └── InvalidRequest     ...because of the request itself (BAD_REQUEST, CONTEXT_FULL): also an InputError
    └── MarketError                the market refused a request (unknown window, lost claim race, lease gone)
"""

from __future__ import annotations

from kvasir.core.codes import ErrorCode


class KvasirError(Exception):
    """Root of every error Kvasir raises on purpose."""


class InputError(KvasirError, ValueError):
    """Bad input from a user or a file."""


class ModelFileError(InputError):
    """A GGUF file is missing, truncated or corrupt."""


class UnsupportedArchitecture(InputError):
    """The model's architecture has no window rules."""


class WindowError(InputError):
    """A layer window is empty, out of range, or does not join its neighbour."""


class OutputError(InputError):
    """The requested output cannot be written."""


class StageError(KvasirError, RuntimeError):
    """llama.cpp refused or failed a stage operation."""


class ShapeError(StageError, ValueError):
    """A hidden state has the wrong width or length."""


class ProtocolError(KvasirError):
    """A peer sent a malformed, oversized or wrong-version frame."""


class RingError(KvasirError):
    """A ring-level failure: neighbour mismatch, a request that failed."""


class RequestRefused(RingError):
    """A node cannot take a request; ``code`` is the ERROR code it answers the ring with (e.g. OVERLOADED)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class InvalidRequest(RequestRefused, InputError):
    """The request itself is unfit (BAD_REQUEST, CONTEXT_FULL): the client's input, not the ring's state."""


class MarketError(KvasirError):
    """The market refused a request: ``status`` (404, 409, …) and a stable ``code`` (docs/protocol.md § Market API)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
