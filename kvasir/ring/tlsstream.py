"""A lean TLS stream for ring links: ``ssl.SSLObject`` over memory BIOs, batching records per read.

``trio.SSLStream`` hands out at most one TLS record (16 KiB) per ``receive_some`` and pays its general-purpose
locking and checkpoints for each, which cut a ring link's bulk throughput to about a sixth of plain TCP in
bench/link_crypto.py. A ring link needs less generality: TLS 1.3 only (no renegotiation), one task sending and
one receiving. This stream decrypts every complete record already received in one call, and encrypts a whole
frame in one write.
"""

from __future__ import annotations

import contextlib
import ssl

import trio

#: How much ciphertext one transport read asks for.
READ_BYTES = 1 << 18


class TLSStream(trio.abc.Stream):
    """TLS 1.3 over ``transport``; call :meth:`do_handshake` first. One sender and one receiver at a time."""

    def __init__(self, transport: trio.abc.Stream, context: ssl.SSLContext, *, server_side: bool) -> None:
        self.transport = transport
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side)
        self._send_lock = trio.Lock()  # ciphertext of one write goes out whole, before the next
        self._eof = False

    def getpeercert(self, binary_form: bool = True) -> bytes | None:
        """The peer's certificate (DER), verified or not: the caller pins its key."""
        return self._ssl.getpeercert(binary_form=True)

    async def _flush(self) -> None:
        data = self._outgoing.read()
        if data:
            async with self._send_lock:
                await self.transport.send_all(data)

    async def _refill(self) -> bool:
        data = await self.transport.receive_some(READ_BYTES)
        if not data:
            self._incoming.write_eof()
            return False
        self._incoming.write(data)
        return True

    async def do_handshake(self) -> None:
        while True:
            try:
                self._ssl.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._refill():
                    raise trio.BrokenResourceError("peer closed during the TLS handshake") from None
                continue
            except ssl.SSLError as exc:
                await self._flush()  # the alert tells the peer why
                raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc
            await self._flush()
            return

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            self._ssl.write(data)  # into a memory BIO: never blocks, encrypts every record at once
        except ssl.SSLError as exc:
            raise trio.BrokenResourceError(f"TLS write failed: {exc}") from exc
        await self._flush()

    async def wait_send_all_might_not_block(self) -> None:
        await self.transport.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        limit = READ_BYTES if max_bytes is None else max_bytes
        while True:
            chunks: list[bytes] = []
            size = 0
            try:
                while size < limit:
                    chunk = self._ssl.read(limit - size)
                    if not chunk:  # close_notify
                        self._eof = True
                        break
                    chunks.append(chunk)
                    size += len(chunk)
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLEOFError:
                self._eof = True  # the transport ended without close_notify: truncation, treated as an end
            except ssl.SSLError as exc:
                raise trio.BrokenResourceError(f"TLS read failed: {exc}") from exc
            await self._flush()  # post-handshake messages (session tickets) may want an answer
            if chunks:
                return b"".join(chunks)
            if self._eof or not await self._refill():
                return b""
            await trio.lowlevel.checkpoint_if_cancelled()

    async def aclose(self) -> None:
        try:
            if not self._eof:
                with contextlib.suppress(ssl.SSLError):
                    self._ssl.unwrap()  # queues our close_notify
                with trio.move_on_after(1), contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self._flush()
        finally:  # cancelled while flushing (a node stopping): the socket is closed all the same
            await self.transport.aclose()
