"""Boundary payload codecs: float32 hidden states to and from f32 / f16 / bf16 wire bytes.

f32 is the default because it is bit-exact (the stage recipe is bit-exact end to end, so anything else is a
choice to lose precision). f16 and bf16 halve the bytes; :func:`measure_divergence` measures what they cost on
a real hidden state before anyone offers them.
"""

from __future__ import annotations

import enum
import math

import attrs
import numpy as np
import numpy.typing as npt

from kvasir.core.errors import ProtocolError, ShapeError

F32Array = npt.NDArray[np.float32]


class BoundaryDType(enum.IntEnum):
    """Wire code of a boundary payload's element type."""

    F32 = 0
    F16 = 1
    BF16 = 2

    @property
    def itemsize(self) -> int:
        return 4 if self is BoundaryDType.F32 else 2


_F16_MAX = float(np.finfo(np.float16).max)


def _check_array(array: np.ndarray) -> F32Array:
    if array.dtype != np.float32:
        # Silently narrowing float64 would break the bit-exact guarantee of f32 on the wire.
        raise ShapeError(f"boundary array must be float32, got {array.dtype}")
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ShapeError(f"boundary array must be 2-D (n_tokens, n_embd) and non-empty, got shape {array.shape}")
    return array


def _to_bf16_bits(array: F32Array) -> npt.NDArray[np.uint16]:
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4")
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate.
    rounded = (bits + (((bits >> 16) & 1) + np.uint32(0x7FFF))) >> 16
    # NaN must stay NaN (rounding could carry a NaN payload into infinity): keep the sign, force a quiet bit.
    quiet_nan = (bits >> 16) | np.uint32(0x0040)
    out: npt.NDArray[np.uint16] = np.where(np.isnan(array), quiet_nan, rounded).astype("<u2")
    return out


def encode_boundary(array: np.ndarray, dtype: BoundaryDType = BoundaryDType.F32) -> bytes:
    """Encode a float32 ``(n_tokens, n_embd)`` array as little-endian payload bytes of ``dtype``.

    Raises :class:`ShapeError` for a non-float32 or non-2-D array, and :class:`ProtocolError` when a finite
    value does not fit f16 (it would arrive as infinity; send bf16 or f32 instead).
    """
    arr = _check_array(array)
    if dtype is BoundaryDType.F32:
        return np.ascontiguousarray(arr, dtype="<f4").tobytes()
    if dtype is BoundaryDType.F16:
        with np.errstate(over="ignore"):
            half = np.ascontiguousarray(arr, dtype="<f2")
        overflow = np.isinf(half) & np.isfinite(arr)
        if overflow.any():
            worst = float(np.max(np.abs(arr[overflow])))
            raise ProtocolError(
                f"boundary value {worst:g} exceeds the f16 range (±{_F16_MAX:g}); send bf16 or f32 instead"
            )
        return half.tobytes()
    return _to_bf16_bits(arr).tobytes()


def decode_boundary(payload: bytes, n_tokens: int, n_embd: int, dtype: BoundaryDType) -> F32Array:
    """Decode payload bytes into a float32 ``(n_tokens, n_embd)`` array.

    For f32 the result is a read-only view of ``payload`` (no copy); f16/bf16 give a fresh array.
    """
    expected = n_tokens * n_embd * dtype.itemsize
    if len(payload) != expected:
        raise ProtocolError(
            f"BOUNDARY frame: payload is {len(payload)} bytes, expected {n_tokens}x{n_embd}x{dtype.itemsize}"
            f" = {expected}"
        )
    if dtype is BoundaryDType.F32:
        flat: F32Array = np.frombuffer(payload, dtype="<f4").astype(np.float32, copy=False)
    elif dtype is BoundaryDType.F16:
        flat = np.frombuffer(payload, dtype="<f2").astype(np.float32)
    else:
        flat = (np.frombuffer(payload, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return flat.reshape(n_tokens, n_embd)


@attrs.frozen
class Divergence:
    """How far a lossy wire dtype moves an array from its float32 values."""

    dtype: BoundaryDType
    max_abs: float  # max |decoded - original| over finite elements; inf if any value overflowed
    max_rel: float  # max_abs divided by max |original| (0 when the array is all zeros)
    max_value: float  # max |original|, to judge max_abs against
    overflowed: int  # finite elements that became infinite (f16 only)


def measure_divergence(array: np.ndarray, dtype: BoundaryDType) -> Divergence:
    """Round-trip ``array`` through ``dtype`` on the wire and report the largest error it introduced."""
    arr = _check_array(array)
    if dtype is BoundaryDType.F16:
        with np.errstate(over="ignore"):
            back = arr.astype(np.float16).astype(np.float32)
    else:
        back = decode_boundary(encode_boundary(arr, dtype), arr.shape[0], arr.shape[1], dtype)
    finite = np.isfinite(arr)
    overflowed = int(np.count_nonzero(finite & ~np.isfinite(back)))
    max_value = float(np.max(np.abs(arr[finite]), initial=0.0))
    if overflowed:
        max_abs = math.inf
    else:
        diff = np.abs(back[finite].astype(np.float64) - arr[finite].astype(np.float64))
        max_abs = float(np.max(diff, initial=0.0))
    max_rel = max_abs / max_value if max_value else 0.0
    return Divergence(dtype, max_abs, max_rel, max_value, overflowed)
