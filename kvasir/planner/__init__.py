"""Planner: split a model's layers into contiguous windows over a ring of devices (docs/planner.md)."""

from kvasir.planner.devices import DEVICE_KINDS, Device, DeviceKind, load_devices
from kvasir.planner.estimate import (
    DEFAULT_N_CTX,
    RankManifest,
    RankWindow,
    UnusedDevice,
    WindowCost,
    estimate,
    window_cost,
)
from kvasir.planner.profile import LayerProfile, ModelProfile, profile_from_gguf, profile_from_mapping
from kvasir.planner.rules import allowed_boundaries, padding_layers
from kvasir.planner.solve import plan

__all__ = [
    "DEFAULT_N_CTX",
    "DEVICE_KINDS",
    "Device",
    "DeviceKind",
    "LayerProfile",
    "ModelProfile",
    "RankManifest",
    "RankWindow",
    "UnusedDevice",
    "WindowCost",
    "allowed_boundaries",
    "estimate",
    "load_devices",
    "padding_layers",
    "plan",
    "profile_from_gguf",
    "profile_from_mapping",
    "window_cost",
]
