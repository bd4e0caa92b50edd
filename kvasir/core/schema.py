"""One schema layer: a cattrs converter for every JSON body and TOML file Kvasir reads and writes.

Shapes are frozen attrs classes whose field validators hold the value rules; this converter adds the type rules and
the few spellings that differ from the attribute names:

- types are strict, as JSON and TOML give them: an int field takes an int (not ``true``, ``1.5`` or ``"1"``), a
  float field an int or a finite float, a sequence field a list;
- ``start``/``end`` attribute pairs are spelled ``"layers": [start, end]`` (:func:`register_record`);
- classes registered with ``forbid_extra=True`` refuse unknown keys.

:func:`structure` turns every failure into one :class:`SchemaError` line that names the source and the field path
(``model: stages[1].bytes: must be an integer``); its ``path`` and ``reason`` stay apart for replies that name the
field (an API 400's ``param``). Field validators raise :class:`FieldError` so the path ends at their field. Both are
``InputError``s; a caller whose data came from a peer re-raises them as ``ProtocolError``. cattrs is pure Python, so
this installs on Termux.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import cattrs
from cattrs.cols import homogenous_tuple_structure_factory, is_sequence, list_structure_factory
from cattrs.errors import (
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from kvasir.errors import InputError, KvasirError

T = TypeVar("T")


class FieldError(InputError):
    """A field validator's refusal: ``field`` is the attribute (or wire key) and ``reason`` the rule it broke."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}")
        self.field = field
        self.reason = reason


Json = dict[str, Any]

converter = cattrs.Converter()
#: attribute -> wire key for renamed fields, so that error paths show the key a user wrote (cattrs' notes carry the
#: attribute name only).
_WIRE_KEYS: dict[str, str] = {}


# ---------------------------------------------------------------------------------------------- strict primitives


def _int(value: object, _: type) -> int:
    if type(value) is not int:
        raise InputError(f"must be an integer, not {_shown(value)}")
    return value


def _float(value: object, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"must be a finite number, not {_shown(value)}")
    return float(value)


def _str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise InputError(f"must be a string, not {_shown(value)}")
    return value


def _bool(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise InputError(f"must be true or false, not {_shown(value)}")
    return value


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


converter.register_structure_hook(int, _int)
converter.register_structure_hook(float, _float)
converter.register_structure_hook(str, _str)
converter.register_structure_hook(bool, _bool)


def _is_literal(t: Any) -> bool:
    return typing.get_origin(t) is typing.Literal


def _literal_factory(t: Any) -> Callable[[object, type], object]:
    allowed = typing.get_args(t)

    def structure(value: object, _: type) -> object:
        if value not in allowed or type(value) is bool:
            raise InputError(f"must be one of {', '.join(map(str, allowed))}, not {_shown(value)}")
        return value

    return structure


def _sequence_factory(t: Any, conv: cattrs.BaseConverter) -> Callable[[object, type], object]:
    # cattrs would iterate any iterable (a string becomes a list of letters); JSON and TOML give lists.
    inner = (
        list_structure_factory(t, conv) if typing.get_origin(t) is list else homogenous_tuple_structure_factory(t, conv)
    )

    def structure(value: object, tp: type) -> object:
        if not isinstance(value, list | tuple):
            raise InputError(f"must be a list, not {_shown(value)}")
        return inner(value, tp)

    return structure


converter.register_structure_hook_factory(_is_literal, _literal_factory)
converter.register_structure_hook_factory(is_sequence, _sequence_factory)


# ---------------------------------------------------------------------------------------------- records


def layers_pair(value: object) -> tuple[int, int]:
    """``[start, end]`` with ``0 <= start < end``."""
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(type(x) is int for x in value)):
        raise FieldError("layers", "must be [start, end]")
    a, b = value
    if not 0 <= a < b:
        raise FieldError("layers", f"[{a}, {b}] is not a non-empty window")
    return a, b


def register_record(
    cls: type[T],
    *,
    window: bool = False,
    forbid_extra: bool = False,
    omit_if_none: tuple[str, ...] = (),
    omit_if_empty: tuple[str, ...] = (),
    rename: Mapping[str, str] | None = None,
    key_order: tuple[str, ...] | None = None,
) -> None:
    """Teach the converter one record class.

    ``window``: the ``start``/``end`` attributes travel as ``"layers": [start, end]``. ``omit_if_none``: attributes
    left out of the output while None; ``omit_if_empty``: while empty. ``rename``: attribute -> key.
    ``key_order``: the output's key order, where a wire format fixes one (keys not listed follow in attribute order).
    """
    names = rename or {}
    _WIRE_KEYS.update(names)
    overrides: dict[str, Any] = {a: override(rename=k) for a, k in names.items()}
    structure_fn = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=forbid_extra, **overrides)
    unstructure_fn = make_dict_unstructure_fn(cls, converter, **overrides)

    def structure(data: object, _: type) -> T:
        if not isinstance(data, Mapping):
            raise InputError(f"must be an object, not {_shown(data)}")
        if window:
            if "layers" not in data:
                raise FieldError("layers", "required field missing")
            if forbid_extra and ("start" in data or "end" in data):
                raise InputError(f"unknown field {'start' if 'start' in data else 'end'!r}")
            start, end = layers_pair(data["layers"])
            data = {**{k: v for k, v in data.items() if k != "layers"}, "start": start, "end": end}
        return structure_fn(data, cls)

    def unstructure(obj: T) -> Json:
        raw = unstructure_fn(obj)
        out: Json = {}
        for key, value in raw.items():
            if (key in omit_if_none and value is None) or (key in omit_if_empty and not value):
                continue
            if window and key in ("start", "end"):
                if key == "start":
                    out["layers"] = [raw["start"], raw["end"]]
                continue
            out[key] = value
        if key_order:
            out = {k: out[k] for k in key_order if k in out} | {k: v for k, v in out.items() if k not in key_order}
        return out

    converter.register_structure_hook(cls, structure)
    converter.register_unstructure_hook(cls, unstructure)


# ---------------------------------------------------------------------------------------------- entry points


class SchemaError(InputError):
    """A body or file that does not fit its shape: ``where`` (the source), ``path`` (``stages[1].bytes``, may be
    empty) and ``reason``, joined into one line."""

    def __init__(self, where: str, path: str, reason: str) -> None:
        super().__init__(": ".join(part for part in (where, path, reason) if part))
        self.where = where
        self.path = path
        self.reason = reason


def structure(data: object, cls: type[T], *, where: str) -> T:
    """``data`` (parsed JSON or TOML) as a ``cls``; any problem is one :class:`SchemaError` line."""
    try:
        return converter.structure(data, cls)
    except (BaseValidationError, KvasirError) as exc:  # KvasirError: a class validator, or a record hook
        path, reason = locate(exc)
        raise SchemaError(where, path, reason) from None


def unstructure(obj: object) -> Any:
    """``obj`` as JSON- and TOML-ready dicts, lists and scalars."""
    return converter.unstructure(obj)


def locate(exc: BaseException) -> tuple[str, str]:
    """The first problem in a structuring failure: its field path and its reason."""
    path = ""
    while isinstance(exc, ClassValidationError | IterableValidationError):
        noted, other = exc.group_exceptions()
        if noted:
            exc, note = noted[0]
            if isinstance(note, IterableValidationNote):
                step = f"[{note.index}]"
            else:
                step = f".{_WIRE_KEYS.get(note.name, note.name)}"
            path += step
        else:
            exc = other[0]
    if isinstance(exc, FieldError):
        return (path + f".{exc.field}").lstrip("."), exc.reason
    path = path.lstrip(".")
    if isinstance(exc, ForbiddenExtraKeysError):
        return path, f"unknown field {sorted(exc.extra_fields)[0]!r}"
    if isinstance(exc, KeyError):
        return path, "required field missing"
    if isinstance(exc, KvasirError):
        return path, str(exc)
    return path, f"invalid value ({exc})"
