"""Devices a ring can be built from, and the ``devices.toml`` that lists them."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from kvasir.core.errors import InputError
from kvasir.core.identity import PublicKey
from kvasir.core.schema import FieldError, register_record, structure
from kvasir.core.validators import at_least, one_of, positive

DeviceKind = Literal["gpu", "cpu", "npu", "phone"]
DEVICE_KINDS: tuple[DeviceKind, ...] = ("gpu", "cpu", "npu", "phone")

# Units: memory in GB (1e9 bytes), memory bandwidth in GB/s, link latency in ms (one way, device to network),
# link bandwidth in Mbit/s (1e6 bits/s).

#: What a node adds to each frame it receives, ms: waking to it, handing it to the stage's worker thread and back,
#: encoding and sending the result on. Measured 0.9-1.4 ms per hop on the 2-vCPU test VM (docs/benchmarks.md, § The
#: ring on loopback); a faster CPU pays less, and ``hop_overhead_ms`` in devices.toml says so per device.
DEFAULT_HOP_OVERHEAD_MS = 1.0


def _name(_: object, __: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise FieldError("name", "must be a non-empty string")


def _key(_: object, __: attrs.Attribute[str | None], value: str | None) -> None:
    if value is None:
        return
    try:
        PublicKey.from_text(value)
    except InputError as exc:
        raise FieldError("key", str(exc)) from None


@attrs.frozen
class Device:
    """One machine that can run a window: its memory budget, memory bandwidth and network link."""

    name: str = attrs.field(validator=_name)
    kind: DeviceKind = attrs.field(validator=one_of(*DEVICE_KINDS))
    memory_gb: float = attrs.field(validator=positive())  # what Kvasir may use, not the RAM on the box
    mem_bandwidth_gbs: float = attrs.field(validator=positive())  # effective, as decode sees it
    link_latency_ms: float = attrs.field(validator=positive(zero=True))  # one way; 0: the same host
    link_bandwidth_mbps: float = attrs.field(validator=positive())
    #: The device's node key (`kvasir id`), copied into the manifest's rank; None leaves the slot to fill.
    key: str | None = attrs.field(default=None, validator=_key)
    #: What this device's node adds to each frame it receives (DEFAULT_HOP_OVERHEAD_MS).
    hop_overhead_ms: float = attrs.field(default=DEFAULT_HOP_OVERHEAD_MS, validator=at_least(0))

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


@attrs.frozen
class _DevicesFile:
    """A devices.toml: ``[[device]]`` tables and nothing else."""

    device: tuple[Device, ...] = attrs.field(validator=attrs.validators.min_len(1))


register_record(Device, forbid_extra=True)
register_record(_DevicesFile, forbid_extra=True)


def device_from_mapping(data: Mapping[str, Any], *, where: str) -> Device:
    """One ``[[device]]`` table; errors name the table and the field."""
    return structure(data, Device, where=where)


def devices_from_mapping(data: Mapping[str, Any], *, source: str = "devices") -> tuple[Device, ...]:
    """The parsed form of a devices.toml: a ``device`` array of tables."""
    if not data.get("device"):
        raise InputError(f"{source}: no [[device]] tables")
    devices = structure(data, _DevicesFile, where=source).device
    check_unique(devices, source=source)
    return devices


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
