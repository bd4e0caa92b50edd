"""The ring's error codes (docs/protocol.md § ERROR): carried by ERROR frames and by the typed errors behind them."""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    PROTOCOL = 1  # the receiver got a malformed frame; the link closes
    UNSUPPORTED_VERSION = 2
    MODEL_MISMATCH = 3
    WINDOW_MISMATCH = 4  # rank, layer window or ring size does not join the receiver's
    BAD_REQUEST = 5  # a START the receiver cannot serve as asked (e.g. prompt tokens outside the vocabulary)
    CONTEXT_FULL = 6
    OVERLOADED = 7
    STAGE_FAILED = 8
    INTERNAL = 9
    SHUTTING_DOWN = 10
    LINK_LOST = 11  # the sender lost its link to a neighbour with the request in flight: it cannot go on
    REPLAY_MISMATCH = 12  # a replayed frame differs from the one received before at that position (never silent)
    CHAIN_MISMATCH = 13  # a BOUNDARY's chain head is not the receiver's own chain of what it received (never silent)
    PARAMS_MISMATCH = 14  # a START whose parameters are not what its entry committed to (altered on the way)
