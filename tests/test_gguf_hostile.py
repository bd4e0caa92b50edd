"""A damaged or hostile GGUF header is a ModelFileError — never another exception, a hang or a huge allocation."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from kvasir.core.errors import ModelFileError
from kvasir.planner.profile import profile_from_gguf
from kvasir.shard.gguf_file import describe
from kvasir.shard.gguf_io import TensorSource, encode_kv, read_gguf, write_gguf


def test_truncated_and_corrupted_headers_fail_cleanly(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("gemma3", "f32")
    data = model.read_bytes()
    header_end = read_gguf(model).data_offset
    rng = random.Random(1234)
    target = tmp_path / "bad.gguf"
    cases = [data[:n] for n in range(0, header_end, max(1, header_end // 150))]
    for _ in range(300):  # flip a few bytes of the header (lengths, counts, types, offsets)
        b = bytearray(data[: header_end + 64])
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(4, header_end)] = rng.randrange(256)
        cases.append(bytes(b))
    outcomes = {"error": 0, "ok": 0}
    for case in cases:
        target.write_bytes(case)
        began = time.perf_counter()
        try:
            read_gguf(target)
            outcomes["ok"] += 1
        except ModelFileError:
            outcomes["error"] += 1
        assert time.perf_counter() - began < 0.5  # no hang (tests/test_gguf_parser.py also guards allocation)
    assert outcomes["error"] > len(cases) // 2, outcomes


Meta = tuple[Any, GGUFValueType, GGUFValueType | None]


def _model(path: Path, **meta: Meta) -> Path:
    """A small valid llama GGUF; ``meta`` overrides keys (``llama.`` is implied but for ``kvasir.*``): value, type,
    array element type."""
    u32 = GGUFValueType.UINT32
    kvs: dict[str, Meta] = {
        "general.architecture": ("llama", GGUFValueType.STRING, None),
        "llama.block_count": (2, u32, None),
        "llama.embedding_length": (8, u32, None),
        "llama.attention.head_count": (2, u32, None),
    }
    kvs.update({k if k.startswith("kvasir") else f"llama.{k}": v for k, v in meta.items()})
    f32 = GGMLQuantizationType.F32
    tensors = [TensorSource(f"blk.{i}.attn_q.weight", (8, 8), f32, 256, data=bytes(256)) for i in range(2)]
    with path.open("wb") as out:
        write_gguf(out, [encode_kv(k, *v) for k, v in kvs.items()], tensors)
    return path


S, U32 = GGUFValueType.STRING, GGUFValueType.UINT32
BOTH, DESCRIBE, PROFILE = ("describe", "profile"), ("describe",), ("profile",)


@pytest.mark.parametrize(
    ("meta", "fails_in"),
    [
        ({"block_count": ("2", S, None)}, BOTH),
        ({"block_count": (1 << 40, GGUFValueType.UINT64, None)}, BOTH),
        ({"embedding_length": (-8, GGUFValueType.INT32, None)}, BOTH),
        ({"nextn_predict_layers": (2, U32, None)}, DESCRIBE),
        ({"kvasir.stage.layer_start": (3, U32, None), "kvasir.stage.layer_end": (1, U32, None)}, DESCRIBE),
        ({"kvasir.stage.layer_start": (0, U32, None), "kvasir.stage.layer_end": ("x", S, None)}, DESCRIBE),
        ({"kvasir.stage.source_layers": (-1, GGUFValueType.INT32, None)}, DESCRIBE),
        ({"expert_count": ("4", S, None)}, PROFILE),
        ({"attention.head_count": (["2", "2"], GGUFValueType.ARRAY, S)}, PROFILE),
        ({"attention.key_length": (1.5, GGUFValueType.FLOAT32, None)}, PROFILE),
        ({"ssm.inner_size": (True, GGUFValueType.BOOL, None)}, PROFILE),
    ],
)
def test_hostile_metadata_values_fail_cleanly(meta: dict[str, Any], fails_in: tuple[str, ...], tmp_path: Path) -> None:
    """Metadata of the wrong type or range is a ModelFileError in describe or the planner, never a crash later."""
    path = _model(tmp_path / "m.gguf", **meta)
    for name, fn in (("describe", describe), ("profile", profile_from_gguf)):
        if name in fails_in:
            with pytest.raises(ModelFileError, match="GGUF"):
                fn(path)
        else:
            fn(path)


def test_the_valid_base_of_the_hostile_metadata_cases(tmp_path: Path) -> None:
    path = _model(tmp_path / "m.gguf")
    assert describe(path).n_main == 2 and profile_from_gguf(path).n_layers == 2
