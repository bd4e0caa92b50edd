"""Layer profiles: what the planner needs to know about a model, without its weights.

A :class:`ModelProfile` holds per-layer byte counts (what a window must hold in memory), per-layer *active*
bytes (what one decoded token reads: all of a dense layer, the shared part plus ``used/count`` of the experts
of an MoE layer), the layer kinds that hybrid architectures care about, and the tensors outside the layers. It
is built from a GGUF file's metadata and tensor table (:func:`profile_from_gguf`, which reads no tensor data)
or from a profile mapping (:func:`profile_from_mapping`, the TOML format of ``kvasir/profiles/*.toml``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

from kvasir.core.errors import InputError, ModelFileError
from kvasir.core.schema import FieldError, register_record, structure, unstructure
from kvasir.shard.gguf_file import MAX_LAYERS
from kvasir.shard.gguf_io import GGUFFile, read_gguf

LayerKind = Literal["attention", "recurrent"]
LAYER_KINDS: tuple[LayerKind, ...] = ("attention", "recurrent")

# f16 K and V cache entries: the llama.cpp default.
_KV_ELEMENT_BYTES = 2
# Recurrent (SSM / delta-net) states are kept in f32.
_STATE_ELEMENT_BYTES = 4

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@attrs.frozen
class LayerProfile:
    """One transformer block (``blk.N.*``)."""

    bytes: int  # all tensors of the block, as stored
    active_bytes: int  # bytes one decoded token reads (== bytes for dense layers)
    kind: LayerKind = "attention"
    kv_bytes_per_token: int = 0  # K+V cache per token of context (attention layers)
    state_bytes: int = 0  # fixed recurrent state per sequence (recurrent layers)

    def __attrs_post_init__(self) -> None:
        if self.bytes < 0 or self.active_bytes < 0 or self.kv_bytes_per_token < 0 or self.state_bytes < 0:
            raise InputError("layer byte counts must be >= 0")
        if self.kind not in LAYER_KINDS:
            raise InputError(f"layer kind must be one of {', '.join(LAYER_KINDS)}, not {self.kind!r}")


@attrs.frozen
class ModelProfile:
    """Everything the planner needs about one model."""

    name: str
    arch: str
    n_embd: int
    vocab_size: int
    layers: tuple[LayerProfile, ...]
    embd_bytes: int  # token_embd: held by rank 0 (row lookup, ~free per token)
    head_bytes: int  # output head (token_embd again when tied): held and read by the last rank
    other_bytes: int = 0  # output_norm and other small non-block tensors: every stage file keeps them
    tied_head: bool = False  # no output.weight: the last rank's head is token_embd

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise InputError(f"model {self.name!r} has no layers")
        if self.n_embd <= 0:
            raise InputError(f"model {self.name!r}: n_embd must be > 0")
        if min(self.embd_bytes, self.head_bytes, self.other_bytes, self.vocab_size) < 0:
            raise InputError(f"model {self.name!r}: byte counts must be >= 0")

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_bytes(self) -> int:
        return sum(layer.bytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        """Weights in one file: layers plus the tensors outside them (a tied head is counted once)."""
        head = 0 if self.tied_head else self.head_bytes
        return self.layer_bytes + self.embd_bytes + head + self.other_bytes


# ---------------------------------------------------------------------------------------- mapping (TOML) form


def _non_negative(_: object, attribute: attrs.Attribute[Any], value: int | tuple[int, ...] | None) -> None:
    values = value if isinstance(value, tuple) else () if value is None else (value,)
    if any(v < 0 for v in values):
        raise FieldError(attribute.name, "must be non-negative")


def _non_empty(_: object, attribute: attrs.Attribute[Any], value: str | tuple[int, ...]) -> None:
    if not value:
        raise FieldError(attribute.name, "must not be empty")


@attrs.frozen
class _ProfileFile:
    """The TOML form of a profile (``kvasir/profiles/*.toml``): per-layer lists, each as long as ``layer_bytes``."""

    name: str = attrs.field(validator=_non_empty)
    arch: str = attrs.field(validator=_non_empty)
    n_embd: int = attrs.field(validator=_non_negative)
    embd_bytes: int = attrs.field(validator=_non_negative)
    head_bytes: int = attrs.field(validator=_non_negative)
    layer_bytes: tuple[int, ...] = attrs.field(validator=[_non_empty, _non_negative])
    vocab_size: int = attrs.field(default=0, validator=_non_negative)
    other_bytes: int = attrs.field(default=0, validator=_non_negative)
    tied_head: bool = False
    layer_active_bytes: tuple[int, ...] | None = attrs.field(default=None, validator=_non_negative)
    layer_kinds: tuple[LayerKind, ...] | None = None
    layer_kv_bytes_per_token: tuple[int, ...] | None = attrs.field(default=None, validator=_non_negative)
    layer_state_bytes: tuple[int, ...] | None = attrs.field(default=None, validator=_non_negative)
    description: str | None = None

    def __attrs_post_init__(self) -> None:
        n = len(self.layer_bytes)
        for key in ("layer_active_bytes", "layer_kinds", "layer_kv_bytes_per_token", "layer_state_bytes"):
            value = getattr(self, key)
            if value is not None and len(value) != n:
                raise FieldError(key, f"must list {n} values, one per layer")

    def profile(self) -> ModelProfile:
        n = len(self.layer_bytes)
        active = self.layer_active_bytes or self.layer_bytes
        attention: LayerKind = "attention"
        kinds = self.layer_kinds or (attention,) * n
        kv = self.layer_kv_bytes_per_token or (0,) * n
        state = self.layer_state_bytes or (0,) * n
        return ModelProfile(
            name=self.name,
            arch=self.arch,
            n_embd=self.n_embd,
            vocab_size=self.vocab_size,
            layers=tuple(
                LayerProfile(bytes=s, active_bytes=a, kind=k, kv_bytes_per_token=c, state_bytes=t)
                for s, a, k, c, t in zip(self.layer_bytes, active, kinds, kv, state, strict=True)
            ),
            embd_bytes=self.embd_bytes,
            head_bytes=self.head_bytes,
            other_bytes=self.other_bytes,
            tied_head=self.tied_head,
        )


register_record(
    _ProfileFile,
    forbid_extra=True,
    omit_if_none=("description",),
    key_order=("name", "arch", "n_embd", "vocab_size", "embd_bytes", "head_bytes", "other_bytes", "tied_head"),
)


def profile_from_mapping(data: Mapping[str, Any], *, source: str = "profile") -> ModelProfile:
    """Build a profile from its mapping form (a parsed profile TOML); errors name the field."""
    shape = structure(data, _ProfileFile, where=source)
    try:
        return shape.profile()
    except InputError as exc:
        raise InputError(f"{source}: {exc}") from None


def profile_to_mapping(profile: ModelProfile) -> dict[str, Any]:
    """The inverse of :func:`profile_from_mapping` (e.g. to save a GGUF's profile as TOML)."""
    layers = profile.layers
    shape = _ProfileFile(
        name=profile.name,
        arch=profile.arch,
        n_embd=profile.n_embd,
        embd_bytes=profile.embd_bytes,
        head_bytes=profile.head_bytes,
        layer_bytes=tuple(layer.bytes for layer in layers),
        vocab_size=profile.vocab_size,
        other_bytes=profile.other_bytes,
        tied_head=profile.tied_head,
        layer_active_bytes=tuple(layer.active_bytes for layer in layers),
        layer_kinds=tuple(layer.kind for layer in layers),
        layer_kv_bytes_per_token=tuple(layer.kv_bytes_per_token for layer in layers),
        layer_state_bytes=tuple(layer.state_bytes for layer in layers),
    )
    out: dict[str, Any] = unstructure(shape)
    return out


# -------------------------------------------------------------------------------------------------- GGUF form


def _split_parts(path: Path) -> list[Path]:
    """All files of a split GGUF (``name-00001-of-00003.gguf``), or just ``path``."""
    match = _SPLIT_RE.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise ModelFileError(f"{path}: split GGUF is missing part {missing[0]}")
    return parts


def _field(gg: GGUFFile, key: str) -> Any:
    """A metadata value (scalar, string or list), or None when absent."""
    return gg.get(key)


def _per_layer(gg: GGUFFile, key: str, n: int, default: int) -> list[int]:
    """Metadata that may be one number or a per-layer array (of non-negative integers: else a corrupt file)."""
    value = gg.get(key)
    if not isinstance(value, list):
        return [gg.get_int(key, default)] * n
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ModelFileError(f"{gg.path}: GGUF {key} holds a value that is not a non-negative integer")
    padded = [int(v) for v in value][:n]
    return padded + [default] * (n - len(padded))


def profile_from_gguf(path: str | Path, *, name: str | None = None) -> ModelProfile:
    """Build a profile from a GGUF file's metadata and tensor table (no tensor data is read).

    Bytes per layer are the sizes of the ``blk.N.*`` tensors; tensors named ``*_exps*`` are MoE experts, of
    which a token reads ``expert_used_count / expert_count``. A block holding ``ssm_*`` tensors is recurrent,
    any other is attention. KV bytes per token follow ``{arch}.attention.head_count_kv`` and
    ``key_length``/``value_length`` (f16 cache); recurrent state follows the ``{arch}.ssm.*`` sizes (f32
    state).
    """
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file")
    readers = [read_gguf(part) for part in _split_parts(path)]  # header only: no tensor data is read
    meta = readers[0]
    arch = _field(meta, "general.architecture")
    if not isinstance(arch, str):
        raise ModelFileError(f"{path}: GGUF has no general.architecture")

    block_bytes: dict[int, int] = {}
    active_bytes: dict[int, int] = {}
    recurrent: set[int] = set()
    embd_bytes = head_bytes = other_bytes = 0
    vocab_rows = 0
    n_expert = meta.get_int(f"{arch}.expert_count", 0)
    n_used = min(meta.get_int(f"{arch}.expert_used_count", 0) or n_expert, n_expert)
    for reader in readers:
        for tensor in reader.tensors:
            size = tensor.nbytes
            block = _BLOCK_RE.match(tensor.name)
            if block is None:
                if tensor.name == "token_embd.weight":
                    embd_bytes += size
                    vocab_rows = int(tensor.shape[-1]) if len(tensor.shape) > 1 else vocab_rows
                elif tensor.name == "output.weight":
                    head_bytes += size
                else:
                    other_bytes += size
                continue
            index = int(block[1])
            block_bytes[index] = block_bytes.get(index, 0) + size
            # MoE: one token reads only the routed experts' slices of a stacked expert tensor.
            is_experts = "_exps" in tensor.name and n_expert > 0
            active = size * n_used // n_expert if is_experts else size
            active_bytes[index] = active_bytes.get(index, 0) + active
            if tensor.name.startswith(f"blk.{index}.ssm_"):
                recurrent.add(index)

    n_layers = meta.get_int(f"{arch}.block_count", max(block_bytes, default=-1) + 1, high=MAX_LAYERS)
    if n_layers <= 0:
        raise ModelFileError(f"{path}: GGUF has no layers (blk.N.* tensors)")
    n_embd = meta.get_int(f"{arch}.embedding_length", 0)
    if n_embd <= 0:
        raise ModelFileError(f"{path}: GGUF has no {arch}.embedding_length")

    n_head = _per_layer(meta, f"{arch}.attention.head_count", n_layers, 1)
    n_head_kv = _per_layer(meta, f"{arch}.attention.head_count_kv", n_layers, 0)
    key_len = meta.get_int(f"{arch}.attention.key_length", 0)
    value_len = meta.get_int(f"{arch}.attention.value_length", 0)
    ssm_inner = meta.get_int(f"{arch}.ssm.inner_size", 0)
    ssm_state = meta.get_int(f"{arch}.ssm.state_size", 0)
    ssm_groups = meta.get_int(f"{arch}.ssm.group_count", 0)
    ssm_conv = meta.get_int(f"{arch}.ssm.conv_kernel", 0)
    # State = the (inner x state) matrix, plus the last conv_kernel-1 inputs of the conv channels.
    conv_channels = ssm_inner + 2 * ssm_groups * ssm_state
    state_bytes = (ssm_inner * ssm_state + max(ssm_conv - 1, 0) * conv_channels) * _STATE_ELEMENT_BYTES

    layers: list[LayerProfile] = []
    for i in range(n_layers):
        heads_kv = n_head_kv[i] or n_head[i] or 1
        head_dim = n_embd // max(n_head[i], 1)
        k_len = key_len or head_dim
        v_len = value_len or head_dim
        is_recurrent = i in recurrent
        layers.append(
            LayerProfile(
                bytes=block_bytes.get(i, 0),
                active_bytes=active_bytes.get(i, 0),
                kind="recurrent" if is_recurrent else "attention",
                kv_bytes_per_token=0 if is_recurrent else heads_kv * (k_len + v_len) * _KV_ELEMENT_BYTES,
                state_bytes=state_bytes if is_recurrent else 0,
            )
        )
    tokens = meta.kvs.get("tokenizer.ggml.tokens")
    vocab = meta.get_int(f"{arch}.vocab_size", tokens.length if tokens is not None else vocab_rows)
    tied = head_bytes == 0
    label = name or _field(meta, "general.name") or path.stem
    return ModelProfile(
        name=str(label),
        arch=arch,
        n_embd=n_embd,
        vocab_size=int(vocab),
        layers=tuple(layers),
        embd_bytes=embd_bytes,
        head_bytes=embd_bytes if tied else head_bytes,
        other_bytes=other_bytes,
        tied_head=tied,
    )
