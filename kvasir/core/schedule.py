"""The prefill schedule every path shares."""

from __future__ import annotations

#: Prompt tokens per prefill step, in-process and on the ring alike. llama.cpp's result depends on how a prompt is
#: batched (a 200-token prompt prefilled in one batch and in 64-token chunks differ in the last bits of the logits),
#: so every path uses the same schedule and the ring stays bit-exact with `kvasir generate`.
PREFILL_CHUNK = 64
