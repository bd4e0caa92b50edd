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
    """The recurrent state of each sequence after its last ``depth`` decodes, keyed by the position it ended at."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._by_seq: dict[int, OrderedDict[int, bytes]] = {}
        #: Bytes copied out and seconds spent copying out and back so far (the snapshots' cost, for benchmarks).
        self.bytes_copied = 0
        self.seconds = 0.0

    def record(self, ctx: Any, seq_id: int, end: int) -> None:
        """After a decode left ``seq_id`` ending at position ``end`` (exclusive)."""
        t0 = time.perf_counter()
        L = runtime().llama
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(L.llama_state_seq_get_size_ext(ctx, seq_id, flags))
        buf = (ctypes.c_uint8 * size)()
        got = int(L.llama_state_seq_get_data_ext(ctx, buf, size, seq_id, flags))
        if got != size:
            raise StageError(f"recurrent state snapshot of sequence {seq_id}: {got} of {size} bytes")
        snaps = self._by_seq.setdefault(seq_id, OrderedDict())
        for stale in [p for p in snaps if p >= end]:  # a later decode at or before these replaced them
            del snaps[stale]
        snaps[end] = bytes(buf)
        self.bytes_copied += size
        while len(snaps) > self.depth:
            snaps.popitem(last=False)
        self.seconds += time.perf_counter() - t0

    def restore(self, ctx: Any, seq_id: int, pos: int) -> bool:
        """Write back the state ``seq_id`` had when it ended at ``pos``; False when no snapshot is that recent."""
        snaps = self._by_seq.get(seq_id)
        snap = snaps.get(pos) if snaps else None
        if snap is None:
            return False
        t0 = time.perf_counter()
        L = runtime().llama
        buf = (ctypes.c_uint8 * len(snap)).from_buffer_copy(snap)
        read = int(L.llama_state_seq_set_data_ext(ctx, buf, len(snap), seq_id, L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        if read != len(snap):
            raise StageError(f"restoring the recurrent state of sequence {seq_id} at position {pos} failed")
        self.forget(seq_id, after=pos)
        self.seconds += time.perf_counter() - t0
        return True

    def forget(self, seq_id: int, after: int | None = None) -> None:
        """Drop ``seq_id``'s snapshots (only those ending after ``after`` when given)."""
        if after is None:
            self._by_seq.pop(seq_id, None)
            return
        snaps = self._by_seq.get(seq_id)
        if snaps:
            for p in [p for p in snaps if p > after]:
                del snaps[p]

    def clear(self) -> None:
        self._by_seq.clear()
