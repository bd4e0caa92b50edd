"""Per-architecture window rules: which layers are of which kind, and how token embeddings are scaled.

llama.cpp derives some per-layer behaviour from a layer's *index* (gemma3's sliding-window period, qwen35's
full-attention interval). A window renumbers its layers from zero, so a stage file must carry the behaviour of each
layer explicitly; these rules compute it from the whole model's metadata. All functions here are pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvasir.core.errors import UnsupportedArchitecture


@attrs.frozen
class ArchRules:
    """What slicing and the stage engine must know about one architecture."""

    name: str
    #: gemma multiplies token embeddings (never hidden-state input) by sqrt(n_embd).
    scales_token_embedding: bool = False
    #: Metadata key holding a per-layer bool array that replaces an index-derived pattern, if any.
    layer_kind_key: str | None = None
    #: llama.cpp needs at least one layer of each kind in a window (hybrid memory of qwen35).
    needs_both_kinds: bool = False
    #: Positions per token in an embedding batch (IMROPE archs read 4).
    positions_per_token: int = 1


SUPPORTED: Mapping[str, ArchRules] = {
    "llama": ArchRules("llama"),
    "qwen2": ArchRules("qwen2"),
    "qwen3": ArchRules("qwen3"),
    "gemma3": ArchRules(
        "gemma3", scales_token_embedding=True, layer_kind_key="gemma3.attention.sliding_window_pattern"
    ),
    "qwen35": ArchRules(
        "qwen35",
        layer_kind_key="qwen35.attention.recurrent_layers",
        needs_both_kinds=True,
        positions_per_token=4,
    ),
    "qwen35moe": ArchRules(
        "qwen35moe",
        layer_kind_key="qwen35moe.attention.recurrent_layers",
        needs_both_kinds=True,
        positions_per_token=4,
    ),
}


def rules_for(arch: str) -> ArchRules:
    try:
        return SUPPORTED[arch]
    except KeyError:
        raise UnsupportedArchitecture(
            f"unsupported architecture {arch!r} (supported: {', '.join(sorted(SUPPORTED))})"
        ) from None


def layer_kinds(arch: str, metadata: Mapping[str, Any], n_layer: int) -> list[bool] | None:
    """Per-layer kind flags of the whole model, or None when all layers are alike.

    gemma3: True = sliding-window layer. qwen35/qwen35moe: True = recurrent (gated delta net) layer.
    """
    rules = rules_for(arch)
    if rules.layer_kind_key is None:
        return None
    explicit = metadata.get(rules.layer_kind_key)
    if isinstance(explicit, Sequence) and not isinstance(explicit, str):
        return [bool(v) for v in explicit[:n_layer]]
    if arch == "gemma3":
        if int(metadata.get("gemma3.attention.sliding_window", 0) or 0) <= 0:
            return None
        period = int(explicit) if explicit is not None else 6
        # llama.cpp's set_swa_pattern(period, dense_first=false): the last layer of each period is global.
        return [period == 0 or (il % period < period - 1) for il in range(n_layer)]
    # qwen35 family: full attention every `interval`-th layer, recurrent otherwise.
    interval = int(metadata.get(f"{arch}.full_attention_interval", 4))
    return [(il + 1) % interval != 0 for il in range(n_layer)]
