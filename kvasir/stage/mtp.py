"""The model's own MTP (multi-token prediction, "nextn") block as a drafter at the last rank.

Qwen3.5 checkpoints append an MTP block after the main layers. It predicts the token after next from two inputs: the
token at position ``q + 1`` and the main model's nextn hidden state at position ``q`` (``h_q``, the state the last
rank's logits come from: only the last rank has it). In llama.cpp (the pinned llama-cpp-python 0.3.36) it runs as a
second context of type ``LLAMA_CONTEXT_TYPE_MTP`` on the same model (loaded with ``load_mtp``; the graph is
``graph_mtp`` of qwen35 / qwen35moe / qwen3next), fed a batch that carries token ids *and* one hidden row per token;
it has its own KV cache (one attention layer). Its output is logits over the vocabulary (the shared head) and its own
nextn hidden state, which feeds the next draft when drafting more than one token (the chain).

Per request, the MTP cache holds the pairs ``(x_{q+1}, h_q)`` at positions ``q + 1`` for every token the target
accepted; drafting K tokens appends K - 1 speculative entries built from the MTP's own hidden state, forgotten before
the next true pairs are fed. See docs/mtp.md.

:class:`MtpHead` owns the MTP context of one last stage; :class:`MtpDrafter` is one request's drafting state with a
small surface (``accept`` tokens, ``observe`` hidden rows, ``propose(k)``) that any drafter interface can wrap.
All methods block (llama_decode): call them from the stage's worker thread, as the stage's own calls.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kvasir.core.errors import InputError, StageError
from kvasir.shard.arch import rules_for
from kvasir.stage.engine import FloatArray, Stage
from kvasir.stage.llama_ffi import runtime


class _PairBatch:
    """A llama_batch carrying token ids and one hidden row per token (the MTP graph's two inputs)."""

    def __init__(self, L: Any, n_max: int, n_embd: int, ppt: int) -> None:
        self.n_max, self.ppt = n_max, ppt
        self.token = np.zeros(n_max, np.int32)
        self.embd = np.zeros((n_max, n_embd), np.float32)
        self.pos = np.zeros(n_max * ppt, np.int32)
        self.n_seq_id = np.ones(n_max, np.int32)
        self.seq = np.zeros(n_max, np.int32)
        self.logits = np.zeros(n_max, np.int8)
        base = self.seq.ctypes.data
        self._seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n_max)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(n_max)]
        )
        b = L.llama_batch()
        b.token = self.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.embd = self.embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.batch = b

    def fill(self, seq_id: int, pos0: int, tokens: Sequence[int], hidden: FloatArray) -> None:
        n = len(tokens)
        self.token[:n] = tokens
        self.embd[:n] = hidden
        positions = np.arange(pos0, pos0 + n, dtype=np.int32)
        for plane in range(self.ppt):  # IMROPE embedding batches read planes [p…][p…][p…][0…]
            self.pos[plane * n : (plane + 1) * n] = positions if plane < 3 else 0
        self.seq[:n] = seq_id
        self.logits[:n] = 0
        self.logits[n - 1] = 1
        self.batch.n_tokens = n


class MtpHead:
    """The MTP block of a last stage loaded with ``StageConfig(mtp=True)``, in its own llama.cpp MTP context."""

    def __init__(self, stage: Stage) -> None:
        if not stage.config.mtp:
            raise StageError("the MTP head needs a last stage loaded with mtp=True")
        rt = runtime()
        L = rt.llama
        self.stage = stage
        self.n_embd, self.n_vocab = stage.info.n_embd, stage.info.n_vocab
        model, target = stage.handles
        cfg = stage.config
        cp = L.llama_context_default_params()
        cp.n_ctx = cfg.n_ctx * cfg.n_seq_max
        cp.n_batch = cp.n_ubatch = cfg.n_batch
        cp.n_seq_max = cfg.n_seq_max
        cp.n_threads = cp.n_threads_batch = stage.info.n_threads
        cp.kv_unified = False
        cp.no_perf = True
        cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        cp.ctx_other = target
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise StageError(f"{cfg.path}: llama.cpp could not create an MTP context")
        self._ctx = ctx
        # Output only the rows asked for (the last of a batch): the MTP's own hidden state for the chain.
        rt.llama_ext.llama_set_embeddings_nextn(ctx, True, True)
        self._b = _PairBatch(L, cfg.n_batch, self.n_embd, rules_for(stage.info.arch).positions_per_token)
        #: Seconds spent in MTP decodes (wall clock, and CPU time of the calling thread: llama.cpp computes there
        #: with one thread), and their count (for the cost per drafted token).
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self.decodes = 0

    def decode(self, seq_id: int, pos0: int, tokens: Sequence[int], hidden: FloatArray) -> tuple[int, FloatArray]:
        """Feed pairs ``(tokens[i], hidden[i])`` at positions ``pos0 + i``; the greedy draft after the last one and
        the MTP's nextn hidden state there (the next link of a chain)."""
        n = len(tokens)
        if n == 0 or n != len(hidden):
            raise InputError("an MTP batch takes one hidden row per token, at least one")
        L = runtime().llama
        out_h = np.empty(self.n_embd, np.float32)
        t0, c0 = time.perf_counter(), time.thread_time()
        for i in range(0, n, self._b.n_max):  # a long prompt in batches of n_batch pairs
            j = min(n, i + self._b.n_max)
            self._b.fill(seq_id, pos0 + i, tokens[i:j], hidden[i:j])
            rc = L.llama_decode(self._ctx, self._b.batch)
            if rc != 0:
                raise StageError(f"MTP llama_decode failed with code {rc} (sequence {seq_id}, position {pos0 + i})")
        ptr = L.llama_get_logits_ith(self._ctx, -1)
        h = runtime().llama_ext.llama_get_embeddings_nextn_ith(self._ctx, -1)
        if not ptr or not h:
            raise StageError("the MTP context returned no logits or hidden state")
        draft = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))
        out_h[:] = np.ctypeslib.as_array(h, shape=(self.n_embd,))
        self.busy_s += time.perf_counter() - t0
        self.cpu_s += time.thread_time() - c0
        self.decodes += 1
        return draft, out_h

    def truncate(self, seq_id: int, pos: int) -> None:
        """Forget one sequence's MTP cache from position ``pos`` on."""
        L = runtime().llama
        if not L.llama_memory_seq_rm(L.llama_get_memory(self._ctx), seq_id, pos, -1):
            raise StageError(f"the MTP cache cannot roll sequence {seq_id} back to position {pos}")

    def free(self, seq_id: int) -> None:
        L = runtime().llama
        L.llama_memory_seq_rm(L.llama_get_memory(self._ctx), seq_id, -1, -1)

    def close(self) -> None:
        if self._ctx is not None:
            runtime().llama.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> MtpHead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MtpDecoder(Protocol):
    """What :class:`MtpDrafter` needs of the MTP block (an :class:`MtpHead`; a fake in unit tests)."""

    def decode(self, seq_id: int, pos0: int, tokens: Sequence[int], hidden: FloatArray) -> tuple[int, FloatArray]: ...

    def truncate(self, seq_id: int, pos: int) -> None: ...

    def free(self, seq_id: int) -> None: ...


class MtpDrafter:
    """One request's MTP drafts. Feed it the request's tokens in order (``accept``: the prompt, then every emitted
    token) and the last stage's nextn hidden rows as they are computed (``observe``); ``propose(k)`` drafts up to
    ``k`` tokens after the latest accepted one (empty while the hidden state before it is unknown).

    Drafts never change an answer (the verify batch decides); they only need the true pairs in the MTP cache."""

    def __init__(self, head: MtpDecoder, seq_id: int) -> None:
        self.head, self.seq = head, seq_id
        self.tokens: list[int] = []
        #: Hidden rows ``h_q`` not yet paired into the MTP cache, by position ``q``.
        self._hidden: dict[int, FloatArray] = {}
        #: Positions ``[1, committed)`` of the MTP cache hold true pairs; past it, the last chain's guesses.
        self.committed = 1
        self._cached_end = 1
        #: The draft after the last true pair and the MTP hidden state there (the chain's start).
        self._seed: tuple[int, FloatArray] | None = None
        self.proposed = 0

    def accept(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def observe(self, pos0: int, hidden: FloatArray) -> None:
        """The target's nextn hidden rows at positions ``pos0…`` (rows of the true sequence only)."""
        for i, row in enumerate(hidden):
            if pos0 + i + 1 >= self.committed:
                self._hidden[pos0 + i] = row

    def rollback(self, pos: int) -> None:
        """The request's sequence now ends before ``pos`` (tokens at ``pos`` and after were never emitted)."""
        del self.tokens[pos:]
        self._hidden = {q: h for q, h in self._hidden.items() if q < pos}
        if self.committed > pos:
            self.committed = max(1, pos)
            self._seed = None
        self._truncate()

    def _truncate(self) -> None:
        if self._cached_end > self.committed:
            self.head.truncate(self.seq, self.committed)
            self._cached_end = self.committed

    def propose(self, k: int) -> list[int]:
        if k <= 0:
            return []
        last = len(self.tokens) - 1  # the latest token's position: its pair needs h at last - 1
        if last < 1:
            return []
        if self.committed <= last:
            if any(q - 1 not in self._hidden for q in range(self.committed, last + 1)):
                return []
            self._truncate()  # the last chain's guesses go before true pairs are written there
            q0 = self.committed
            rows = np.stack([self._hidden.pop(q - 1) for q in range(q0, last + 1)])
            self._seed = self.head.decode(self.seq, q0, self.tokens[q0 : last + 1], rows)
            self.committed = self._cached_end = last + 1
        elif self._seed is None:
            return []
        else:
            self._truncate()
        assert self._seed is not None
        draft, h = self._seed
        drafts = [draft]
        for i in range(1, k):  # the chain: the MTP's own hidden state stands in for the target's
            draft, h = self.head.decode(self.seq, last + i, [draft], h[None, :])
            self._cached_end = last + i + 1
            drafts.append(draft)
        self.proposed += len(drafts)
        return drafts

    def close(self) -> None:
        self.head.free(self.seq)
