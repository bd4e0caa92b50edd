"""Write a stage mini-GGUF: exactly the tensors and metadata one layer window needs (docs/stage-gguf.md).

The rules, in short:

* tensors ``blk.{a+i}.*`` become ``blk.{i}.*``; ``{arch}.block_count`` is the window's length;
* every per-layer metadata array is sliced, and index-derived layer kinds (gemma3 sliding window, qwen35 recurrent
  layers) are written as explicit per-layer arrays so each layer behaves as it did in the whole model;
* a window that is not last gets a stub vocabulary (``tokenizer.ggml.model = "none"``, one zero embedding row) so
  llama.cpp never computes a full-vocabulary head there; the real tokenizer is stashed under ``kvasir.tokenizer.*``
  so every node can still tokenize and detokenize;
* the first window (when it is not also last) carries the real token embedding matrix as a raw block after the
  GGUF data, which the stage engine looks rows up in;
* hybrid (qwen35) windows lacking a layer of one kind get an identity layer of that kind appended: a copy of a real
  layer whose output projections are zero, so its output equals its input.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, cast

import attrs
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from kvasir.core.errors import ModelFileError, WindowError
from kvasir.shard.arch import layer_kinds, rules_for
from kvasir.shard.gguf_file import STAGE_PREFIX, TOKENIZER_STASH_PREFIX, ModelInfo, block_index, describe
from kvasir.shard.gguf_io import (
    KV,
    GGUFFile,
    TensorInfo,
    TensorSource,
    copy_range,
    encode_kv,
    read_gguf,
    write_gguf,
)
from kvasir.util.files import atomic_output

#: Output projections zeroed in an identity layer (zero bytes are zero in every ggml quant type).
_IDENTITY_ZEROED = (
    "attn_output.weight",
    "ssm_out.weight",
    "ffn_down.weight",
    "ffn_down_exps.weight",
    "ffn_down_shexp.weight",
)
_EMBEDDING_ALIGN = 32
U32 = GGUFValueType.UINT32


@attrs.frozen
class StageLayout:
    """The pure decision of what a window's stage file holds (data in, decision out)."""

    arch: str
    start: int
    end: int
    source_layers: int
    #: Source layer index of each layer of the stage file, in order (window, identity pads, MTP layers).
    layer_sources: tuple[int, ...]
    #: Indices into ``layer_sources`` that are identity pads.
    pad_positions: tuple[int, ...]
    first: bool
    last: bool
    #: Per-layer kind flags for the stage's layers (None: all layers alike, no key written).
    kinds: tuple[bool, ...] | None
    #: gemma3 window with only global layers: drop the sliding window, it is a plain-attention model then.
    drop_sliding_window: bool


def check_window(info: ModelInfo, start: int, end: int) -> int:
    """Raise unless [start, end) is a non-empty window of the model's main layers; returns their count."""
    rules_for(info.arch)
    if info.stage_window is not None:
        raise WindowError(f"{info.path} is already a stage file (layers {info.stage_window[0]}:{info.stage_window[1]})")
    n_main = info.n_main
    if not 0 <= start < end <= n_main:
        raise WindowError(f"window {start}:{end} is empty or outside the model's layers 0:{n_main}")
    return n_main


def plan_layout(info: ModelInfo, metadata: dict[str, Any], start: int, end: int) -> StageLayout:
    rules = rules_for(info.arch)
    n_main = check_window(info, start, end)
    kinds_all = layer_kinds(info.arch, metadata, info.n_layer)
    sources = list(range(start, end))
    pads: list[int] = []
    if rules.needs_both_kinds and kinds_all is not None:
        window_kinds = set(kinds_all[start:end])
        if len(window_kinds) == 1:
            missing = not window_kinds.pop()
            donor = min((i for i in range(n_main) if kinds_all[i] == missing), key=lambda i: abs(i - start))
            pads.append(len(sources))
            sources.append(donor)
    last = end == n_main
    if last:
        sources.extend(range(n_main, info.n_layer))  # MTP blocks stay after the main layers
    kinds = tuple(kinds_all[i] if i < n_main else False for i in sources) if kinds_all is not None else None
    drop_swa = info.arch == "gemma3" and kinds is not None and not any(kinds)
    return StageLayout(
        arch=info.arch,
        start=start,
        end=end,
        source_layers=n_main,
        layer_sources=tuple(sources),
        pad_positions=tuple(pads),
        first=start == 0,
        last=last,
        kinds=None if drop_swa else kinds,
        drop_sliding_window=drop_swa,
    )


@attrs.frozen
class SliceResult:
    path: Path
    layout: StageLayout
    stage_bytes: int
    model_bytes: int


def _edited_metadata(gg: GGUFFile, info: ModelInfo, layout: StageLayout, source_sha256: str | None) -> list[KV]:
    arch = info.arch
    rules = rules_for(arch)
    out: list[KV] = []
    for key, kv in gg.kvs.items():
        if key == f"{arch}.block_count":
            kv = encode_kv(key, len(layout.layer_sources), U32)
        elif key == f"{arch}.nextn_predict_layers" and not layout.last:
            kv = encode_kv(key, 0, U32)
        elif key == rules.layer_kind_key or (layout.drop_sliding_window and key == "gemma3.attention.sliding_window"):
            continue  # rewritten below as an explicit per-layer array, or dropped
        elif not layout.last and key == f"{arch}.vocab_size":
            continue
        elif (
            kv.vtype == GGUFValueType.ARRAY
            and kv.sub_type not in (GGUFValueType.STRING, None)
            and key.startswith(f"{arch}.")
            and kv.length == info.n_layer
        ):
            values = gg.get(key)
            assert kv.sub_type is not None
            kv = encode_kv(key, [values[i] for i in layout.layer_sources], kv.vtype, kv.sub_type)
        if not layout.last and key.startswith("tokenizer."):
            kv = kv.renamed(TOKENIZER_STASH_PREFIX + key)
        out.append(kv)
    if not layout.last:
        out.append(encode_kv("tokenizer.ggml.model", "none", GGUFValueType.STRING))
        out.append(encode_kv(f"{arch}.vocab_size", 1, U32))
    if layout.kinds is not None and rules.layer_kind_key is not None:
        out.append(encode_kv(rules.layer_kind_key, list(layout.kinds), GGUFValueType.ARRAY, GGUFValueType.BOOL))
    out += [
        encode_kv(STAGE_PREFIX + "layer_start", layout.start, U32),
        encode_kv(STAGE_PREFIX + "layer_end", layout.end, U32),
        encode_kv(STAGE_PREFIX + "source_layers", layout.source_layers, U32),
        encode_kv(STAGE_PREFIX + "pad_layers", len(layout.pad_positions), U32),
    ]
    if source_sha256:
        out.append(encode_kv(STAGE_PREFIX + "source_sha256", source_sha256, GGUFValueType.STRING))
    return out


def _stage_tensors(gg: GGUFFile, info: ModelInfo, layout: StageLayout) -> tuple[list[TensorSource], TensorInfo | None]:
    """The stage's tensors in file order, and the token embedding to append raw (first, non-last stages)."""
    by_layer: dict[int, list[TensorInfo]] = {}
    outside: dict[str, TensorInfo] = {}
    for t in gg.tensors:
        blk = block_index(t.name)
        if blk is not None:
            by_layer.setdefault(blk[0], []).append(t)
        else:
            outside[t.name] = t
    token_embd = outside.get("token_embd.weight")
    if token_embd is None:
        raise ModelFileError(f"{info.path}: GGUF has no token_embd.weight")

    def copy(t: TensorInfo, name: str, zero: bool = False) -> TensorSource:
        return TensorSource(name, t.shape, t.ggml_type, t.nbytes, None if zero else gg.path, t.offset)

    tensors: list[TensorSource] = []
    for name, t in outside.items():
        if not layout.last and name in ("token_embd.weight", "output.weight"):
            continue
        tensors.append(copy(t, name))
    if not layout.last:
        # Stub vocabulary: llama.cpp wants a token_embd of n_vocab (=1) rows; it is never read.
        tensors.append(TensorSource("token_embd.weight", (info.n_embd, 1), GGMLQuantizationType.F32, 4 * info.n_embd))
    for new_index, src in enumerate(layout.layer_sources):
        identity = new_index in layout.pad_positions
        for t in by_layer.get(src, []):
            blk = block_index(t.name)
            assert blk is not None
            tensors.append(copy(t, f"blk.{new_index}.{blk[1]}", zero=identity and blk[1] in _IDENTITY_ZEROED))
    embedding = token_embd if layout.first and not layout.last else None
    return tensors, embedding


def _layout(gg: GGUFFile, info: ModelInfo, start: int, end: int) -> StageLayout:
    small = {k: gg.get(k) for k, kv in gg.kvs.items() if k.startswith(f"{info.arch}.") and kv.value is not None}
    return plan_layout(info, small, start, end)


def window_ranges(gg: GGUFFile, start: int, end: int) -> list[tuple[int, int]]:
    """The source byte ranges ``(offset, length)`` the stage file of [start, end) copies (pure: header in, ranges
    out), sorted with touching ranges merged. With the header, these are all of the source a slice reads."""
    info = describe(gg.path, gg)
    tensors, embedding = _stage_tensors(gg, info, _layout(gg, info, start, end))
    spans = sorted({(t.offset, t.nbytes) for t in tensors if t.path is not None and t.nbytes})
    if embedding is not None:
        spans = sorted({*spans, (embedding.offset, embedding.nbytes)})
    merged: list[tuple[int, int]] = []
    for off, n in spans:
        if merged and off <= merged[-1][0] + merged[-1][1]:
            last_off, last_n = merged[-1]
            merged[-1] = (last_off, max(last_n, off + n - last_off))
        else:
            merged.append((off, n))
    return merged


def slice_model(
    src: Path,
    start: int,
    end: int,
    out: Path,
    *,
    source_sha256: str | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> SliceResult:
    """The stage file of layers ``[start, end)`` of ``src``; ``progress(done, total)`` as its bytes are written."""
    gg = read_gguf(src)
    info = describe(src, gg)
    layout = _layout(gg, info, start, end)
    kvs = _edited_metadata(gg, info, layout, source_sha256)
    tensors, embedding = _stage_tensors(gg, info, layout)
    if embedding is not None:
        kvs += [
            encode_kv(STAGE_PREFIX + "embedding_type", int(embedding.ggml_type), U32),
            encode_kv(STAGE_PREFIX + "embedding_rows", int(embedding.shape[1]), U32),
            encode_kv(STAGE_PREFIX + "embedding_bytes", int(embedding.nbytes), GGUFValueType.UINT64),
        ]
    with atomic_output(out) as tmp:
        with tmp.open("wb") as fh:
            total = sum(t.nbytes for t in tensors) + (embedding.nbytes if embedding is not None else 0)
            w = cast(BinaryIO, _Reporting(fh, total, progress)) if progress else fh
            write_gguf(w, kvs, tensors)
            if embedding is not None:
                w.write(b"\0" * ((-w.tell()) % _EMBEDDING_ALIGN))
                copy_range(gg.path, embedding.offset, embedding.nbytes, w)
        stage_bytes = tmp.stat().st_size
    return SliceResult(path=out, layout=layout, stage_bytes=stage_bytes, model_bytes=info.file_bytes)


class _Reporting:
    """The parts of a binary file ``write_gguf`` uses, reporting the bytes written so far (header included, so
    ``done`` is capped at ``total``, the payload)."""

    def __init__(self, fh: BinaryIO, total: int, progress: Callable[[int, int], None]) -> None:
        self.fh, self.total, self.progress = fh, total, progress

    def write(self, data: bytes) -> int:
        n = self.fh.write(data)
        self.progress(min(self.fh.tell(), self.total), self.total)
        return n

    def tell(self) -> int:
        return self.fh.tell()


def read_embedding_block(gg: GGUFFile) -> tuple[np.ndarray[Any, Any], GGMLQuantizationType]:
    """Memory-map the raw token-embedding block a first stage carries: (rows of raw bytes, quant type)."""
    nbytes = gg.get(STAGE_PREFIX + "embedding_bytes")
    qtype = gg.get(STAGE_PREFIX + "embedding_type")
    rows = gg.get(STAGE_PREFIX + "embedding_rows")
    if nbytes is None or qtype is None or not rows:
        raise ModelFileError(f"{gg.path}: first-stage file lacks its token embedding block")
    if nbytes > gg.file_size or nbytes % rows:
        raise ModelFileError(f"{gg.path}: token embedding block is truncated or inconsistent")
    block = np.memmap(gg.path, dtype=np.uint8, mode="r", offset=gg.file_size - nbytes, shape=(rows, nbytes // rows))
    return block, GGMLQuantizationType(qtype)
