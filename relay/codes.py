"""WebSocket close codes the relay sends (docs/protocol.md § Relay edges lists them with their meaning)."""

from __future__ import annotations

import enum


class CloseCode(enum.IntEnum):
    """Close codes in the application range 4000-4999, plus the standard ones the relay uses."""

    NORMAL = 1000
    GOING_AWAY = 1001  # the relay is shutting down
    UNSUPPORTED_DATA = 1003  # a text message where only binary ones are allowed
    MESSAGE_TOO_BIG = 1009  # sent by the WebSocket layer when a message exceeds the limit

    BAD_PATH = 4000
    NO_TOKEN = 4001
    BAD_TOKEN = 4002
    TOKEN_EXPIRED = 4003
    BAD_ROLE = 4004
    BAD_PREAMBLE = 4005
    ROLE_TAKEN = 4006
    WAIT_TIMEOUT = 4007
    PEER_CLOSED = 4008
    TOO_MANY_CONNECTIONS = 4009
    PREAMBLE_TIMEOUT = 4010
    KEEPALIVE_TIMEOUT = 4011
    TOKEN_REUSED = 4012
