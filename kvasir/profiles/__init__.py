"""Shipped layer profiles (``*.toml`` next to this file), so a plan needs no weights.

A profile's file name is its name: ``qwen3.5-122b-a10b.toml`` is ``qwen3.5-122b-a10b``. The format is
:func:`kvasir.planner.profile.profile_from_mapping`'s (docs/planner.md).
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

from kvasir.core.errors import InputError
from kvasir.planner.profile import ModelProfile, profile_from_gguf, profile_from_mapping

_SUFFIX = ".toml"


def shipped_profiles() -> tuple[str, ...]:
    """Names of the profiles that ship with Kvasir."""
    root = resources.files(__name__)
    return tuple(sorted(p.name[: -len(_SUFFIX)] for p in root.iterdir() if p.name.endswith(_SUFFIX)))


def load_profile_file(path: str | Path) -> ModelProfile:
    """A profile TOML file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"{path}: cannot read profile ({exc.strerror or exc})") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not valid TOML ({exc})") from None
    return profile_from_mapping(data, source=str(path))


def load_profile(name: str) -> ModelProfile:
    """A shipped profile by name."""
    if name not in shipped_profiles():
        raise InputError(f"no shipped profile {name!r} (shipped: {', '.join(shipped_profiles()) or 'none'})")
    text = resources.files(__name__).joinpath(name + _SUFFIX).read_text(encoding="utf-8")
    return profile_from_mapping(tomllib.loads(text), source=f"profile {name}")


def resolve_model(spec: str) -> ModelProfile:
    """``--model``: a GGUF file, a profile TOML file, or the name of a shipped profile."""
    path = Path(spec)
    if path.suffix == ".gguf" or (path.is_file() and _is_gguf(path)):
        return profile_from_gguf(path)
    if path.is_file():
        return load_profile_file(path)
    if spec in shipped_profiles():
        return load_profile(spec)
    raise InputError(
        f"model {spec!r} is neither a file nor a shipped profile (shipped: {', '.join(shipped_profiles())})"
    )


def _is_gguf(path: Path) -> bool:
    with path.open("rb") as f:
        return f.read(4) == b"GGUF"
