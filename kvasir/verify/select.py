"""Audit selection: which (request, window) receipts an auditor re-executes, at a fraction f.

The decision is a keyed hash: ``HMAC-SHA256(key, request ‖ start ‖ end)`` read as a number in [0, 1), selected when
below f (:func:`selected`). The key is the auditor's (the operator's, or an entry's) secret; it commits to it first
by publishing :func:`key_commitment` and reveals it only after the nodes signed their receipts, so a node cannot tell
while it computes whether this request will be checked, and the auditor cannot pick its targets after seeing the
receipts (the revealed key must match the commitment). Everything here is pure; the record directory a ring node
writes (:mod:`kvasir.ring.record`) is sorted by :func:`reveal`.

A node cannot know which inputs to keep before the key is revealed, so it keeps every request's inputs in a bounded
spool (``pending/``) until then; :func:`reveal` keeps the selected ones (``selected/``) and deletes the rest. The
receipts (a few KiB a request) are kept for all requests.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from pathlib import Path

import attrs

from kvasir.core.errors import InputError
from kvasir.verify.audit import WindowLog, read_json, write_json
from kvasir.verify.commit import VerificationError, WindowReceipt, successor_mismatch

SELECT_DOMAIN = b"kvasir-audit-select/v1\n"
COMMIT_DOMAIN = b"kvasir-audit-key/v1\n"
KEY_BYTES = 32
RECEIPTS, PENDING, SELECTED = "receipts", "pending", "selected"


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def key_commitment(key: bytes) -> str:
    """What the auditor publishes before the epoch: sha256 over a domain and the key."""
    return hashlib.sha256(COMMIT_DOMAIN + key).hexdigest()


def selection_value(key: bytes, request: int, window: tuple[int, int]) -> float:
    """A number in [0, 1) that only the key's holder can compute for this (request, window)."""
    mac = hmac.new(key, SELECT_DOMAIN + struct.pack("<QII", request, window[0], window[1]), hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "big") / 2**64


def selected(key: bytes, request: int, window: tuple[int, int], fraction: float) -> bool:
    """Whether the auditor re-executes this window of this request (``fraction`` in [0, 1])."""
    if not 0.0 <= fraction <= 1.0:
        raise InputError(f"audit fraction must be in [0, 1], got {fraction}")
    return selection_value(key, request, window) < fraction


def log_name(request: int, window: tuple[int, int]) -> str:
    """The file stem of one request's record on one window (receipt and log share it)."""
    return f"{request:016x}-{window[0]}-{window[1]}"


@attrs.frozen
class Revealed:
    """What :func:`reveal` did to a record directory."""

    selected: tuple[Path, ...]
    dropped: int
    #: Selected logs whose predecessor's receipt was found and checked against their input hashes.
    linked: int
    #: Selected logs whose inputs are not what the predecessor signed it sent: (log, first differing step).
    broken_links: tuple[tuple[Path, int], ...]
    #: Pending files left where they are: not named like a log, not a log, or not of the request its name says.
    skipped: tuple[Path, ...] = ()


def reveal(directory: Path, key: bytes, fraction: float, *, commitment: str | None = None) -> Revealed:
    """Apply the revealed ``key`` to a record directory: move the selected pending logs to ``selected/`` (with the
    predecessor's receipt attached when ``receipts/`` holds it, and the successor check run on it), delete the rest.

    ``commitment``: refuse a key that is not the one committed to (VerificationError).
    """
    if commitment is not None and not hmac.compare_digest(key_commitment(key), commitment):
        raise VerificationError("the revealed audit key does not match its commitment")
    pending = directory / PENDING
    out = directory / SELECTED
    out.mkdir(exist_ok=True)
    chosen: list[Path] = []
    broken: list[tuple[Path, int]] = []
    skipped: list[Path] = []
    dropped = linked = 0
    for path in sorted(pending.glob("*.log.json")):
        named = _parse_name(path.name.removesuffix(".log.json"))
        if named is None:
            skipped.append(path)
            continue
        if not selected(key, named[0], named[1], fraction):
            path.unlink()  # decided by its name: an unselected log is never read
            dropped += 1
            continue
        try:
            log = WindowLog.from_wire(read_json(path), str(path))
        except InputError:
            skipped.append(path)
            continue
        r = log.receipt
        if (r.request, (r.start, r.end)) != named:  # not what its name says: left for the auditor to look at
            skipped.append(path)
            continue
        pred = log.predecessor or _predecessor(directory, r)
        if pred is not None:
            linked += 1
            bad = successor_mismatch(pred.output_hashes, r.input_hashes)
            if bad is not None:
                broken.append((out / path.name, bad))
            log = attrs.evolve(log, predecessor=pred)
        write_json(out / path.name, log.to_wire())
        path.unlink()
        chosen.append(out / path.name)
    return Revealed(tuple(chosen), dropped, linked, tuple(broken), tuple(skipped))


def _parse_name(stem: str) -> tuple[int, tuple[int, int]] | None:
    """``(request, window)`` of a :func:`log_name`, or None when the name is not one."""
    parts = stem.split("-")
    if len(parts) != 3 or len(parts[0]) != 16:
        return None
    try:
        return int(parts[0], 16), (int(parts[1]), int(parts[2]))
    except ValueError:
        return None


def _predecessor(directory: Path, receipt: WindowReceipt) -> WindowReceipt | None:
    """The receipt of the window before ``receipt``'s for the same request, if the directory holds a valid one."""
    for path in (directory / RECEIPTS).glob(f"{receipt.request:016x}-*-{receipt.start}.json"):
        try:
            pred = WindowReceipt.from_wire(read_json(path), str(path))
            pred.verify()
        except (InputError, VerificationError):
            continue
        if pred.model_sha256 == receipt.model_sha256 and pred.end == receipt.start:
            return pred
    return None
