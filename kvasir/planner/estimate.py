"""The cost model: what a window needs in memory, what a token costs, and the rank manifest that reports it.

Decode is memory-bandwidth bound, so a rank's time per token is the bytes its token reads divided by the
device's memory bandwidth; a hop costs both ends' link latencies plus the payload over the slower link, plus what
the receiving node's software adds to each frame. See docs/planner.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvasir.core.errors import WindowError
from kvasir.planner.devices import Device
from kvasir.planner.profile import ModelProfile
from kvasir.planner.rules import allowed_boundaries, padding_layers

DEFAULT_N_CTX = 4096
# llama.cpp runtime, compute-graph buffers, boundary buffers and allocator slack; a guess that has to cover a
# phone's process overhead too, so it errs high.
RESERVE_BYTES = 500_000_000
# Last rank: logits plus the sampler's candidate array (id, logit, p) per vocabulary entry.
LOGITS_BYTES_PER_VOCAB = 16
# The token frame the last rank sends to rank 0 (header plus one token id).
TOKEN_FRAME_BYTES = 64
_F32 = 4


@attrs.frozen
class WindowCost:
    """Device-independent cost of one window ``[start, stop)``."""

    start: int
    stop: int
    padding: tuple[int, ...]  # layers whose identity copies pad the window
    weight_bytes: int  # layers + padding + edge tensors the rank holds
    overhead_bytes: int  # KV cache + recurrent state + logits + RESERVE_BYTES
    active_bytes: int  # bytes one decoded token reads on this rank

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.overhead_bytes


def window_cost(profile: ModelProfile, start: int, stop: int, *, n_ctx: int, n_seq: int = 1) -> WindowCost:
    """Memory and per-token bytes of the window ``[start, stop)`` wherever it runs."""
    pads = padding_layers(profile, start, stop)
    layers = [profile.layers[i] for i in (*range(start, stop), *pads)]
    first, last = start == 0, stop == profile.n_layers
    weights = sum(layer.bytes for layer in layers) + profile.other_bytes
    active = sum(layer.active_bytes for layer in layers)
    if first:
        weights += profile.embd_bytes  # the token-embedding lookup: held, but one row read per token
    if last:
        weights += profile.head_bytes  # output head: held and read in full every token
        active += profile.head_bytes
    if first and last and profile.tied_head:
        weights -= profile.embd_bytes  # one rank, one copy of the tied matrix
    overhead = RESERVE_BYTES
    overhead += n_ctx * sum(layer.kv_bytes_per_token for layer in layers)
    overhead += n_seq * sum(layer.state_bytes for layer in layers)
    if last:
        overhead += profile.vocab_size * LOGITS_BYTES_PER_VOCAB
    return WindowCost(start, stop, pads, weights, overhead, active)


def compute_ms(device: Device, active_bytes: int) -> float:
    return active_bytes / (device.mem_bandwidth_gbs * 1e9) * 1e3


def hop_ms(src: Device, dst: Device, payload_bytes: int) -> float:
    """One message from ``src`` to ``dst``: it crosses both devices' links, at the slower one's bandwidth, and the
    node on ``dst`` wakes to it and hands it to its stage (``hop_overhead_ms``)."""
    if src.name == dst.name:
        return 0.0  # a ring of one: the token never leaves the process
    return src.link_latency_ms + dst.link_latency_ms + transfer_ms(src, dst, payload_bytes) + dst.hop_overhead_ms


def transfer_ms(src: Device, dst: Device, payload_bytes: int) -> float:
    """How long one message occupies the hop's slower link: what limits a link's throughput (latency does not)."""
    if src.name == dst.name:
        return 0.0
    return payload_bytes * 8 / (min(src.link_bandwidth_mbps, dst.link_bandwidth_mbps) * 1e6) * 1e3


def boundary_bytes(profile: ModelProfile) -> int:
    """One decoded token's hidden state, f32 on the wire."""
    return profile.n_embd * _F32


@attrs.frozen
class RankWindow:
    """One rank of a plan."""

    rank: int
    device: Device
    start: int
    stop: int  # exclusive
    padding: tuple[int, ...]
    weight_bytes: int
    memory_bytes: int
    compute_ms: float
    hop_ms: float  # to the next rank (for the last rank: the token back to rank 0)
    next_device: str
    transfer_ms: float = 0.0  # of hop_ms, the time the message occupies the link (bandwidth, not latency)

    @property
    def n_layers(self) -> int:
        return self.stop - self.start

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.device.memory_bytes


@attrs.frozen
class UnusedDevice:
    device: Device
    reason: str


@attrs.frozen
class RankManifest:
    """A plan: contiguous windows over a ring of devices, with the estimate that chose it."""

    model: str
    arch: str
    n_layers: int
    n_embd: int
    n_ctx: int
    n_seq: int
    windows: tuple[RankWindow, ...]
    unused: tuple[UnusedDevice, ...] = ()
    objective: str = "latency"  # what chose the windows: "latency" or "throughput" (kvasir.planner.solve)

    @property
    def compute_ms(self) -> float:
        return sum(w.compute_ms for w in self.windows)

    @property
    def link_ms(self) -> float:
        return sum(w.hop_ms for w in self.windows)

    @property
    def ms_per_token(self) -> float:
        return self.compute_ms + self.link_ms

    @property
    def est_tokens_per_s(self) -> float:
        return 1e3 / self.ms_per_token if self.ms_per_token > 0 else float("inf")

    @property
    def bottleneck_ms(self) -> float:
        """The busiest resource's time per token (a rank's compute or a link's transfer): with enough requests in
        flight the stages pipeline and the ring's total throughput is bounded by ``1000 / bottleneck_ms``."""
        return max(max(w.compute_ms, w.transfer_ms) for w in self.windows)

    @property
    def est_loaded_tokens_per_s(self) -> float:
        return 1e3 / self.bottleneck_ms if self.bottleneck_ms > 0 else float("inf")

    @property
    def fits(self) -> bool:
        return all(w.fits for w in self.windows)

    def to_json(self) -> dict[str, Any]:
        """The ``kvasir plan --json`` document."""
        return {
            "model": self.model,
            "arch": self.arch,
            "n_layers": self.n_layers,
            "n_ctx": self.n_ctx,
            "n_seq": self.n_seq,
            "objective": self.objective,
            "windows": [
                {
                    "rank": w.rank,
                    "device": w.device.name,
                    "kind": w.device.kind,
                    "layers": [w.start, w.stop],
                    "padding": list(w.padding),
                    "bytes": w.weight_bytes,
                    "memory_bytes": w.memory_bytes,
                    "budget_bytes": w.device.memory_bytes,
                    "compute_ms": round(w.compute_ms, 4),
                    "hop_ms": round(w.hop_ms, 4),
                    "next": w.next_device,
                    "key": w.device.key,  # null: the slot for the device's `kvasir id` key
                }
                for w in self.windows
            ],
            "est_tokens_per_s": round(self.est_tokens_per_s, 3),
            "ms_per_token": round(self.ms_per_token, 4),
            "compute_ms": round(self.compute_ms, 4),
            "link_ms": round(self.link_ms, 4),
            "bottleneck_ms": round(self.bottleneck_ms, 4),
            "est_loaded_tokens_per_s": round(self.est_loaded_tokens_per_s, 3),
            "unused": [{"device": u.device.name, "reason": u.reason} for u in self.unused],
        }


def estimate(
    profile: ModelProfile,
    assignment: Sequence[tuple[Device, int, int]],
    *,
    n_ctx: int = DEFAULT_N_CTX,
    n_seq: int = 1,
    unused: Sequence[UnusedDevice] = (),
    objective: str = "latency",
) -> RankManifest:
    """Score a given ring: ``(device, start, stop)`` per rank, in ring order from rank 0.

    Raises :class:`WindowError` unless the windows are non-empty, contiguous, cut only at allowed boundaries
    and cover every layer exactly once. Memory is reported, not enforced (see :attr:`RankManifest.fits`).
    """
    if not assignment:
        raise WindowError("a plan needs at least one window")
    allowed = allowed_boundaries(profile)
    expected = 0
    for device, start, stop in assignment:
        if start != expected:
            raise WindowError(f"window [{start}, {stop}) on {device.name} does not start at layer {expected}")
        if stop <= start:
            raise WindowError(f"window [{start}, {stop}) on {device.name} is empty")
        if stop < profile.n_layers and stop not in allowed:
            raise WindowError(f"{profile.arch} may not be cut after layer {stop - 1}")
        expected = stop
    if expected != profile.n_layers:
        raise WindowError(f"windows cover layers [0, {expected}) of {profile.n_layers}")
    names = [device.name for device, _, _ in assignment]
    if len(set(names)) != len(names):
        raise WindowError("a device appears twice in the ring")

    windows: list[RankWindow] = []
    for rank, (device, start, stop) in enumerate(assignment):
        nxt = assignment[(rank + 1) % len(assignment)][0]
        last = rank == len(assignment) - 1
        payload = TOKEN_FRAME_BYTES if last else boundary_bytes(profile)
        cost = window_cost(profile, start, stop, n_ctx=n_ctx, n_seq=n_seq)
        windows.append(
            RankWindow(
                rank=rank,
                device=device,
                start=start,
                stop=stop,
                padding=cost.padding,
                weight_bytes=cost.weight_bytes,
                memory_bytes=cost.memory_bytes,
                compute_ms=compute_ms(device, cost.active_bytes),
                hop_ms=hop_ms(device, nxt, payload),
                next_device=nxt.name,
                transfer_ms=transfer_ms(device, nxt, payload),
            )
        )
    return RankManifest(
        model=profile.name,
        arch=profile.arch,
        n_layers=profile.n_layers,
        n_embd=profile.n_embd,
        n_ctx=n_ctx,
        n_seq=n_seq,
        windows=tuple(windows),
        unused=tuple(unused),
        objective=objective,
    )
