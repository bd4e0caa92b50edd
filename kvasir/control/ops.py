"""The control socket's request ops (docs/protocol.md § Control socket), parsed by the schema converter.

Each line a client writes is one JSON object with an ``op``; :func:`parse_op` turns it into one of the frozen ops
below or raises :class:`~kvasir.core.errors.InputError` naming the op and the field. Unknown keys are ignored, as they
always were. ``generate`` takes its sampling fields flat (``temperature``, ``top_p``, …) on top of
:attr:`SamplingParams.GREEDY`, the same defaults as the CLI and the TUI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
from cattrs.gen import make_dict_structure_fn, override

from kvasir.core.errors import InputError
from kvasir.core.sampling import SamplingParams
from kvasir.core.schema import converter, register_hooks, register_record, require_object, structure

OPS = ("status", "watch", "generate", "cancel")


@attrs.frozen
class StatusOp:
    """Answer one status snapshot."""


@attrs.frozen
class WatchOp:
    """Stream status snapshots every ``interval`` seconds (clamped to [0.1, 10]) and events as they happen."""

    interval: float = 1.0

    @property
    def clamped_interval(self) -> float:
        return min(max(self.interval, 0.1), 10.0)


@attrs.frozen
class GenerateOp:
    """Generate from ``tokens`` if given, else from ``prompt`` (through the chat template when ``chat``)."""

    prompt: str = ""
    tokens: tuple[int, ...] | None = None
    chat: bool = False
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams.GREEDY
    #: Speculative decoding: up to this many drafts per step (None: the node's ``--speculate``).
    speculate: int | None = None


@attrs.frozen
class CancelOp:
    request: int = 0


Op = StatusOp | WatchOp | GenerateOp | CancelOp
_CLASSES: dict[str, type[Op]] = {"status": StatusOp, "watch": WatchOp, "generate": GenerateOp, "cancel": CancelOp}


def parse_op(msg: Mapping[str, Any]) -> Op:
    """The op one request line asks for."""
    name = msg.get("op")
    cls = _CLASSES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InputError(f"unknown op {name!r} ({', '.join(OPS)})")
    return structure({k: v for k, v in msg.items() if k != "op"}, cls, where=str(name))


_generate_fields = make_dict_structure_fn(GenerateOp, converter, sampling=override(omit=True))


def _structure_generate(data: object, _: type) -> GenerateOp:
    data = require_object(data)
    sampling = SamplingParams.GREEDY.with_fields(data)
    rest = {k: v for k, v in data.items() if k not in SamplingParams.FIELDS}
    return attrs.evolve(_generate_fields(rest, GenerateOp), sampling=sampling)


register_record(StatusOp)
register_record(WatchOp)
register_record(CancelOp)
register_hooks(GenerateOp, _structure_generate)
