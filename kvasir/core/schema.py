"""One schema layer: a cattrs converter for every JSON body and TOML file Kvasir reads and writes.

Shapes are frozen attrs classes whose field validators hold the value rules; this converter adds the type rules and
the few spellings that differ from the attribute names:

- types are strict, as JSON and TOML give them: an int field takes an int (not ``true``, ``1.5`` or ``"1"``), a
  float field an int or a finite float, a sequence field a list, a bytes field unpadded base64url text;
- ``start``/``end`` attribute pairs are spelled ``"layers": [start, end]`` (:func:`register_record`);
- classes registered with ``forbid_extra=True`` refuse unknown keys;
- every attrs class takes a JSON object and nothing else, registered or not (a list is never "all defaults").

Each record is registered next to its class (:func:`register_record`, or :func:`register_hooks` for a hand-written
hook), never by another module's import, so the converter behaves the same whatever was imported first;
``tests/test_schema.py`` walks every attrs class and checks it is registered or exempt with a reason.

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

import attrs
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

from kvasir.core.errors import InputError, KvasirError
from kvasir.core.signed import b64url, unb64url

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
#: Classes taught to the converter (:func:`register_record`, :func:`register_hooks`).
_REGISTERED: set[type] = set()


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


def _bytes(value: object, _: type) -> bytes:
    try:
        return unb64url(value, "")
    except InputError:
        raise InputError(f"must be base64url text, not {_shown(value)}") from None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"a {type(value).__name__}"


converter.register_structure_hook(int, _int)
converter.register_structure_hook(float, _float)
converter.register_structure_hook(str, _str)
converter.register_structure_hook(bool, _bool)
converter.register_structure_hook(bytes, _bytes)
converter.register_unstructure_hook(bytes, b64url)


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


def _is_fixed_tuple(t: Any) -> bool:
    args = typing.get_args(t)
    return typing.get_origin(t) is tuple and bool(args) and args[-1] is not Ellipsis


def _fixed_tuple_factory(t: Any, conv: cattrs.BaseConverter) -> Callable[[object, type], object]:
    # ``tuple[int, int]``: a list of exactly that many, each item structured as its own type.
    items = typing.get_args(t)

    def structure(value: object, _: type) -> object:
        if not isinstance(value, list | tuple) or len(value) != len(items):
            raise InputError(f"must be a list of {len(items)}, not {_shown(value)}")
        out = []
        for i, (v, item) in enumerate(zip(value, items, strict=True)):
            try:
                out.append(conv.structure(v, item))
            except Exception as exc:
                exc.__notes__ = [*getattr(exc, "__notes__", []), IterableValidationNote(f"@ index {i}", i, item)]
                raise IterableValidationError(f"While structuring {t!r}", [exc], t) from None
        return tuple(out)

    return structure


def _object_factory(cls: Any, conv: cattrs.BaseConverter) -> Callable[[object, type], object]:
    # cattrs' own attrs hook would read a list (or any non-mapping) as "every field at its default".
    inner = make_dict_structure_fn(cls, conv)

    def structure(value: object, tp: type) -> object:
        return inner(require_object(value), tp)

    return structure


converter.register_structure_hook_factory(_is_literal, _literal_factory)
converter.register_structure_hook_factory(is_sequence, _sequence_factory)
converter.register_structure_hook_factory(_is_fixed_tuple, _fixed_tuple_factory)
converter.register_structure_hook_factory(attrs.has, _object_factory)


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
    register_hooks(
        cls,
        *record_hooks(
            cls,
            window=window,
            forbid_extra=forbid_extra,
            omit_if_none=omit_if_none,
            omit_if_empty=omit_if_empty,
            rename=rename,
            key_order=key_order,
        ),
    )


def record_hooks(
    cls: type[T],
    *,
    window: bool = False,
    forbid_extra: bool = False,
    omit_if_none: tuple[str, ...] = (),
    omit_if_empty: tuple[str, ...] = (),
    rename: Mapping[str, str] | None = None,
    key_order: tuple[str, ...] | None = None,
) -> tuple[Callable[[object, type], T], Callable[[T], Json]]:
    """The structure and unstructure hooks :func:`register_record` registers, for a class whose own hook wraps
    them (then registered with :func:`register_hooks`)."""
    names = rename or {}
    _WIRE_KEYS.update(names)
    overrides: dict[str, Any] = {a: override(rename=k) for a, k in names.items()}
    structure_fn = make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=forbid_extra, **overrides)
    unstructure_fn = make_dict_unstructure_fn(cls, converter, **overrides)

    def structure(data: object, _: type) -> T:
        data = require_object(data)
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

    return structure, unstructure


def register_hooks(
    cls: type[T], structure: Callable[[Any, type], T], unstructure: Callable[[T], Any] | None = None
) -> None:
    """Teach the converter one class by hand-written hooks (a shape :func:`register_record` cannot say). A structure
    hook must refuse a non-object itself (:func:`require_object`)."""
    converter.register_structure_hook(cls, structure)
    if unstructure is not None:
        converter.register_unstructure_hook(cls, unstructure)
    _REGISTERED.add(cls)


def is_registered(cls: type) -> bool:
    """Whether ``cls`` was registered with the converter (:func:`register_record` or :func:`register_hooks`)."""
    return cls in _REGISTERED


def require_object(data: object) -> Mapping[str, Any]:
    """``data`` if it is a JSON object; InputError otherwise (the start of every hand-written structure hook)."""
    if not isinstance(data, Mapping):
        raise InputError(f"must be an object, not {_shown(data)}")
    return data


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
