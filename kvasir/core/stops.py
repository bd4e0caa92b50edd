"""Stop-string search and the end-of-generation decision, shared by the in-process pipeline (``kvasir generate``),
the ring's last rank and the entry node's text stream. One copy each: the ring answers bit-exactly as ``generate``
only while both end a generation at the same token for the same reason."""

from __future__ import annotations

import enum
from collections.abc import Sequence


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None (pure)."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


class Ending(enum.Enum):
    """Why a generation ends at a sampled token (the wire's EndReason names the same three)."""

    EOG = "eog"  #: the token is an end-of-generation token: it is not emitted
    STOP = "stop"  #: the output text now holds a stop string
    MAX_TOKENS = "max_tokens"  #: the token was the last one asked for


def ending(*, eog: bool, text: str, stops: Sequence[str], generated: int, max_tokens: int) -> Ending | None:
    """Whether a generation ends at the token just sampled (pure), checked in ``generate``'s order.

    ``eog``: the token is end-of-generation (then it was not emitted); otherwise it was, and ``text`` is the output
    text and ``generated`` the token count with it. None: go on.
    """
    if eog:
        return Ending.EOG
    if find_stop(text, stops) is not None:
        return Ending.STOP
    if generated >= max_tokens:
        return Ending.MAX_TOKENS
    return None
