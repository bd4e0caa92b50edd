"""The link handshake: each end sends :class:`Hello` first and refuses a neighbour that cannot join it."""

from __future__ import annotations

import enum

from kvasir.core.errors import RingError
from kvasir.wire.boundary import BoundaryDType
from kvasir.wire.frames import BOUNDARY_FIXED_SIZE, CHAIN_BYTES, HEADER_SIZE, MAX_BOUNDARY_TOKENS, ErrorCode, Hello


class Side(enum.Enum):
    """Where the remote node sits relative to the local one."""

    PREDECESSOR = "predecessor"  # it sends us boundaries / tokens
    SUCCESSOR = "successor"  # we send it boundaries / tokens


def neighbour_problem(local: Hello, remote: Hello, side: Side) -> tuple[ErrorCode, str] | None:
    """Why ``remote`` cannot be ``local``'s neighbour on ``side``: the ERROR code to send and a reason, or None.

    Pure: both HELLOs are already valid frames (ranks inside the ring, windows inside the model); this checks
    that they describe the same model and that the windows join in ring order, wrapping from the last rank to
    rank 0.
    """
    who = f"{side.value} {remote.node_id!r} (rank {remote.rank})"
    if remote.model_id != local.model_id:
        return ErrorCode.MODEL_MISMATCH, f"{who} serves model {remote.model_id!r}, this node {local.model_id!r}"
    for field in ("n_layers", "n_embd"):
        theirs, ours = getattr(remote, field), getattr(local, field)
        if theirs != ours:
            return ErrorCode.MODEL_MISMATCH, f"{who} reports {field} {theirs}, this node has {ours}"
    if remote.ring_size != local.ring_size:
        return ErrorCode.WINDOW_MISMATCH, f"{who} reports ring_size {remote.ring_size}, this node has {local.ring_size}"
    if local.ring_size > 1 and remote.node_id == local.node_id:
        return ErrorCode.WINDOW_MISMATCH, f"{who} has this node's own node id"
    for hello, name in ((local, "this node"), (remote, who)):
        if hello.rank == 0 and hello.window_start != 0:
            return ErrorCode.WINDOW_MISMATCH, f"{name} is rank 0 but its window starts at layer {hello.window_start}"
        if hello.rank == hello.ring_size - 1 and hello.window_end != hello.n_layers:
            return ErrorCode.WINDOW_MISMATCH, (
                f"{name} is the last rank but its window ends at layer {hello.window_end}, not {hello.n_layers}"
            )
    first, second = (remote, local) if side is Side.PREDECESSOR else (local, remote)
    expected = (first.rank + 1) % local.ring_size
    if second.rank != expected:
        return ErrorCode.WINDOW_MISMATCH, (
            f"{who} does not follow in ring order: rank {first.rank} must be followed by rank {expected},"
            f" not {second.rank}"
        )
    if second.rank != 0 and second.window_start != first.window_end:
        return ErrorCode.WINDOW_MISMATCH, (
            f"{who} does not join: window [{first.window_start},{first.window_end}) is followed by"
            f" [{second.window_start},{second.window_end})"
        )
    return None


def check_neighbour(local: Hello, remote: Hello, side: Side) -> None:
    """Raise :class:`RingError` with the reason ``remote`` cannot be ``local``'s neighbour on ``side``."""
    problem = neighbour_problem(local, remote, side)
    if problem is not None:
        raise RingError(problem[1])


def choose_dtype(preferred: BoundaryDType, receiver: Hello) -> BoundaryDType:
    """The boundary dtype to send: ``preferred`` if the receiver accepts it, else f32 (always accepted)."""
    return preferred if preferred in receiver.dtypes else BoundaryDType.F32


def max_chunk_tokens(max_frame_bytes: int, n_embd: int, dtype: BoundaryDType) -> int:
    """How many tokens one BOUNDARY frame may carry under the receiver's frame limit (0 if not even one), with room
    for a chain head (FLAG_CHAIN) after the payload."""
    room = max_frame_bytes - HEADER_SIZE - BOUNDARY_FIXED_SIZE - CHAIN_BYTES
    return max(0, min(MAX_BOUNDARY_TOKENS, room // (n_embd * dtype.itemsize)))
