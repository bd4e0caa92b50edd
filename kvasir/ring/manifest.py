"""The static rank manifest (TOML) that describes a ring: the model's identity, the ordered windows, each rank's
address. ``docs/protocol.md`` § Rank manifest gives the format.

```toml
[model]
sha256 = "a5fd…"          # identity of the whole GGUF; every node checks its neighbours against it
layers = 18
name = "gemma-3-270m"     # optional, shown by the API and the TUI
secret = "hex…"           # optional, signs relay edge tokens

[[rank]]
layers = [0, 6]
listen = "127.0.0.1:7100" # where this rank accepts its predecessor (its successor dials the next rank's)
stage = "stage-0.gguf"    # optional: this rank's stage file (else cut from --model)
```
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvasir.errors import InputError, WindowError
from kvasir.util.files import atomic_output


@attrs.frozen
class RankEntry:
    rank: int
    start: int
    end: int
    host: str
    port: int
    stage: str | None = None
    #: "direct" (TCP) or "relay": how this rank's predecessor reaches it.
    link: str = "direct"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@attrs.frozen
class Manifest:
    model_sha256: str
    n_layers: int
    ranks: tuple[RankEntry, ...]
    model_name: str = "model"
    secret: str | None = None
    relay: str | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def successor(self, rank: int) -> RankEntry:
        return self.ranks[(rank + 1) % self.size]

    def predecessor(self, rank: int) -> RankEntry:
        return self.ranks[(rank - 1) % self.size]

    def rank(self, k: int) -> RankEntry:
        if not 0 <= k < self.size:
            raise InputError(f"rank {k} is not in the manifest (ranks 0..{self.size - 1})")
        return self.ranks[k]

    def to_toml(self) -> str:
        lines = ["[model]", f'sha256 = "{self.model_sha256}"', f"layers = {self.n_layers}"]
        lines.append(f'name = "{_escape(self.model_name)}"')
        if self.secret:
            lines.append(f'secret = "{self.secret}"')
        if self.relay:
            lines.append(f'relay = "{_escape(self.relay)}"')
        for r in self.ranks:
            lines += ["", "[[rank]]", f"layers = [{r.start}, {r.end}]", f'listen = "{r.address}"']
            if r.stage:
                lines.append(f'stage = "{_escape(r.stage)}"')
            if r.link != "direct":
                lines.append(f'link = "{r.link}"')
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> None:
        with atomic_output(path) as tmp:
            tmp.write_text(self.to_toml())


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _parse_address(text: Any, where: str) -> tuple[str, int]:
    if not isinstance(text, str) or ":" not in text:
        raise InputError(f"{where}: listen must be 'HOST:PORT', got {text!r}")
    host, _, port = text.rpartition(":")
    try:
        p = int(port)
    except ValueError:
        raise InputError(f"{where}: bad port in {text!r}") from None
    if not 0 < p < 65536:
        raise InputError(f"{where}: port {p} out of range")
    return host.strip("[]"), p


def check_windows(windows: Sequence[tuple[int, int]], n_layers: int) -> None:
    """Windows must be non-empty, contiguous, in order, and cover [0, n_layers) exactly (pure)."""
    if not windows:
        raise WindowError("a ring needs at least one rank")
    expect = 0
    for i, (a, b) in enumerate(windows):
        if a != expect or b <= a:
            raise WindowError(f"rank {i}: window [{a}, {b}) does not continue from layer {expect}")
        expect = b
    if expect != n_layers:
        raise WindowError(f"windows end at layer {expect}, the model has {n_layers}")


def parse_manifest(data: dict[str, Any], where: str = "manifest") -> Manifest:
    model = data.get("model")
    if not isinstance(model, dict):
        raise InputError(f"{where}: missing [model] table")
    sha, layers = model.get("sha256"), model.get("layers")
    if not isinstance(sha, str) or not sha or len(sha) > 128:
        raise InputError(f"{where}: [model] sha256 must be a non-empty string")
    if not isinstance(layers, int) or layers <= 0:
        raise InputError(f"{where}: [model] layers must be a positive integer")
    raw_ranks = data.get("rank")
    if not isinstance(raw_ranks, list) or not raw_ranks:
        raise InputError(f"{where}: needs at least one [[rank]]")
    ranks = []
    for i, r in enumerate(raw_ranks):
        w = f"{where}: rank {i}"
        win = r.get("layers") if isinstance(r, dict) else None
        if not (isinstance(win, list) and len(win) == 2 and all(isinstance(x, int) for x in win)):
            raise InputError(f"{w}: layers must be [start, end]")
        host, port = _parse_address(r.get("listen"), w)
        link = r.get("link", "direct")
        if link not in ("direct", "relay"):
            raise InputError(f"{w}: link must be 'direct' or 'relay'")
        stage = r.get("stage")
        ranks.append(RankEntry(i, win[0], win[1], host, port, stage if isinstance(stage, str) else None, link))
    check_windows([(r.start, r.end) for r in ranks], layers)
    secret = model.get("secret")
    relay = model.get("relay")
    return Manifest(
        model_sha256=sha,
        n_layers=layers,
        ranks=tuple(ranks),
        model_name=str(model.get("name", "model")),
        secret=secret if isinstance(secret, str) else None,
        relay=relay if isinstance(relay, str) else None,
    )


def load_manifest(path: Path) -> Manifest:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"{path}: no such manifest") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: invalid TOML ({exc})") from None
    return parse_manifest(data, str(path))
