"""How the last rank samples: one :class:`SamplingParams` contract for the CLI, the TUI, the control socket, the API
and the wire.

Every range is declared once, as an attrs validator on its field; a value out of range raises
:class:`SamplingError`, which names the field. The wire decoder turns it into a ``ProtocolError`` (a peer sent it);
front ends turn it into their own reply (an API 400 with ``param``, a CLI one-liner). Each front end starts from a
named default set instead of spelling its own defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs

from kvasir.core.schema import FieldError, register_record
from kvasir.core.validators import Validator, int_in, number_in

I32_MAX = 2**31 - 1
#: llama.cpp reads a seed of 0xFFFFFFFF as "random", so the largest usable seed is one less.
MAX_SEED = 2**32 - 2
#: The longest penalty window: the longest prompt a START frame carries (kvasir.wire.frames.MAX_PROMPT_TOKENS).
MAX_REPEAT_LAST_N = 1 << 20


class SamplingError(FieldError):
    """A sampling parameter out of range; ``field`` is its name (``top_p``), ``reason`` the rule it broke."""


def _number(low: float, high: float, *, open_low: bool = False) -> Validator:
    interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
    return number_in(low, high, open_low=open_low, reason=f"must be in {interval}", error=SamplingError)


def _integer(low: int, high: int, *, optional: bool = False) -> Validator:
    rule = f"must be {'None or ' if optional else ''}an int in [{low}, {high}]"
    return int_in(low, high, optional=optional, reason=rule, error=SamplingError)


def _float(value: float) -> float:
    # ints become floats so that equal settings compare and print alike; anything else is left to the validator.
    return float(value) if type(value) is int else value


@attrs.frozen
class SamplingParams:
    """How the last rank samples. Plain defaults are llama.cpp's; ``temperature == 0`` means greedy."""

    temperature: float = attrs.field(default=0.8, converter=_float, validator=_number(0.0, 100.0))
    top_k: int = attrs.field(default=40, validator=_integer(0, I32_MAX))  # 0 = whole vocabulary
    top_p: float = attrs.field(default=0.95, converter=_float, validator=_number(0.0, 1.0, open_low=True))  # 1 = off
    min_p: float = attrs.field(default=0.05, converter=_float, validator=_number(0.0, 1.0))  # 0 = off
    repeat_penalty: float = attrs.field(
        default=1.0, converter=_float, validator=_number(0.0, 100.0, open_low=True)
    )  # 1 = off
    repeat_last_n: int = attrs.field(default=64, validator=_integer(-1, MAX_REPEAT_LAST_N))  # 0 = off, -1 = all
    seed: int | None = attrs.field(default=None, validator=_integer(0, MAX_SEED, optional=True))  # None: random

    MAX_SEED: ClassVar[int] = MAX_SEED
    #: The field names, in wire order.
    FIELDS: ClassVar[tuple[str, ...]]
    #: llama.cpp's defaults (``llama-cli``, ``llama-server``).
    LLAMA_CPP: ClassVar[SamplingParams]
    #: The OpenAI API's defaults for OpenAI's fields (temperature 1, top_p 1), llama.cpp's for the extensions.
    OPENAI: ClassVar[SamplingParams]
    #: Greedy: what the CLI, the control socket and the TUI start from, so that a first run is reproducible.
    GREEDY: ClassVar[SamplingParams]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_fields(self, values: Mapping[str, object]) -> SamplingParams:
        """These settings with every sampling field that ``values`` holds and that is not None replaced.

        Other keys are ignored (a request body carries more than sampling); a bad value raises
        :class:`SamplingError`.
        """
        changes: dict[str, Any] = {name: values[name] for name in self.FIELDS if values.get(name) is not None}
        return attrs.evolve(self, **changes) if changes else self


SamplingParams.FIELDS = tuple(a.name for a in attrs.fields(SamplingParams))
SamplingParams.LLAMA_CPP = SamplingParams()
SamplingParams.OPENAI = attrs.evolve(SamplingParams.LLAMA_CPP, temperature=1.0, top_p=1.0)
SamplingParams.GREEDY = attrs.evolve(SamplingParams.LLAMA_CPP, temperature=0.0)

register_record(SamplingParams)
