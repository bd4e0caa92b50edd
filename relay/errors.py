"""Errors raised by the relay service and its client, all inside Kvasir's one error tree."""

from __future__ import annotations

from kvasir.core.errors import InputError, ProtocolError, RingError


class RelayConfigError(InputError):
    """Bad relay settings: an unparsable address, a missing secret, an out-of-range limit."""


class EdgeTokenError(ProtocolError):
    """An edge token is malformed, or its signature does not match the edge, role and expiry."""


class EdgeTokenExpired(EdgeTokenError):
    """An edge token was well signed but its expiry has passed."""


class RelayError(RingError):
    """A relayed ring link failed."""


class RelayConnectError(RelayError):
    """The relay could not be reached, or refused the WebSocket handshake."""


class RelayLinkClosed(RelayError):
    """The relayed link is closed; ``code`` and ``reason`` are the WebSocket close code and reason."""

    def __init__(self, code: int | None, reason: str | None) -> None:
        self.code = code
        self.reason = reason
        super().__init__(f"relay link closed (code {code}{': ' + reason if reason else ''})")
