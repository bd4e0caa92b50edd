"""Open a GGUF file and describe it: the facts ``inspect``, ``slice`` and the planner need.

Every failure to read becomes a :class:`~kvasir.core.errors.ModelFileError` with one line that names the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import attrs

from kvasir.core.errors import ModelFileError
from kvasir.shard.arch import SUPPORTED
from kvasir.shard.gguf_io import GGUFFile, read_gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

#: More layers than any model has: a larger block count is a corrupt file, not a huge per-layer table.
MAX_LAYERS = 1 << 16

#: Metadata namespace Kvasir adds to stage files.
STAGE_PREFIX = "kvasir.stage."
#: Where a stage file with a stub vocabulary keeps the model's real tokenizer.
TOKENIZER_STASH_PREFIX = "kvasir."


def block_index(tensor_name: str) -> tuple[int, str] | None:
    """``blk.12.attn_q.weight`` → ``(12, "attn_q.weight")``; None for tensors outside the blocks."""
    m = _BLOCK.match(tensor_name)
    return (int(m.group(1)), m.group(2)) if m else None


@attrs.frozen
class ModelInfo:
    """What a GGUF holds, as ``kvasir inspect`` reports it."""

    path: str
    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    file_bytes: int
    layer_bytes: tuple[int, ...]
    outside_bytes: int
    supported: bool
    #: Set when the file is a Kvasir stage file: the window [start, end) of the source model.
    stage_window: tuple[int, int] | None
    source_layers: int | None
    nextn_layers: int = 0

    @property
    def n_main(self) -> int:
        """Layers of the main stack, the ones windows cover: the trailing nextn (MTP) blocks are not among them."""
        return self.n_layer - self.nextn_layers

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "architecture": self.arch,
            "layers": self.n_layer,
            "hidden_size": self.n_embd,
            "vocab_size": self.n_vocab,
            "file_bytes": self.file_bytes,
            "bytes_per_layer": list(self.layer_bytes),
            "bytes_outside_layers": self.outside_bytes,
            "windows_supported": self.supported,
            "stage_window": list(self.stage_window) if self.stage_window else None,
            "source_layers": self.source_layers,
            "nextn_layers": self.nextn_layers,
        }


def describe(path: Path, gg: GGUFFile | None = None) -> ModelInfo:
    gg = gg if gg is not None else read_gguf(path)
    arch = gg.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: GGUF has no general.architecture")
    n_layer = gg.get_int(f"{arch}.block_count", 0, high=MAX_LAYERS)
    n_embd = gg.get_int(f"{arch}.embedding_length", 0)
    if n_layer <= 0 or n_embd <= 0:
        raise ModelFileError(f"{path}: GGUF lacks a valid {arch}.block_count or {arch}.embedding_length")
    nextn = gg.get_int(f"{arch}.nextn_predict_layers", 0, high=n_layer - 1)
    per_layer = [0] * n_layer
    outside = 0
    for t in gg.tensors:
        blk = block_index(t.name)
        if blk is not None and blk[0] < n_layer:
            per_layer[blk[0]] += t.nbytes
        else:
            outside += t.nbytes
    tokens = gg.kvs.get("tokenizer.ggml.tokens") or gg.kvs.get(TOKENIZER_STASH_PREFIX + "tokenizer.ggml.tokens")
    window = None
    if gg.get(STAGE_PREFIX + "layer_start") is not None and gg.get(STAGE_PREFIX + "layer_end") is not None:
        start = gg.get_int(STAGE_PREFIX + "layer_start", 0, high=MAX_LAYERS)
        window = (start, gg.get_int(STAGE_PREFIX + "layer_end", 0, low=start + 1, high=MAX_LAYERS))
    source = gg.get(STAGE_PREFIX + "source_layers")
    return ModelInfo(
        path=str(path),
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=tokens.length if tokens is not None else 0,
        file_bytes=gg.file_size,
        layer_bytes=tuple(per_layer),
        outside_bytes=outside,
        supported=arch in SUPPORTED,
        stage_window=window,
        source_layers=None if source is None else gg.get_int(STAGE_PREFIX + "source_layers", 0, low=1, high=MAX_LAYERS),
        nextn_layers=nextn,
    )
