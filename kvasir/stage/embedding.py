"""Token embedding lookup outside llama.cpp, for first stages.

A first stage loads a stub vocabulary into llama.cpp (so it never pays a full-vocabulary output projection) and
looks the prompt's rows up here instead: dequantize only the selected rows, then apply the architecture's scale
exactly as llama.cpp does for token input (gemma multiplies by ``sqrtf(n_embd)`` in float32).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvasir.core.errors import InputError


class TokenEmbedding:
    def __init__(self, rows: np.ndarray[Any, Any], qtype: GGMLQuantizationType, n_embd: int, scale: bool) -> None:
        self._rows = rows
        self._qtype = qtype
        self.n_embd = n_embd
        self.n_vocab = int(rows.shape[0])
        # sqrtf(n_embd) rounded to float32 once, as llama.cpp computes it.
        self._scale = np.sqrt(np.float32(n_embd)) if scale else None

    def lookup(self, tokens: Sequence[int]) -> np.ndarray[Any, np.dtype[np.float32]]:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            raise InputError(f"token id out of range [0, {self.n_vocab})")
        out = np.ascontiguousarray(dequantize(np.asarray(self._rows[ids]), self._qtype), dtype=np.float32)
        out = out.reshape(len(ids), self.n_embd)
        if self._scale is not None:
            out *= self._scale
        return out
