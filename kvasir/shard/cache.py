"""Where derived files live: stage files cut from a local model, and the model's identity hash.

Keyed by the model's absolute path, size and mtime, so an edited model is never served from a stale cut.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from pathlib import Path

from kvasir.core.errors import WindowError
from kvasir.shard.gguf_file import describe
from kvasir.shard.slice import slice_model
from kvasir.util.dirs import cache_dir
from kvasir.util.files import atomic_output
from kvasir.util.progress import byte_bar


def default_cache_dir() -> Path:
    """``$KVASIR_CACHE`` or the user cache directory, ``~/.cache/kvasir`` on Linux (read when called)."""
    return cache_dir()


def _model_dir(model: Path, cache_dir: Path) -> Path:
    st = model.stat()
    key = hashlib.sha256(f"{model.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    d = cache_dir / "models" / key
    d.mkdir(parents=True, exist_ok=True)
    return d


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def model_sha256(model: Path, cache_dir: Path) -> str:
    """sha256 of the whole GGUF (the model's identity in a ring), computed once per file version."""
    marker = _model_dir(model, cache_dir) / "sha256"
    if marker.exists():
        return marker.read_text().strip()
    digest = file_sha256(model)
    with atomic_output(marker) as tmp:
        tmp.write_text(digest)
    return digest


def parse_splits(text: str, n_layer: int) -> list[tuple[int, int]]:
    """``"0,6,12,18"`` (or just the inner cuts ``"6,12"``) → ``[(0, 6), (6, 12), (12, 18)]``."""
    try:
        cuts = [int(p) for p in text.replace(" ", "").split(",") if p != ""]
    except ValueError:
        raise WindowError(f"--splits {text!r}: expected comma-separated layer indices") from None
    if not cuts or cuts[0] != 0:
        cuts.insert(0, 0)
    if cuts[-1] != n_layer:
        cuts.append(n_layer)
    if any(b <= a for a, b in itertools.pairwise(cuts)) or cuts[-1] > n_layer or cuts[0] < 0:
        raise WindowError(f"--splits {text!r}: cuts must increase strictly within 0..{n_layer}")
    return list(itertools.pairwise(cuts))


def even_splits(n_layer: int, n_stages: int) -> list[tuple[int, int]]:
    if not 1 <= n_stages <= n_layer:
        raise WindowError(f"cannot split {n_layer} layers into {n_stages} stages")
    cuts = [round(i * n_layer / n_stages) for i in range(n_stages + 1)]
    return list(itertools.pairwise(cuts))


def stage_files(model: Path, windows: Sequence[tuple[int, int]], cache_dir: Path) -> list[Path]:
    """Stage files for ``windows`` of ``model``, cut once and reused."""
    info = describe(model)
    n_main = info.n_main
    if list(windows) == [(0, n_main)]:
        return [model]  # one stage: the whole model file as it is
    sha = model_sha256(model, cache_dir)
    d = _model_dir(model, cache_dir)
    out = []
    for a, b in windows:
        path = d / f"layers-{a}-{b}.gguf"
        if not path.exists():
            with byte_bar(f"cutting layers {a}:{b}") as progress:  # a bar on a terminal only
                slice_model(model, a, b, path, source_sha256=sha, progress=progress)
        out.append(path)
    return out
