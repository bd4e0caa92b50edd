"""Rolling a hybrid (recurrent + attention) window back by position: snapshots of the recurrent state.

A recurrent layer (qwen35's gated delta net) keeps one state per sequence, the sum of everything it has seen, so
llama.cpp refuses to forget its last positions (``llama_memory_seq_rm`` returns false). Speculation needs exactly
that: forget the rows of rejected drafts. The pinned llama.cpp has two ways, and only one keeps answers exact:

* ``llama_context_params.n_rs_seq`` (experimental) keeps snapshots written *inside one ubatch*: the last
  ``n_rs_seq + 1`` tokens of a multi-row batch (``[TAG_RECURRENT_ROLLBACK_SPLITS]`` in llama.cpp's
  ``delta-net-base.cpp``, ``build_conv_state`` / ``build_recurrent_attn``). Kvasir computes a verify batch one row
  at a time (each row the plain one-token step, docs/speculation.md), so each decode writes only the live slot and a
  rollback restores stale snapshots: measured here, greedy answers diverged at the first rejected draft. It also
  switches the delta net to its K-snapshot kernel, a different computation from the plain step.
* ``llama_state_seq_get_data_ext`` / ``set_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` copy just a
  sequence's recurrent state (and no attention cache) out and back, byte for byte. Kvasir takes one such snapshot after
  each decode of a sequence (the last ``depth`` kept) and, to roll back to position ``pos``, writes back the snapshot
  taken when the sequence ended at ``pos``; the attention layers then forget ``[pos, …)`` as usual. The states are
  the ones the plain steps left, so the rows that follow are the plain ones.
"""

from __future__ import annotations

import ctypes
import time
from collections import OrderedDict
from typing import Any

from kvasir.core.errors import StageError
from kvasir.stage.llama_ffi import runtime


class RecurrentSnapshots:
    """The recurrent state of each sequence after its last ``depth`` decodes, keyed by the position it ended at.
    Buffers are reused once evicted: a snapshot is one copy out of llama.cpp, never an allocation per decode."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._by_seq: dict[int, OrderedDict[int, ctypes.Array[ctypes.c_uint8]]] = {}
        self._spare: list[ctypes.Array[ctypes.c_uint8]] = []
        #: Bytes copied out and seconds spent copying out and back so far (the snapshots' cost, for benchmarks).
        self.bytes_copied = 0
        self.seconds = 0.0

    def _buffer(self, size: int) -> ctypes.Array[ctypes.c_uint8]:
        while self._spare:
            buf = self._spare.pop()
            if len(buf) == size:
                return buf
        return (ctypes.c_uint8 * size)()

    def record(self, ctx: Any, seq_id: int, end: int) -> None:
        """After a decode left ``seq_id`` ending at position ``end`` (exclusive)."""
        t0 = time.perf_counter()
        L = runtime().llama
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        snaps = self._by_seq.setdefault(seq_id, OrderedDict())
        for stale in [p for p in snaps if p >= end]:  # a later decode at or before these replaced them
            self._spare.append(snaps.pop(stale))
        while len(snaps) >= self.depth:
            self._spare.append(snaps.popitem(last=False)[1])
        size = int(L.llama_state_seq_get_size_ext(ctx, seq_id, flags))
        buf = self._buffer(size)
        got = int(L.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, flags))
        if got != size:
            raise StageError(f"recurrent state snapshot of sequence {seq_id}: {got} of {size} bytes")
        snaps[end] = buf
        self.bytes_copied += size
        self.seconds += time.perf_counter() - t0

    def restore(self, ctx: Any, seq_id: int, pos: int) -> bool:
        """Write back the state ``seq_id`` had when it ended at ``pos``; False when no snapshot is that recent."""
        snaps = self._by_seq.get(seq_id)
        snap = snaps.get(pos) if snaps else None
        if snap is None:
            return False
        t0 = time.perf_counter()
        L = runtime().llama
        read = int(L.llama_state_seq_set_data_ext(ctx, snap, len(snap), seq_id, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        if read != len(snap):
            raise StageError(f"restoring the recurrent state of sequence {seq_id} at position {pos} failed")
        self.forget(seq_id, after=pos)
        self.seconds += time.perf_counter() - t0
        return True

    def forget(self, seq_id: int, after: int | None = None) -> None:
        """Drop ``seq_id``'s snapshots (only those ending after ``after`` when given)."""
        snaps = self._by_seq.get(seq_id)
        if not snaps:
            return
        for p in [p for p in snaps if after is None or p > after]:
            self._spare.append(snaps.pop(p))
        del self._spare[self.depth :]  # keep a window's worth of buffers, not every sequence's
        if after is None:
            del self._by_seq[seq_id]

    def clear(self) -> None:
        self._by_seq.clear()
        self._spare.clear()
