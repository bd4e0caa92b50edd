"""TLS for the market and the model source (issue 11 (7)): real certificates made with ``cryptography``, real
processes on loopback. A node enrolls over https (market and source) when it trusts the CA; a client given the
wrong CA, or none for a private CA, is refused with one line that says how to fix it."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvasir.core.errors import InputError, MarketError
from kvasir.market.agent.client import MarketClient
from kvasir.util.tls import client_context, server_context
from tests.marketutil import Proc, procs, wait_for


def make_ca(tmp: Path, name: str) -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA (PEM at ``tmp/name.pem``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvasir test {name}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )  # keyCertSign, cRLSign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    path = tmp / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def make_server_cert(tmp: Path, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate) -> tuple[Path, Path]:
    """A leaf certificate for 127.0.0.1 and localhost signed by ``ca``: (cert.pem, key.pem)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "server.pem", tmp / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture
def pki(tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """(ca.pem, server cert, server key, another CA that signed nothing here)."""
    ca_path, ca_key, ca = make_ca(tmp_path, "ca")
    cert, key = make_server_cert(tmp_path, ca_key, ca)
    other, _, _ = make_ca(tmp_path, "other-ca")
    return ca_path, cert, key, other


@pytest.mark.slow
def test_node_enrolls_over_https_and_a_wrong_ca_is_refused_in_one_line(
    tiny_model: Callable[..., Path], tmp_path: Path, pki: tuple[Path, Path, Path, Path]
) -> None:
    ca, cert, key, other = pki
    model = tiny_model("llama", "q8_0")
    tls = ("--tls-cert", str(cert), "--tls-key", str(key))
    with procs() as ps:
        operator = ("--identity", str(tmp_path / "operator.pem"), "--create-identity")
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "m.sqlite"), *operator, *tls)
        seeder = Proc("serve-model", str(model), "--listen", "127.0.0.1:0", *tls)
        ps += [market, seeder]
        url = market.wait_line(r"listening on (https://\S+)").group(1)
        source = seeder.wait_line(r"serving (https://\S+)").group(1)
        # a plain-http client gets nothing from the TLS port
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https://", "http://") + "/v1/coverage", timeout=5)

        # the publisher and `market status` verify with the CA; without it they stop with one line
        windows = ("--windows", "0:3,3:6")
        pub = Proc("market", "publish", str(model), "--url", url, "--source", source, *windows, *operator)
        assert pub.wait(120) == 2
        assert len(pub.err) == 1 and "TLS certificate not trusted" in pub.err[0] and "--market-ca" in pub.err[0]
        pub = Proc(
            "market", "publish", str(model), "--url", url, "--source", source, *windows, "--market-ca", str(ca),
            *operator,
        )  # fmt: skip
        assert pub.wait(120) == 0, pub.err

        # a node trusting another CA refuses the market: exit 2, one line, nothing claimed
        wrong = Proc("node", "--market", url, "--market-ca", str(other), "--memory-budget", "1MB", "--lease", "2")
        assert wrong.wait(60) == 2
        assert not any("Traceback" in line for line in wrong.err), wrong.err  # after its start-up log line: one line
        assert "error: market https://" in wrong.err[-1] and "TLS certificate not trusted" in wrong.err[-1], wrong.err
        assert "--market-ca" in wrong.err[-1]

        # nodes with the CA enroll over https: claim, fetch their windows from the https source, serve
        flags = ("--market-ca", str(ca), "--memory-budget", "1MB", "--lease", "2", "--poll", "0.3", "--threads", "1")
        nodes = []
        for i in range(2):
            where = ("--control", str(tmp_path / f"n{i}.sock"), "--stage-dir", str(tmp_path / f"stages{i}"))
            nodes.append(Proc("node", "--market", url, *flags, "--seed", str(i), "--ctx", "256", *where))
        ps += nodes
        for node in nodes:
            node.wait_line(r"^kvasir node: enrolled", timeout=120)

        def live() -> bool:
            r = httpx.get(f"{url}/v1/coverage", verify=client_context(ca), timeout=10)
            return bool(r.json()["models"][0]["live"])

        wait_for(live, 60, "coverage over https")
        status = Proc("market", "status", "--url", url, "--market-ca", str(ca))
        assert status.wait(60) == 0, status.err
        assert "2/2 windows covered, live" in "\n".join(status.out)


async def test_market_client_refuses_a_wrong_ca(tmp_path: Path, pki: tuple[Path, Path, Path, Path]) -> None:
    """In process: the shared HTTP server speaks TLS; the client's error names the cause and the flag."""
    from kvasir.core.identity import Identity
    from kvasir.market.server.service import serve_market

    ca, cert, key, other = pki
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                tmp_path / "m.sqlite",
                "127.0.0.1",
                0,
                identity=Identity.generate(),
                tls=server_context(cert, key),
                task_status=task_status,
            )
        )
        url = f"https://127.0.0.1:{port}"
        async with MarketClient(url, tls=client_context(ca)) as good:
            assert (await good.status())["coverage"]["models"] == []
        async with MarketClient(url, tls=client_context(other)) as bad:
            with pytest.raises(MarketError, match=r"TLS certificate not trusted .*--market-ca") as info:
                await bad.status()
            assert info.value.code == "tls" and "\n" not in str(info.value)
        nursery.cancel_scope.cancel()


def test_tls_setup_errors_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot load the TLS certificate"):
        server_context(tmp_path / "missing.pem", tmp_path / "missing.key")
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(InputError, match="cannot load the CA bundle"):
        client_context(tmp_path / "junk.pem")
    assert isinstance(client_context(), ssl.SSLContext)


async def test_window_fetch_over_https_verifies_the_source(
    tiny_model: Callable[..., Path], tmp_path: Path, pki: tuple[Path, Path, Path, Path]
) -> None:
    """The model seeder on TLS; the window fetcher verifies it (a wrong CA: a one-line SourceError, nothing
    written)."""
    from kvasir.net.seed import serve_model
    from kvasir.shard.cache import file_sha256
    from kvasir.shard.fetch import SourceError, fetch_window

    ca, cert, key, other = pki
    model = tiny_model("llama", "q8_0")
    sha = file_sha256(model)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_model(
                model, sha, "127.0.0.1", 0, tls=server_context(cert, key), task_status=task_status
            )
        )
        url = f"https://127.0.0.1:{port}/{model.name}"
        out = tmp_path / "stage.gguf"
        with pytest.raises(SourceError, match="TLS certificate not trusted") as info:
            await fetch_window(url, 0, 2, out, tls=client_context(other))
        assert "\n" not in str(info.value) and not out.exists()
        result = await fetch_window(url, 0, 2, out, tls=client_context(ca))
        assert out.is_file() and result.window_bytes > 0
        nursery.cancel_scope.cancel()


async def test_an_oversized_body_gets_its_413_over_tls(tmp_path: Path, pki: tuple[Path, Path, Path, Path]) -> None:
    """TLS cannot half-close: the server drains what the client still sends, so the client reads the 413 instead
    of a reset connection."""
    from kvasir.core.identity import Identity
    from kvasir.market.server.service import MARKET_LIMITS, serve_market

    ca, cert, key, _ = pki
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                tmp_path / "m.sqlite",
                "127.0.0.1",
                0,
                identity=Identity.generate(),
                tls=server_context(cert, key),
                task_status=task_status,
            )
        )
        async with httpx.AsyncClient(verify=client_context(ca), timeout=30) as client:
            body = b"x" * (2 * MARKET_LIMITS.max_body_bytes)
            r = await client.post(f"https://127.0.0.1:{port}/v1/claims", content=body)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        nursery.cancel_scope.cancel()


def test_relay_with_tls_serves_its_market_over_https(
    tmp_path: Path, pki: tuple[Path, Path, Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvasir relay --market --tls-cert …`: the market beside the relay serves https with the relay's certificate;
    a client trusting the CA reads it, one that does not is refused."""
    ca, cert, key, other = pki
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))  # the market's machine identity lives here
    relay = Proc(
        "relay", "--trust-key", "ed25519:" + "A" * 43, "--listen", "127.0.0.1:0", "--market", "127.0.0.1:0",
        "--db", str(tmp_path / "m.sqlite"), "--tls-cert", str(cert), "--tls-key", str(key),
    )  # fmt: skip
    try:
        url = relay.wait_line(r"market on (https://\S+)").group(1)
        relay.wait_line(r"listening on wss://")
        r = httpx.get(f"{url}/v1/models", timeout=10, verify=client_context(ca))
        assert r.status_code == 200 and r.json()["models"] == []
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/v1/models", timeout=10, verify=client_context(other))
    finally:
        relay.stop()
