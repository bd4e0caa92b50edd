"""Bounds-checked little-endian body cursor and writer shared by every frame codec.

Every read names the field it reads, so a malformed frame yields one precise line such as
``START frame: body truncated reading stop[2] (need 7 bytes, 3 left)``.
"""

from __future__ import annotations

import struct
from typing import Any

from kvasir.core.errors import ProtocolError

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")

U32_MAX = 0xFFFF_FFFF
I32_MAX = 0x7FFF_FFFF


class BodyReader:
    """Reads one frame body front to back; raises :class:`ProtocolError` on any overrun."""

    __slots__ = ("_buf", "_kind", "_pos")

    def __init__(self, kind: str, body: bytes | bytearray | memoryview) -> None:
        self._kind = kind
        self._buf = memoryview(body)
        self._pos = 0

    def fail(self, reason: str) -> ProtocolError:
        return ProtocolError(f"{self._kind} frame: {reason}")

    @property
    def remaining(self) -> int:
        return len(self._buf) - self._pos

    def take(self, n: int, field: str) -> memoryview:
        if n > self.remaining:
            raise self.fail(f"body truncated reading {field} (need {n} bytes, {self.remaining} left)")
        view = self._buf[self._pos : self._pos + n]
        self._pos += n
        return view

    def unpack(self, fmt: struct.Struct, field: str) -> tuple[Any, ...]:
        # Any: each caller knows its format's field types; the frame's own validation checks the values.
        return fmt.unpack(self.take(fmt.size, field))

    def u8(self, field: str) -> int:
        value: int = _U8.unpack(self.take(1, field))[0]
        return value

    def u16(self, field: str) -> int:
        value: int = _U16.unpack(self.take(2, field))[0]
        return value

    def u32(self, field: str) -> int:
        value: int = _U32.unpack(self.take(4, field))[0]
        return value

    def text(self, field: str, max_bytes: int) -> str:
        """A u16 byte length followed by that many UTF-8 bytes; the length is checked before the bytes."""
        n = self.u16(f"{field} length")
        if n > max_bytes:
            raise self.fail(f"{field} is {n} bytes (limit {max_bytes})")
        raw = self.take(n, field)
        try:
            return bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{field} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def reserved(self, value: bytes) -> None:
        # Reserved bytes must be zero so a later version can give them a meaning without ambiguity.
        if any(value):
            raise self.fail(f"reserved bytes {value.hex()} must be zero")

    def finish(self) -> None:
        if self.remaining:
            raise self.fail(f"{self.remaining} unexpected trailing bytes after the last field")


def pack_text(value: str) -> bytes:
    raw = value.encode("utf-8")
    return _U16.pack(len(raw)) + raw
