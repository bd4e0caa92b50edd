"""The user's configuration: ``config.toml`` in the per-user config directory, environment variables and flags.

Each setting has one effective value and the source it came from, the later winning: ``default`` < ``file`` <
``env`` < ``flag``. The file (``$KVASIR_CONFIG``, else ``~/.config/kvasir/config.toml`` on Linux) holds flat keys::

    identity = "~/keys/node.pem"        # KVASIR_IDENTITY      --identity
    market = "https://market.example"   # KVASIR_MARKET        --market
    relay = "wss://relay.example"       # KVASIR_RELAY         --relay
    memory_budget = "4GiB"              # KVASIR_MEMORY_BUDGET --memory-budget
    threads = 4                         # KVASIR_THREADS       --threads
    gpu_layers = 0                      # KVASIR_GPU_LAYERS    --gpu-layers (the backend: 0 CPU, -1 all on the GPU)
    api_key_file = "api-keys"           # KVASIR_API_KEY_FILE  --api-key-file
    market_ca = "market-ca.pem"         # KVASIR_MARKET_CA     --market-ca (CAs trusted besides the system's)

A relative path in the file is relative to the file's directory, in the environment to the working directory; ``~``
expands in both. The file is read through the schema layer: a wrong type or an unknown key is one error line that
names the key. Nothing is read at import.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from kvasir.core.errors import InputError
from kvasir.core.identity import IDENTITY_FILE
from kvasir.core.schema import FieldError, register_record, structure
from kvasir.core.validators import at_least
from kvasir.util.dirs import config_dir, data_dir

Source = Literal["default", "file", "env", "flag"]
CONFIG_ENV = "KVASIR_CONFIG"

_SIZE = re.compile(r"^\s*(\d+(\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def _check_size(_: object, a: attrs.Attribute[Any], value: str | None) -> None:
    # The spellings `kvasir node --memory-budget` takes (4GiB, 512MB, 300k, 1000), checked here so that a bad file
    # fails when it is read, not when a node enrolls.
    if value is None:
        return
    m = _SIZE.match(value)
    if m is None or float(m.group(1)) <= 0:
        raise FieldError(a.name, f"{value!r} is not a size (e.g. 4GiB, 512MB)")


def _check_url(*schemes: str) -> Callable[[object, attrs.Attribute[Any], str | None], None]:
    def check(_: object, a: attrs.Attribute[Any], value: str | None) -> None:
        if value is not None and not value.startswith(tuple(f"{s}://" for s in schemes)):
            raise FieldError(a.name, f"{value!r} must start with {' or '.join(f'{s}://' for s in schemes)}")

    return check


@attrs.frozen
class ConfigFile:
    """The TOML file's shape: every key optional, none other allowed."""

    identity: str | None = None
    market: str | None = attrs.field(default=None, validator=_check_url("http", "https"))
    relay: str | None = attrs.field(default=None, validator=_check_url("ws", "wss"))
    memory_budget: str | None = attrs.field(default=None, validator=_check_size)
    threads: int | None = attrs.field(default=None, validator=at_least(1, optional=True))
    gpu_layers: int | None = attrs.field(default=None, validator=at_least(-1, optional=True))
    api_key_file: str | None = None
    market_ca: str | None = None


register_record(ConfigFile, forbid_extra=True)

#: Settings that are paths (relative ones resolved against the file's directory or the working directory).
PATH_KEYS = frozenset({"identity", "api_key_file", "market_ca"})
INT_KEYS = frozenset({"threads", "gpu_layers"})
#: Values used when nothing sets a key. None: the command's own rule (a key made on first use, no relay, threads
#: shared among co-located nodes, an API open to anyone on loopback).
DEFAULTS: dict[str, object] = {
    "identity": None,
    "market": None,
    "relay": None,
    "memory_budget": "4GiB",
    "threads": None,
    "gpu_layers": 0,
    "api_key_file": None,
    "market_ca": None,
}
KEYS = tuple(DEFAULTS)


def env_name(key: str) -> str:
    return f"KVASIR_{key.upper()}"


def flag_name(key: str) -> str:
    return "--" + key.replace("_", "-")


@attrs.frozen
class Setting:
    key: str
    value: object
    source: Source


@attrs.frozen
class Config:
    """The effective settings (every key of :data:`KEYS`) and the file they were read from."""

    path: Path
    file_found: bool
    settings: Mapping[str, Setting]

    def __getitem__(self, key: str) -> object:
        return self.settings[key].value

    def source(self, key: str) -> Source:
        return self.settings[key].source


def default_identity_path() -> Path:
    """Where a node's key lives when nothing names one (Linux: ~/.local/share/kvasir/identity.pem)."""
    return data_dir() / IDENTITY_FILE


def config_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$KVASIR_CONFIG``, else ``config.toml`` in the per-user config directory."""
    env = (os.environ if environ is None else environ).get(CONFIG_ENV)
    return Path(env).expanduser() if env else config_dir() / "config.toml"


def read_file(path: Path, *, required: bool) -> ConfigFile | None:
    """The file's settings; None when it does not exist and ``required`` is false (the default location)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if required:
            raise InputError(f"{path}: no such configuration file (named by ${CONFIG_ENV})") from None
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not TOML ({exc})") from None
    return structure(data, ConfigFile, where=str(path))


def _from_env(key: str, text: str) -> object:
    name = env_name(key)
    value: object = text
    if key in INT_KEYS:
        try:
            value = int(text)
        except ValueError:
            raise InputError(f"${name}: must be an integer, not {text!r}") from None
    structure({key: value}, ConfigFile, where=f"${name}")  # the file's rules, the error naming the variable
    return Path(text).expanduser() if key in PATH_KEYS else value


def load_config(flags: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """The effective settings: defaults, then the file, then ``KVASIR_*`` variables, then ``flags`` (key -> value;
    None means the flag was not given)."""
    environ = os.environ if environ is None else environ
    path = config_path(environ)
    found = read_file(path, required=bool(environ.get(CONFIG_ENV)))
    settings = {key: Setting(key, value, "default") for key, value in DEFAULTS.items()}
    if found is not None:
        for key in KEYS:
            value = getattr(found, key)
            if value is not None:
                if key in PATH_KEYS:
                    value = path.parent / Path(value).expanduser()
                settings[key] = Setting(key, value, "file")
    for key in KEYS:
        text = environ.get(env_name(key))
        if text:
            settings[key] = Setting(key, _from_env(key, text), "env")
    for key, value in (flags or {}).items():
        if value is not None:
            settings[key] = Setting(key, value, "flag")
    return Config(path, found is not None, settings)


def without_config(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` for a child ``kvasir`` whose every setting its parent passes as a flag (``ring up``'s nodes): no
    ``KVASIR_*`` setting and an empty file, so a user's relay or identity cannot slip into a local ring."""
    env = {name: value for name, value in environ.items() if name not in {env_name(key) for key in KEYS}}
    env[CONFIG_ENV] = os.devnull
    return env
