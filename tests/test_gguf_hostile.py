"""A damaged or hostile GGUF header is a ModelFileError — never another exception, a hang or a huge allocation."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from kvasir.errors import ModelFileError
from kvasir.shard.gguf_io import read_gguf


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
        try:
            read_gguf(target)
            outcomes["ok"] += 1
        except ModelFileError:
            outcomes["error"] += 1
    assert outcomes["error"] > len(cases) // 2, outcomes
