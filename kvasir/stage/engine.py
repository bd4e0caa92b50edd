"""The stage engine: one llama.cpp context that runs one contiguous window of a model's layers.

Input is token ids (first stage) or the previous stage's hidden states; output is the residual stream after the
window's last layer for every token (``l_out-{n-1}``, copied out of the graph by an eval callback before the
buffer is reused), or, on the last stage, the logits of the last token and a sampled token. See
docs/stage-gguf.md for the recipe and why each step is there.

All methods block; call them from a worker thread (:meth:`Stage.run`), one at a time per stage.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import trio

from kvasir.core.errors import InputError, ShapeError, StageError
from kvasir.core.sampling import SamplingParams
from kvasir.core.speculate import verify_rows
from kvasir.shard.arch import rules_for
from kvasir.shard.cache import default_cache_dir
from kvasir.shard.gguf_file import STAGE_PREFIX, describe
from kvasir.shard.gguf_io import GGUFFile, read_gguf
from kvasir.shard.slice import read_embedding_block
from kvasir.stage.capture import Capture, make_capture
from kvasir.stage.embedding import TokenEmbedding
from kvasir.stage.llama_ffi import runtime
from kvasir.stage.rollback import RecurrentSnapshots
from kvasir.stage.sampling import Sampler
from kvasir.stage.vocab import Vocab

T = TypeVar("T")
FloatArray = np.ndarray[Any, np.dtype[np.float32]]


@attrs.frozen
class StageConfig:
    """How to run one stage. Built once (from CLI flags or a manifest) and passed down whole."""

    path: Path
    #: Context length per sequence.
    n_ctx: int = 2048
    #: Sequences (requests) that may be in flight at once in this context.
    n_seq_max: int = 4
    #: Largest batch handed to llama.cpp in one call; longer inputs are split by the caller.
    n_batch: int = 512
    n_threads: int | None = None
    n_gpu_layers: int = 0
    #: Capture boundaries with the compiled C callback (falls back to Python when no compiler is found).
    native_capture: bool = True
    #: Last stage of a model with MTP (nextn) layers: load them and keep every row's nextn hidden state for the MTP
    #: drafter (kvasir.stage.mtp). Logits are unchanged: docs/mtp.md § Exactness.
    mtp: bool = False
    #: Hybrid (qwen35) windows: keep the recurrent state after each of a sequence's last ``rollback`` decodes, so
    #: :meth:`Stage.truncate` can roll the sequence back to any of those positions (speculation). 0: no snapshots;
    #: recurrent layers then cannot roll back partially.
    rollback: int = 0


@attrs.frozen
class StageInfo:
    arch: str
    #: Window [start, end) in the whole model's layers.
    start: int
    end: int
    source_layers: int
    n_embd: int
    n_vocab: int
    first: bool
    last: bool
    #: MTP (nextn) blocks this stage file carries (the last window of a Qwen3.5 model).
    nextn_layers: int
    #: The model's identity: sha256 of the whole GGUF when the stage file records it.
    model_sha256: str | None
    backend: str
    n_threads: int

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class _Batch:
    """A llama_batch whose arrays are numpy buffers we own (no per-element ctypes copies)."""

    def __init__(self, L: Any, n_max: int, positions_per_token: int) -> None:
        self.n_max = n_max
        self.ppt = positions_per_token
        self.token = np.zeros(n_max, np.int32)
        self.pos = np.zeros(n_max * positions_per_token, np.int32)
        self.n_seq_id = np.ones(n_max, np.int32)
        self.seq = np.zeros(n_max, np.int32)
        self.logits = np.zeros(n_max, np.int8)
        base = self.seq.ctypes.data
        self.seq_ptrs = (ctypes.POINTER(ctypes.c_int32) * n_max)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(n_max)]
        )
        self.batch = L.llama_batch()
        self.batch.pos = self.pos.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.seq_id = ctypes.cast(self.seq_ptrs, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, spans: Sequence[tuple[int, int, int]], all_outputs: bool) -> None:
        """Lay out ``(seq_id, pos0, n)`` spans one after another; the last token of each span is always an output."""
        n = sum(span[2] for span in spans)
        positions = np.concatenate([np.arange(p0, p0 + k, dtype=np.int32) for _, p0, k in spans])
        if self.ppt == 1:
            self.pos[:n] = positions
        else:
            # M-RoPE/IMROPE embedding batches read ppt planes of n positions: [p…][p…][p…][0…].
            for plane in range(self.ppt):
                self.pos[plane * n : (plane + 1) * n] = positions if plane < 3 else 0
        self.logits[:n] = 1 if all_outputs else 0
        i = 0
        for seq_id, _, k in spans:
            self.seq[i : i + k] = seq_id
            i += k
            self.logits[i - 1] = 1
        self.batch.n_tokens = n


@attrs.frozen(eq=False)
class BatchItem:
    """One sequence's chunk in a :meth:`Stage.forward_batch`: token ids (first stage) or hidden states."""

    seq_id: int
    pos0: int
    tokens: Sequence[int] | None = None
    hidden: FloatArray | None = None

    @property
    def n(self) -> int:
        return len(self.tokens) if self.tokens is not None else len(self.hidden) if self.hidden is not None else 0


class Stage:
    """One window of layers in its own llama.cpp context. Create with :meth:`load`; close with :meth:`close`."""

    def __init__(self) -> None:  # use Stage.load
        self.info: StageInfo
        self.config: StageConfig
        self.limiter = trio.CapacityLimiter(1)
        self._model: Any = None
        self._gg: GGUFFile
        self._ctx: Any = None
        self._vocab: Vocab | None = None
        self._embedding: TokenEmbedding | None = None
        self._capture: Capture | None = None
        self._snapshots: RecurrentSnapshots | None = None
        #: Seconds spent in stage calls (compute), for status and benchmarks.
        self.busy_s = 0.0
        #: Seconds spent handing stage calls to the worker thread and back (``run``'s wall time less the compute).
        self.handoff_s = 0.0

    # ------------------------------------------------------------------------------------------------ lifecycle

    @classmethod
    def load(cls, config: StageConfig) -> Stage:
        rt = runtime()
        L = rt.llama
        gg = read_gguf(config.path)
        model_info = describe(config.path, gg)
        rules = rules_for(model_info.arch)
        n_main = model_info.n_main
        start, end = model_info.stage_window or (0, n_main)
        source_layers = int(model_info.source_layers or n_main)
        self = cls()
        self.config = config
        first, last = start == 0, end == source_layers
        if config.mtp and not (last and model_info.nextn_layers):
            raise StageError(f"{config.path}: MTP drafting needs the last window of a model with MTP layers")
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = config.n_gpu_layers
        mp.load_mtp = config.mtp
        model = L.llama_model_load_from_file(str(config.path).encode(), mp)
        if not model:
            raise StageError(f"{config.path}: llama.cpp could not load this stage file")
        self._model = model
        try:
            n_threads = config.n_threads or max(1, os.cpu_count() or 1)
            self._batch_init(L, config, rules.positions_per_token)
            n_layer = int(L.llama_model_n_layer(model))
            cp = L.llama_context_default_params()
            cp.n_ctx = config.n_ctx * config.n_seq_max
            cp.n_batch = config.n_batch
            cp.n_ubatch = config.n_batch
            cp.n_seq_max = config.n_seq_max
            cp.n_threads = n_threads
            cp.n_threads_batch = n_threads
            cp.kv_unified = False  # each sequence its own stream: results independent of other requests
            cp.no_perf = True
            if not last:
                self._capture = make_capture(
                    f"l_out-{n_layer - 1}", model_info.n_embd, default_cache_dir(), native=config.native_capture
                )
                cp.cb_eval = self._capture.callback
                cp.cb_eval_user_data = self._capture.user_data
            ctx = L.llama_init_from_model(model, cp)
            if not ctx:
                raise StageError(f"{config.path}: llama.cpp could not create a context (n_ctx={cp.n_ctx})")
            self._ctx = ctx
            if config.rollback and rules.needs_both_kinds:
                self._snapshots = RecurrentSnapshots(config.rollback)
            if config.mtp:
                # Every row's nextn hidden state (masked=False), not only output rows': the MTP block reads the
                # prompt's rows too. The logits are computed as before (docs/mtp.md § Exactness).
                rt.llama_ext.llama_set_embeddings_nextn(ctx, True, False)
            if first and not last:
                rows, qtype = read_embedding_block(gg)
                self._embedding = TokenEmbedding(rows, qtype, model_info.n_embd, rules.scales_token_embedding)
            self._gg = gg
            self.info = StageInfo(
                arch=model_info.arch,
                start=start,
                end=end,
                source_layers=source_layers,
                n_embd=model_info.n_embd,
                n_vocab=model_info.n_vocab,
                first=first,
                last=last,
                nextn_layers=model_info.nextn_layers,
                model_sha256=gg.get(STAGE_PREFIX + "source_sha256"),
                backend=_backend_name(rt.devices, config.n_gpu_layers),
                n_threads=n_threads,
            )
        except BaseException:
            self.close()
            raise
        return self

    def _batch_init(self, L: Any, config: StageConfig, ppt: int) -> None:
        self._b = _Batch(L, config.n_batch, ppt)

    def close(self) -> None:
        L = runtime().llama
        if self._vocab is not None:
            self._vocab.close()
            self._vocab = None
        if self._ctx is not None:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            L.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ vocabulary

    @property
    def vocab(self) -> Vocab:
        """The model's real tokenizer (loaded on first use on stages that carry it stashed)."""
        if self._vocab is None:
            if self.info.last:
                self._vocab = Vocab(self._model, self.info.arch, owns_model=False)
            else:
                self._vocab = Vocab.from_stashed(self._gg, self.info.arch)
        return self._vocab

    def chat_template(self) -> str | None:
        tmpl = self._gg.get("tokenizer.chat_template") or self._gg.get("kvasir.tokenizer.chat_template")
        return tmpl if isinstance(tmpl, str) else None

    # ------------------------------------------------------------------------------------------------ compute

    def forward(
        self,
        seq_id: int,
        pos0: int,
        *,
        tokens: Sequence[int] | None = None,
        hidden: FloatArray | None = None,
    ) -> FloatArray | None:
        """Run the window on one chunk of one sequence at absolute positions ``pos0…``.

        Returns the boundary ``[n, n_embd]`` on non-last stages, None on the last stage (its logits stay in the
        context for :meth:`sample` / :meth:`logits`).
        """
        return self._decode([BatchItem(seq_id, pos0, tokens, hidden)], all_outputs=not self.info.last)[0]

    def forward_verify(
        self,
        seq_id: int,
        pos0: int,
        *,
        tokens: Sequence[int] | None = None,
        hidden: FloatArray | None = None,
        until: Callable[[int], bool] | None = None,
    ) -> FloatArray | None:
        """A speculative verify batch (the current token + drafts) at positions ``pos0…``, computed one row at a time.

        Row ``i`` is exactly the one-token :meth:`forward` at ``pos0 + i``, so a verify batch has the plain decode's
        bits: speculation never changes an answer. (One llama_decode of n rows would differ in the last bits, and on
        a CPU build costs more than n one-row steps for n < 8: docs/speculation.md § Why row by row.)

        Non-last stages return every row's boundary ``[n, n_embd]``. On the last stage ``until(i)`` is called after
        row ``i``, whose logits are then the context's (:meth:`sample` with the default index); when it returns True
        the rows after ``i`` are not computed (a rejected draft ends the batch). Returns None there.
        """
        if (tokens is None) == (hidden is None):
            raise InputError("forward() takes tokens or hidden states, not both")
        n = len(tokens) if tokens is not None else len(hidden) if hidden is not None else 0
        if n == 0:
            raise InputError("a verify batch needs at least one row")
        rows = verify_rows(
            lambda i, **row: self.forward(seq_id, pos0 + i, **row), n, tokens=tokens, hidden=hidden, until=until
        )
        return np.concatenate(rows) if rows else None

    def forward_batch(self, items: Sequence[BatchItem]) -> list[FloatArray | None]:
        """Several sequences' chunks in one llama_decode (batched decode across requests).

        Items are distinct sequences in ascending id order with the same number of tokens. llama.cpp (per-sequence
        caches) puts each run of consecutive ids into one micro-batch and computes the micro-batches in id order,
        so the boundary rows come out in the items' order only when the ids ascend (``1,5,2`` would come back as
        ``1,2,5``: refused). Returns each item's boundary on non-last stages, Nones on the last stage, where
        item ``i``'s logits are row ``index = (i + 1) * n - 1`` (see :meth:`batch_index`).

        Not bit-exact: one micro-batch of several sequences can change a sequence's numbers against that sequence
        alone (measured in bench/batch_exact.py; docs/speculation.md), so a ring that promises `generate`'s exact
        output must not batch.
        """
        if not items:
            raise InputError("forward_batch() needs at least one item")
        ids = [it.seq_id for it in items]
        if any(a >= b for a, b in itertools.pairwise(ids)) or len({it.n for it in items}) != 1:
            raise InputError("forward_batch() takes distinct sequences in ascending order with equal token counts")
        return self._decode(items, all_outputs=not self.info.last)

    @staticmethod
    def batch_index(item: int, n: int) -> int:
        """The output row of item ``item``'s last token in a :meth:`forward_batch` of ``n``-token items."""
        return (item + 1) * n - 1

    def _decode(self, items: Sequence[BatchItem], *, all_outputs: bool) -> list[FloatArray | None]:
        info = self.info
        embedded: list[tuple[int, int, Sequence[int] | None, FloatArray | None]] = []
        for it in items:
            if not 0 <= it.seq_id < self.config.n_seq_max:
                raise InputError(f"sequence id {it.seq_id} outside [0, {self.config.n_seq_max})")
            tokens, hidden = it.tokens, it.hidden
            if (tokens is None) == (hidden is None):
                raise InputError("forward() takes tokens or hidden states, not both")
            if tokens is not None:
                if not info.first:
                    raise InputError("only the first stage takes token ids")
                if self._embedding is not None:
                    hidden = self._embedding.lookup(tokens)
                    tokens = None
            if hidden is not None and (hidden.ndim != 2 or hidden.shape[1] != info.n_embd):
                raise ShapeError(f"hidden state of shape {tuple(hidden.shape)}, expected (n, {info.n_embd})")
            n = it.n
            if n == 0:
                raise InputError(f"chunk of {n} tokens outside [1, {self.config.n_batch}]")
            if it.pos0 < 0 or it.pos0 + n > self.config.n_ctx:
                raise InputError(f"positions {it.pos0}..{it.pos0 + n} exceed the context of {self.config.n_ctx}")
            embedded.append((it.seq_id, it.pos0, tokens, hidden))
        total = sum(it.n for it in items)
        if total > self.config.n_batch:
            raise InputError(f"chunk of {total} tokens outside [1, {self.config.n_batch}]")
        if len({tokens is None for _, _, tokens, _ in embedded}) != 1:
            raise InputError("a batch takes token ids or hidden states for all its items, not a mix")
        b = self._b
        b.fill([(seq, p0, it.n) for (seq, p0, _, _), it in zip(embedded, items, strict=True)], all_outputs)
        if embedded[0][2] is not None:
            ids = [t for _, _, tokens, _ in embedded for t in (tokens or ())]
            if self._vocab is not None:
                self._vocab.check_tokens(ids)
            b.token[:total] = ids
            b.batch.token = b.token.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
            b.batch.embd = None
        else:
            parts = [h for _, _, _, h in embedded if h is not None]
            emb = np.ascontiguousarray(parts[0] if len(parts) == 1 else np.concatenate(parts), dtype=np.float32)
            b.batch.token = None
            b.batch.embd = emb.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        out = np.empty((total, info.n_embd), np.float32)
        if self._capture is not None:
            self._capture.begin(out)
        rc = runtime().llama.llama_decode(self._ctx, b.batch)
        if rc != 0:
            where = ", ".join(f"sequence {it.seq_id}, positions {it.pos0}..{it.pos0 + it.n}" for it in items)
            raise StageError(f"llama_decode failed with code {rc} ({where})")
        if self._snapshots is not None:
            for it in items:
                self._snapshots.record(self._ctx, it.seq_id, it.pos0 + it.n)
        if self._capture is None:
            return [None] * len(items)
        if self._capture.rows() != total:
            raise StageError(f"boundary capture failed: got {self._capture.rows()} of {total} rows")
        if len(items) == 1:
            return [out]
        bounds = np.cumsum([0] + [it.n for it in items])
        return [out[a:z] for a, z in itertools.pairwise(bounds)]

    def logits(self, index: int = -1) -> FloatArray:
        """A copy of one output row's logits (last stage only): the last row, or batch position ``index``."""
        if not self.info.last:
            raise StageError("only the last stage has logits")
        ptr = runtime().llama.llama_get_logits_ith(self._ctx, index)
        if not ptr:
            raise StageError(f"no logits at batch position {index}")
        return np.ctypeslib.as_array(ptr, shape=(self.info.n_vocab,)).copy()

    def nextn_hidden(self, n: int) -> FloatArray:
        """The last decode's nextn hidden states (what the MTP block reads), rows ``0..n-1`` of its batch
        ``[n, n_embd]`` (a stage loaded with ``mtp``)."""
        if not self.config.mtp:
            raise StageError("nextn hidden states need a stage loaded for MTP drafting")
        get = runtime().llama_ext.llama_get_embeddings_nextn_ith
        out = np.empty((n, self.info.n_embd), np.float32)
        for i in range(n):
            ptr = get(self._ctx, i)
            if not ptr:
                raise StageError(f"no nextn hidden state at batch position {i}")
            out[i] = np.ctypeslib.as_array(ptr, shape=(self.info.n_embd,))
        return out

    @property
    def snapshots(self) -> RecurrentSnapshots | None:
        """The recurrent-state snapshots a hybrid window keeps for rollback (``StageConfig.rollback``), if any."""
        return self._snapshots

    @property
    def handles(self) -> tuple[Any, Any]:
        """The llama.cpp model and context (for kvasir.stage.mtp, which runs the MTP block on this model)."""
        return self._model, self._ctx

    def new_sampler(self, params: SamplingParams) -> Sampler:
        return Sampler(params, self.info.n_vocab, self.config.n_ctx)

    def sample(self, sampler: Sampler, index: int = -1) -> int:
        """Sample from the last output row, or from batch position ``index`` (a verify or batched decode)."""
        if not self.info.last:
            raise StageError("only the last stage samples")
        return sampler.sample(self._ctx, index)

    def free_sequence(self, seq_id: int) -> None:
        """Drop one sequence's cache, leaving the others untouched."""
        L = runtime().llama
        L.llama_memory_seq_rm(L.llama_get_memory(self._ctx), seq_id, -1, -1)
        if self._snapshots is not None:
            self._snapshots.forget(seq_id)

    def truncate(self, seq_id: int, pos: int) -> None:
        """Forget one sequence's cache from position ``pos`` on (rejected speculative drafts), keeping ``[0, pos)``.
        A hybrid window restores its recurrent state from the snapshot taken at ``pos`` (``StageConfig.rollback``,
        kvasir.stage.rollback) before its attention layers forget."""
        L = runtime().llama
        mem = L.llama_get_memory(self._ctx)
        # Snapshot first: llama.cpp's recurrent seq_rm refuses a partial removal here, but a version that took
        # "remove from the last position" as "drop the whole state" would answer wrongly, not fail.
        restored = self._snapshots is not None and self._snapshots.restore(self._ctx, seq_id, pos)
        if not L.llama_memory_seq_rm(mem, seq_id, pos, -1):
            raise StageError(f"this model's cache cannot roll sequence {seq_id} back to position {pos}")
        if self._snapshots is not None and not restored:
            self._snapshots.forget(seq_id, after=pos)

    def clear(self) -> None:
        L = runtime().llama
        L.llama_memory_clear(L.llama_get_memory(self._ctx), True)
        if self._snapshots is not None:
            self._snapshots.clear()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking stage call in a worker thread, one at a time per stage (llama.cpp releases the GIL)."""

        spent = 0.0

        def timed() -> T:
            nonlocal spent
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent = time.perf_counter() - t0
                self.busy_s += spent

        async with self.limiter:
            t_call = time.perf_counter()
            try:
                return await trio.to_thread.run_sync(timed)
            finally:
                # The worker thread's wake-up and the event loop's, around the compute (docs/benchmarks.md).
                self.handoff_s += time.perf_counter() - t_call - spent


def _backend_name(devices: Sequence[str], n_gpu_layers: int) -> str:
    accel = [d for d in devices if d.upper() != "CPU"]
    if n_gpu_layers != 0 and accel:
        return accel[0]
    return "CPU"
