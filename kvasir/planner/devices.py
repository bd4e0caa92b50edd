"""Devices a ring can be built from, and the ``devices.toml`` that lists them."""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

import attrs

from kvasir.errors import InputError

DeviceKind = Literal["gpu", "cpu", "npu", "phone"]
DEVICE_KINDS: tuple[DeviceKind, ...] = ("gpu", "cpu", "npu", "phone")

# Units: memory in GB (1e9 bytes), memory bandwidth in GB/s, link latency in ms (one way, device to network),
# link bandwidth in Mbit/s (1e6 bits/s).
_NUMBER_FIELDS = ("memory_gb", "mem_bandwidth_gbs", "link_latency_ms", "link_bandwidth_mbps")
_FIELDS = frozenset(("name", "kind", *_NUMBER_FIELDS))


def _positive(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    # link_latency_ms may be 0 (same host); everything else must be strictly positive.
    low_ok = attribute.name == "link_latency_ms" and value == 0
    if not (math.isfinite(value) and (value > 0 or low_ok)):
        raise InputError(f"device field {attribute.name!r} must be a positive number, not {value!r}")


@attrs.frozen
class Device:
    """One machine that can run a window: its memory budget, memory bandwidth and network link."""

    name: str
    kind: DeviceKind
    memory_gb: float = attrs.field(validator=_positive)  # what Kvasir may use, not the RAM on the box
    mem_bandwidth_gbs: float = attrs.field(validator=_positive)  # effective, as decode sees it
    link_latency_ms: float = attrs.field(validator=_positive)  # one way, this device to the network
    link_bandwidth_mbps: float = attrs.field(validator=_positive)

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise InputError("device field 'name' must be a non-empty string")
        if self.kind not in DEVICE_KINDS:
            raise InputError(f"device {self.name!r}: field 'kind' must be one of {', '.join(DEVICE_KINDS)}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


def device_from_mapping(data: Mapping[str, Any], *, where: str) -> Device:
    """One ``[[device]]`` table; errors name the table and the field."""
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}")
    for key in ("name", "kind", *_NUMBER_FIELDS):
        if key not in data:
            raise InputError(f"{where}: missing field {key!r}")
    name, kind = data["name"], data["kind"]
    if not isinstance(name, str) or not name:
        raise InputError(f"{where}: field 'name' must be a non-empty string")
    where = f"{where} ({name})"
    if kind not in DEVICE_KINDS:
        raise InputError(f"{where}: field 'kind' must be one of {', '.join(DEVICE_KINDS)}, not {kind!r}")
    numbers: dict[str, float] = {}
    for key in _NUMBER_FIELDS:
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InputError(f"{where}: field {key!r} must be a number, not {value!r}")
        numbers[key] = float(value)
    try:
        return Device(name=name, kind=cast(DeviceKind, kind), **numbers)
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None


def devices_from_mapping(data: Mapping[str, Any], *, source: str = "devices") -> tuple[Device, ...]:
    """The parsed form of a devices.toml: a ``device`` array of tables."""
    unknown = sorted(set(data) - {"device"})
    if unknown:
        raise InputError(f"{source}: unknown top-level key {unknown[0]!r} (expected [[device]] tables)")
    tables = data.get("device")
    if not isinstance(tables, list) or not tables:
        raise InputError(f"{source}: no [[device]] tables")
    devices: list[Device] = []
    for i, table in enumerate(tables):
        if not isinstance(table, dict):
            raise InputError(f"{source}: device {i + 1} is not a table")
        devices.append(device_from_mapping(table, where=f"{source}: device {i + 1}"))
    check_unique(devices, source=source)
    return tuple(devices)


def check_unique(devices: Sequence[Device], *, source: str = "devices") -> None:
    seen: set[str] = set()
    for device in devices:
        if device.name in seen:
            raise InputError(f"{source}: device name {device.name!r} appears twice")
        seen.add(device.name)


def load_devices(path: str | Path) -> tuple[Device, ...]:
    """Read and validate a devices.toml."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{path}: cannot read devices file ({exc.strerror or exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML ({exc})") from None
    return devices_from_mapping(data, source=str(path))
