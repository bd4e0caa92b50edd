"""The attrs field validators every record uses: one place for the value rules' shapes and their wording.

Each returns an attrs validator that raises :class:`~kvasir.core.schema.FieldError` (the field's name, or ``key``
where the wire spells it otherwise, and the rule it broke), so :func:`kvasir.core.schema.structure` reports the path
that ends at the field. ``error`` swaps in a narrower FieldError (``SamplingError``) or any ``(field, reason)``
factory (a relay setting's ``RelayConfigError``); ``reason`` rewords a rule where a format has its own wording. The
schema converter has already checked the JSON type; these rules also hold for records built in code, so they check
the type again (``True`` is not an integer).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import attrs

from kvasir.core.schema import FieldError

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]
#: (field, reason) -> the exception to raise.
ErrorFactory = Callable[[str, str], Exception]


def is_int(value: object) -> bool:
    """An int and not a bool."""
    return type(value) is int


def is_number(value: object) -> bool:
    """A finite int or float, not a bool."""
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def rule(
    ok: Callable[[Any], bool], reason: str, *, key: str | None = None, error: ErrorFactory = FieldError
) -> Validator:
    """``ok(value)``, or ``error(key or the attribute's name, reason)``."""

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not ok(value):
            raise error(key or attribute.name, reason)

    return check


def int_in(
    low: int,
    high: int | None = None,
    *,
    optional: bool = False,
    key: str | None = None,
    reason: str | None = None,
    error: ErrorFactory = FieldError,
) -> Validator:
    """An integer in ``[low, high]`` (``high`` None: no upper bound); ``optional``: None passes too."""
    if reason is None:
        reason = f"must be an integer >= {low}" if high is None else f"must be an integer in [{low}, {high}]"

    def ok(v: Any) -> bool:
        return (optional and v is None) or (is_int(v) and low <= v and (high is None or v <= high))

    return rule(ok, reason, key=key, error=error)


def number_in(
    low: float,
    high: float,
    *,
    open_low: bool = False,
    optional: bool = False,
    reason: str | None = None,
    error: ErrorFactory = FieldError,
) -> Validator:
    """A finite number in ``[low, high]`` (``(low, high]`` when ``open_low``); ``optional``: None passes too.
    Not a number at all reads "must be a number, got str"."""
    interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
    if reason is None:
        reason = f"must be a number in {interval}"

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise error(attribute.name, f"must be a number, got {type(value).__name__}")
        above = low < value if open_low else low <= value
        if not (math.isfinite(value) and above and value <= high):
            raise error(attribute.name, reason)

    return check


def positive(*, zero: bool = False, error: ErrorFactory = FieldError) -> Validator:
    """A finite number above 0 (``zero``: or 0)."""

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not (is_number(value) and (value > 0 or (zero and value == 0))):
            raise error(attribute.name, f"must be a positive number, not {value!r}")

    return check


def at_least(low: float, *, optional: bool = False, error: ErrorFactory = FieldError) -> Validator:
    """A number >= ``low``; ``optional``: None passes too."""

    def check(_: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if optional and value is None:
            return
        if not (is_number(value) and value >= low):
            raise error(attribute.name, f"must be at least {low:g}, not {value!r}")

    return check


def matches(pattern: str | re.Pattern[str], reason: str, *, key: str | None = None) -> Validator:
    """A string that ``pattern`` matches in full."""
    compiled = re.compile(pattern) if isinstance(pattern, str) else pattern
    return rule(lambda v: isinstance(v, str) and compiled.fullmatch(v) is not None, reason, key=key)


def one_of(*allowed: object, key: str | None = None) -> Validator:
    """One of ``allowed``."""
    return rule(lambda v: v in allowed, f"must be one of {', '.join(map(str, allowed))}", key=key)


def optional(check: Validator) -> Validator:
    """``check``, or None."""
    return attrs.validators.optional(check)
