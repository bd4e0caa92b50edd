"""Frames over byte streams: sans-IO :class:`FrameDecoder`, trio :class:`FrameReader`.

The decoder validates each header the moment its bytes are complete and refuses an oversized or malformed
frame before buffering its body, so a hostile peer can make a node hold at most one read chunk past a header.
"""

from __future__ import annotations

import trio

from kvasir.core.errors import ProtocolError
from kvasir.wire.frames import (
    HEADER_SIZE,
    MAX_FRAME_BYTES,
    MIN_FRAME_LIMIT,
    Frame,
    FrameHeader,
    check_header_prefix,
    decode_body,
    decode_header,
)

#: Largest single ``receive_some`` a reader asks for; bounds what one read can buffer past a header.
READ_CHUNK = 1 << 20
#: Smallest read, so a stream of small frames is not read a header at a time.
MIN_READ = 1 << 16


class FrameDecoder:
    """Feed bytes in any fragmentation, get whole validated frames out.

    After the first :class:`ProtocolError` the decoder stays failed: a stream that lost frame sync cannot be
    trusted again, so the link must close.
    """

    def __init__(self, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < MIN_FRAME_LIMIT:
            raise ValueError(f"max_frame_bytes must be at least {MIN_FRAME_LIMIT}")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._header: FrameHeader | None = None
        self._failed: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a whole frame."""
        return len(self._buf)

    def wanted(self) -> int:
        """Bytes still missing to complete the frame in progress (the header first)."""
        if self._header is None:
            return HEADER_SIZE - len(self._buf)
        return self._header.frame_length - len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Append ``data`` and return every frame it completed, in order."""
        if self._failed is not None:
            raise ProtocolError(f"decoder already failed: {self._failed}")
        self._buf += data
        frames: list[Frame] = []
        try:
            while True:
                if self._header is None:
                    if len(self._buf) < HEADER_SIZE:
                        check_header_prefix(self._buf)  # refuse a non-Kvasir peer on its first bytes
                        break
                    self._header = decode_header(self._buf, max_frame_bytes=self.max_frame_bytes)
                end = self._header.frame_length
                if len(self._buf) < end:
                    break
                # Swap buffers rather than resize in place: views of the old one may outlive this call (a
                # traceback's locals), and a bytearray with live views cannot be resized.
                frame_buf, self._buf = self._buf, self._buf[end:]
                header, self._header = self._header, None
                frames.append(decode_body(header, memoryview(frame_buf)[HEADER_SIZE:end]))
        except ProtocolError as exc:
            self._failed = exc
            self._buf = bytearray()
            raise
        return frames

    def eof(self) -> None:
        """The stream ended: an error if it ended inside a frame."""
        if self._buf:
            raise ProtocolError(
                f"stream ended inside a frame ({len(self._buf)} bytes buffered, {self.wanted()} more expected)"
            )


class FrameReader(trio.abc.ReceiveChannel[Frame]):
    """Whole frames from a :class:`trio.abc.ReceiveStream`.

    ``receive()`` raises :class:`trio.EndOfChannel` on a clean end of stream, :class:`ProtocolError` on a
    malformed frame or an end inside one; transport errors of the stream pass through unchanged.
    """

    def __init__(self, stream: trio.abc.ReceiveStream, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(max_frame_bytes=max_frame_bytes)
        self._ready: list[Frame] = []
        self._busy = False
        #: Bytes read from the stream so far (for link statistics).
        self.bytes_received = 0

    @property
    def max_frame_bytes(self) -> int:
        return self._decoder.max_frame_bytes

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        """Raise the limit once a peer is trusted (a handshake-sized limit before that)."""
        self._decoder.max_frame_bytes = value

    async def receive(self) -> Frame:
        if self._busy:
            raise trio.BusyResourceError("another task is already receiving frames from this reader")
        self._busy = True
        try:
            while not self._ready:
                # Read roughly what the frame in progress needs: a header is checked before much of its body
                # can pile up, small frames cost few reads, and a big boundary still arrives in large reads.
                want = min(max(self._decoder.wanted(), MIN_READ), READ_CHUNK)
                data = await self.stream.receive_some(want)
                if not data:
                    self._decoder.eof()
                    raise trio.EndOfChannel
                self.bytes_received += len(data)
                self._ready.extend(self._decoder.feed(data))
            return self._ready.pop(0)
        finally:
            self._busy = False

    async def aclose(self) -> None:
        await self.stream.aclose()
