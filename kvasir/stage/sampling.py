"""The llama.cpp sampler chain built from a request's :class:`~kvasir.core.sampling.SamplingParams`."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from kvasir.core.errors import StageError
from kvasir.core.sampling import SamplingParams
from kvasir.stage.llama_ffi import runtime

#: llama.cpp reads this seed as "pick a random one".
RANDOM_SEED = 0xFFFFFFFF


class Sampler:
    """One request's llama.cpp sampler chain (it keeps the penalty history, so one per request)."""

    def __init__(self, params: SamplingParams, n_vocab: int, n_ctx: int) -> None:
        L = runtime().llama
        self._L = L
        self.params = params
        self._n_vocab = n_vocab
        # Greedy without penalties is an argmax: numpy's (first maximum, as llama.cpp's greedy sampler picks) reads
        # the row in place, where llama_sampler_sample first copies a candidate array of n_vocab entries (0.3 ms of
        # the last rank's 11 ms step on Gemma's 262k vocabulary).
        self._argmax = params.greedy and params.repeat_penalty == 1.0
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if params.repeat_penalty != 1.0:
            L.llama_sampler_chain_add(
                chain,
                L.llama_sampler_init_penalties(
                    n_vocab,
                    n_ctx if params.repeat_last_n < 0 else params.repeat_last_n,
                    params.repeat_penalty,
                    0.0,
                    0.0,
                ),
            )
        if params.greedy:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(params.top_k))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(params.top_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_min_p(params.min_p, 1))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(params.temperature))
            L.llama_sampler_chain_add(
                chain, L.llama_sampler_init_dist(RANDOM_SEED if params.seed is None else params.seed)
            )
        self._chain: Any = chain

    def accept(self, token: int) -> None:
        """Feed a prompt token into the penalty history."""
        self._L.llama_sampler_accept(self._chain, token)

    def sample(self, ctx: ctypes.c_void_p, index: int = -1) -> int:
        """Sample from output row ``index`` of ``ctx`` (default the last; the token is accepted into the history)."""
        if self._argmax:
            row = self._L.llama_get_logits_ith(ctx, index)
            if not row:
                raise StageError(f"no logits at batch position {index}")
            return int(np.ctypeslib.as_array(row, shape=(self._n_vocab,)).argmax())
        return int(self._L.llama_sampler_sample(self._chain, ctx, index))

    def close(self) -> None:
        if self._chain is not None:
            self._L.llama_sampler_free(self._chain)
            self._chain = None
