"""Node identities and the v2 link handshake (kvasir.core.identity, kvasir.ring.secure), over real loopback TCP."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest
import trio
import trio.testing

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity, PublicKey, create_identity, load_identity, load_or_create_identity
from kvasir.ring.secure import (
    AUTH,
    MAGIC,
    MAX_CERT_BYTES,
    Credentials,
    KeyPolicy,
    LinkAuthError,
    Refusal,
    accept_secure,
    dial_secure,
)
from tests.streams import Tap


def test_identity_file_is_private_and_never_replaced(tmp_path: Path) -> None:
    path = tmp_path / "d" / "identity.pem"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_identity(path).public == first.public
    assert create_identity(path).public == first.public  # a second creator loads, never overwrites
    assert len(first.node_id) == 16 and first.node_id == first.public.fingerprint
    os.chmod(path, 0o644)
    with pytest.raises(InputError, match="readable by others"):
        load_identity(path)
    path.write_bytes(b"not a key")
    os.chmod(path, 0o600)
    with pytest.raises(InputError, match="not an unencrypted PEM"):
        load_identity(path)


def test_public_key_text_round_trip_and_errors() -> None:
    key = Identity.generate().public
    assert PublicKey.from_text(key.to_text()) == key
    for bad in ("", "rsa:AAAA", "ed25519:!!!", "ed25519:AAAA"):
        with pytest.raises(InputError):
            PublicKey.from_text(bad)


async def _link(
    dialer: Credentials, acceptor: Credentials, allowed: set[PublicKey], expected: PublicKey, payload: bytes
) -> tuple[object, object, Tap]:
    """One handshake over real loopback TCP; returns (acceptor outcome, dialer outcome, tap of the dialer's bytes)."""
    results: dict[str, object] = {}
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def acceptor_side() -> None:
        stream = await listeners[0].accept()
        try:
            tls, peer, _ = await accept_secure(stream, acceptor, KeyPolicy(frozenset(allowed)))
            results["acceptor"] = (peer, bytes(await tls.receive_some(1000)))
        except LinkAuthError as exc:
            results["acceptor"] = exc
        finally:
            await stream.aclose()

    tap = Tap(await trio.open_tcp_stream("127.0.0.1", port))

    async def dialer_side() -> None:
        try:
            tls = await dial_secure(tap, dialer, expected)
            await tls.send_all(payload)
            results["dialer"] = "ok"
        except LinkAuthError as exc:
            results["dialer"] = exc

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(acceptor_side)
            nursery.start_soon(dialer_side)
    await tap.aclose()
    await listeners[0].aclose()
    return results["acceptor"], results["dialer"], tap


async def test_members_link_and_the_wire_holds_no_plaintext() -> None:
    a, b = Credentials.of(Identity.generate()), Credentials.of(Identity.generate())
    secret = b"The capital of France is" * 4
    acc, dia, tap = await _link(a, b, {a.identity.public}, b.identity.public, secret)
    assert dia == "ok"
    assert acc == (a.identity.public, secret)
    assert b"capital" not in tap.sent and secret not in tap.sent


async def test_a_stranger_is_refused_before_learning_anything() -> None:
    a, b, stranger = (Credentials.of(Identity.generate()) for _ in range(3))
    acc, dia, tap = await _link(stranger, b, {a.identity.public}, b.identity.public, b"x")
    assert isinstance(acc, LinkAuthError) and acc.refusal is Refusal.UNKNOWN_KEY
    assert isinstance(dia, LinkAuthError)
    # The stranger never saw the acceptor's certificate: no TLS was started.
    assert b.cert_der not in tap.sent


async def test_dialer_detects_the_wrong_acceptor() -> None:
    a, b, impostor = (Credentials.of(Identity.generate()) for _ in range(3))
    # The impostor would accept anyone, but the dialer signed for b's key: its AUTH does not verify at the impostor.
    acc, dia, _ = await _link(a, impostor, {a.identity.public}, b.identity.public, b"x")
    assert isinstance(acc, LinkAuthError) and acc.refusal is Refusal.BAD_SIGNATURE
    assert isinstance(dia, LinkAuthError)


async def test_replayed_auth_is_refused() -> None:
    a, b = Credentials.of(Identity.generate()), Credentials.of(Identity.generate())
    _, dia, tap = await _link(a, b, {a.identity.public}, b.identity.public, b"x")
    assert dia == "ok"
    auth = bytes(tap.sent[: tap.sent.index(b"\x16\x03")])  # AUTH is what the dialer sent before TLS's ClientHello
    assert auth.startswith(MAGIC + bytes([AUTH]))

    left, right = trio.testing.memory_stream_pair()
    outcome: list[BaseException] = []

    async def acceptor_side() -> None:
        try:
            await accept_secure(right, b, KeyPolicy(frozenset({a.identity.public})))
        except LinkAuthError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(acceptor_side)
        await left.receive_some(100)  # a fresh CHALLENGE
        await left.send_all(auth)
    assert isinstance(outcome[0], LinkAuthError) and outcome[0].refusal is Refusal.BAD_SIGNATURE


async def test_oversized_preauth_message_is_refused_without_reading_it() -> None:
    b = Credentials.of(Identity.generate())
    left, right = trio.testing.memory_stream_pair()
    outcome: list[BaseException] = []

    async def acceptor_side() -> None:
        try:
            await accept_secure(right, b, KeyPolicy(frozenset()))
        except LinkAuthError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(acceptor_side)
        await left.receive_some(100)
        await left.send_all(MAGIC + bytes([AUTH]) + struct.pack("<H", MAX_CERT_BYTES + 1))
    assert "size limit" in str(outcome[0])


def test_kvasir_id_creates_once_and_prints_the_same_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvasir.cli import main

    path = tmp_path / "id.pem"
    # A named file that does not exist is a typo until the user says otherwise: no key is made behind their back.
    assert main(["id", "--identity", str(path), "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"identity {path} does not exist" in err and "--create-identity" in err
    assert not path.exists() and not path.parent.joinpath(".id.pem").exists()
    assert main(["id", "--identity", str(path), "--create-identity", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["id", "--identity", str(path), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert first == second and PublicKey.from_text(first["key"]).fingerprint == first["node_id"]
    os.chmod(path, 0o640)
    assert main(["id", "--identity", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "readable by others" in err


async def test_the_secure_handshake_runs_end_to_end_inside_messages() -> None:
    """Over a relay the TLS session runs inside the messages: the middle sees only ciphertext."""
    from kvasir.ring.msgstream import MessageStream

    a, b = Credentials.of(Identity.generate()), Credentials.of(Identity.generate())
    to_b_send, to_b_recv = trio.open_memory_channel[bytes](0)
    to_a_send, to_a_recv = trio.open_memory_channel[bytes](0)
    seen_by_relay: list[bytes] = []

    async def relay_to_b(message: bytes) -> None:
        seen_by_relay.append(message)
        await to_b_send.send(message)

    async def close() -> None:
        pass

    dialer = MessageStream(relay_to_b, to_a_recv.receive, close, closed_errors=(trio.EndOfChannel,))
    acceptor = MessageStream(to_a_send.send, to_b_recv.receive, close, closed_errors=(trio.EndOfChannel,))
    secret = b"my card PIN is 4921" * 100  # spans several TLS records
    got: list[bytes] = []

    async def accept() -> None:
        tls, peer, _ = await accept_secure(acceptor, b, KeyPolicy(frozenset({a.identity.public})))
        assert peer == a.identity.public
        data = b""
        while len(data) < len(secret):
            data += await tls.receive_some()
        got.append(data)

    async def dial() -> None:
        tls = await dial_secure(dialer, a, b.identity.public)
        await tls.send_all(secret)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept)
            nursery.start_soon(dial)
    assert got == [secret]
    assert not any(b"PIN" in message for message in seen_by_relay)
