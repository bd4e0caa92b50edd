"""Window tickets: the market's short-lived word that a key holds a window, checked by neighbours before linking.

A ticket names the model, the window ``[start, end)``, the holder's public key, an expiry (unix seconds), an
optional relay edge id and the issuing market's key. Text form (ASCII, what a link's handshake carries as bytes)::

    kt1.<base64url of the canonical bytes>.<base64url Ed25519 signature by the issuer>

Canonical bytes: ``kvasir-window-ticket/v1\\n<model>\\n<start>\\n<end>\\n<holder key>\\n<not_after>\\n<relay edge or
empty>\\n<issuer key>``. The market issues one with every claim and renewal (``Lease.ticket``), valid for at most
:data:`MAX_TICKET_S` and never past the lease. :class:`TicketPolicy` is the link side
(:class:`kvasir.ring.secure.PeerPolicy`); :func:`ticket_problem` is its pure core, with time passed in.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import attrs

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.signed import canonical_lines, seal, split_lines, unseal
from kvasir.ring.manifest import Manifest

TICKET_PREFIX = "kt1"
DOMAIN = b"kvasir-window-ticket/v1\n"
#: A ticket outlives its renewal by little: a holder that lost its lease is refused within minutes.
MAX_TICKET_S = 300
#: Clock disagreement between the market and a neighbour that a check tolerates.
TICKET_SKEW_S = 30
MAX_TICKET_CHARS = 2048
_SHA = re.compile(r"[0-9a-f]{64}")
_EDGE = re.compile(r"[A-Za-z0-9_-]{0,128}")


@attrs.frozen
class WindowTicket:
    model: str
    start: int
    end: int
    holder: PublicKey
    not_after: int
    issuer: PublicKey
    relay_edge: str = ""

    def __attrs_post_init__(self) -> None:
        if not _SHA.fullmatch(self.model):
            raise InputError("a ticket's model is a lowercase hex sha256")
        if not 0 <= self.start < self.end or self.not_after < 0:
            raise InputError("a ticket names a non-empty window and a non-negative expiry")
        if not _EDGE.fullmatch(self.relay_edge):
            raise InputError("a ticket's relay edge is up to 128 characters of [A-Za-z0-9_-]")

    def to_bytes(self) -> bytes:
        return canonical_lines(
            DOMAIN,
            self.model,
            self.start,
            self.end,
            self.holder.to_text(),
            self.not_after,
            self.relay_edge,
            self.issuer.to_text(),
        )

    @classmethod
    def from_bytes(cls, data: bytes) -> WindowTicket:
        parts = split_lines(data, DOMAIN, 7, "window ticket")
        model, start, end, holder, not_after, edge, issuer = parts
        if not (start.isdigit() and end.isdigit() and not_after.isdigit()) or max(map(len, parts[1:5])) > 100:
            raise InputError("a window ticket's numbers are decimal")
        return cls(
            model, int(start), int(end), PublicKey.from_text(holder), int(not_after), PublicKey.from_text(issuer), edge
        )


def issue_ticket(issuer: Identity, ticket: WindowTicket) -> str:
    """The signed text form; ``ticket.issuer`` must be ``issuer``'s key."""
    if ticket.issuer != issuer.public:
        raise InputError("a ticket names its issuer's own key")
    body = ticket.to_bytes()
    return f"{TICKET_PREFIX}.{seal(issuer, body)}"


def parse_ticket(text: str | bytes, issuer: PublicKey) -> WindowTicket:
    """The ticket in ``text`` if ``issuer`` signed it (InputError otherwise); expiry is not checked here."""
    body, sig = unseal(text, TICKET_PREFIX, "window ticket", max_chars=MAX_TICKET_CHARS)
    ticket = WindowTicket.from_bytes(body)
    if ticket.issuer != issuer or not issuer.verify(sig, body):
        raise InputError("the window ticket is not signed by this market")
    return ticket


def ticket_problem(
    text: str | bytes, key: PublicKey, *, issuer: PublicKey, model: str, windows: frozenset[tuple[int, int]], now: float
) -> str | None:
    """Why ``key`` presenting ``text`` may not link as the holder of one of ``windows`` of ``model``, or None."""
    if not text:
        return f"key {key.fingerprint} presented no window ticket"
    try:
        t = parse_ticket(text, issuer)
    except InputError as exc:
        return f"key {key.fingerprint}: {exc}"
    if t.holder != key:
        return f"key {key.fingerprint} presented a ticket issued to {t.holder.fingerprint}"
    if t.model != model or (t.start, t.end) not in windows:
        return f"key {key.fingerprint}'s ticket is for window {t.start}:{t.end} of {t.model[:12]}…, not a neighbour's"
    if t.not_after + TICKET_SKEW_S < now:
        return f"key {key.fingerprint}'s window ticket expired at {t.not_after}"
    return None


@attrs.frozen
class TicketPolicy:
    """A :class:`~kvasir.ring.secure.PeerPolicy`: accepts a key with a valid market ticket for one of ``windows``
    (a ring node's: exactly its predecessor's window, :func:`predecessor_ticket_policy`)."""

    issuer: PublicKey
    model: str
    windows: frozenset[tuple[int, int]]
    clock: Callable[[], float] = time.time

    def problem(self, key: PublicKey, ticket: bytes) -> str | None:
        return ticket_problem(ticket, key, issuer=self.issuer, model=self.model, windows=self.windows, now=self.clock())

    def ticket_window(self, key: PublicKey, ticket: bytes) -> tuple[int, int] | None:
        """The window ``ticket`` admits ``key`` as the holder of, or None if it admits it to none: the HELLO that
        follows must claim exactly this window."""
        if self.problem(key, ticket) is not None:
            return None
        t = parse_ticket(ticket, self.issuer)
        return t.start, t.end


def predecessor_ticket_policy(
    issuer: PublicKey, model: str, manifest: Manifest, rank: int, clock: Callable[[], float] = time.time
) -> TicketPolicy:
    """Who may link to rank ``rank`` as its predecessor: the holder of a ticket for exactly the previous rank's
    window. The successor's window is not admitted (a holder of it would pose as the predecessor, issue 24 N2)."""
    pred = manifest.rank((rank - 1) % manifest.size)
    return TicketPolicy(issuer, model, frozenset({(pred.start, pred.end)}), clock)
