"""Rings whose links run through the real relay: on loopback, and with a phone behind a carrier NAT."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.control.client import ControlClient
from kvasir.core.identity import create_identity
from kvasir.local.launcher import LocalRing
from kvasir.relay.ringlink import grant_relay_edges
from kvasir.ring.manifest import Manifest, RankEntry, load_manifest
from kvasir.shard.cache import model_sha256, stage_files
from tests.netns import PHONE_IP, PUB_IP, carrier_nat, listening_tcp, netns_unavailable
from tests.ringutil import ring_generate, running_ring, whole_model_tokens

PROMPT = "The relay bridges one ring edge"


def test_every_link_through_the_relay(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    """`ring up --relay`: v2 edge tokens under the run's operator key; no secret anywhere, on no command line."""
    model = tiny_model("llama", "q8_0")
    want = whole_model_tokens(model, PROMPT, 12)
    with running_ring(model, [(0, 2), (2, 4), (4, 6)], cache_dir, relay=True) as ring:
        got = ring_generate(ring.sockets[1], PROMPT, 12)
        assert got["tokens"] == want
        for rank in range(3):
            with ControlClient(ring.sockets[rank]) as c:
                links = c.status()["links"]
            assert links["successor"]["kind"] == "relay" and links["predecessor"]["kind"] == "relay"
        written = load_manifest(ring.run_dir / "ring.toml")
        assert written.secret is None and written.operator is not None
        assert all(len(r.grants) == 2 for r in written.ranks)
        assert ring.relay is not None
        argvs = {p.pid: Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0") for p in [*ring.processes, ring.relay]}
        relay_argv = argvs[ring.relay.pid]
        assert relay_argv[relay_argv.index(b"--trust-key") + 1] == written.operator.to_text().encode()
        for argv in argvs.values():
            assert not any(b"secret" in arg for arg in argv), argv
        assert not list(ring.run_dir.glob("*secret*"))


@pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))
def test_phone_behind_carrier_nat_as_middle_stage(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model("llama", "q8_0")
    want = whole_model_tokens(model, PROMPT, 12)
    windows = [(0, 2), (2, 4), (4, 6)]
    paths = stage_files(model, windows, cache_dir)
    manifest = Manifest(
        model_sha256=model_sha256(model, cache_dir),
        n_layers=6,
        ranks=(
            RankEntry(0, 0, 2, PUB_IP, 7100, str(paths[0]), link="direct"),  # edge 2 -> 0: direct TCP in "pub"
            RankEntry(1, 2, 4, PHONE_IP, 7101, str(paths[1]), link="relay"),  # the phone: both edges relayed
            RankEntry(2, 4, 6, PUB_IP, 7102, str(paths[2]), link="relay"),
        ),
        relay=f"ws://{PUB_IP}:8443",
    )
    # A keyed ring: each rank its own key, the relay edges granted by an operator key the relay trusts.
    manifest = manifest.with_keys([create_identity(tmp_path / f"rank{k}.pem").public for k in range(3)])
    operator = create_identity(tmp_path / "operator.pem")
    manifest = grant_relay_edges(manifest, operator, int(time.time()) + 3600)
    manifest.write(tmp_path / "ring.toml")
    with carrier_nat() as nat:
        logs = [(tmp_path / f"{name}.log").open("wb") for name in ("relay", "rank0", "rank1", "rank2")]
        relay = subprocess.Popen(
            [
                *nat.exec_prefix(nat.pub),
                sys.executable,
                "-m",
                "kvasir",
                "relay",
                "--listen",
                f"{PUB_IP}:8443",
                "--trust-key",
                operator.public.to_text(),
            ],
            stdout=logs[0],
            stderr=subprocess.STDOUT,
        )
        nodes: list[subprocess.Popen[bytes]] = []
        socks = [tmp_path / f"rank{k}.sock" for k in range(3)]
        ring = LocalRing(manifest, tmp_path, nodes, socks, None, relay, manifest.relay)
        try:
            # The NAT is real: nothing in "pub" can open a connection to the phone.
            probe = subprocess.run(
                [
                    *nat.exec_prefix(nat.pub),
                    sys.executable,
                    "-c",
                    f"import socket; socket.create_connection(('{PHONE_IP}', 7101), timeout=2)",
                ],
                capture_output=True,
                text=True,
            )
            assert probe.returncode != 0
            for k, ns in enumerate((nat.pub, nat.phone, nat.pub)):
                nodes.append(
                    subprocess.Popen(
                        [
                            *nat.exec_prefix(ns),
                            sys.executable,
                            "-m",
                            "kvasir",
                            "node",
                            "--manifest",
                            str(tmp_path / "ring.toml"),
                            "--rank",
                            str(k),
                            "--control",
                            str(socks[k]),
                            "--threads",
                            "1",
                            "--ctx",
                            "512",
                            "--identity",
                            str(tmp_path / f"rank{k}.pem"),
                        ],
                        stdout=logs[k + 1],
                        stderr=subprocess.STDOUT,
                    )
                )
            ring.wait_ready(timeout=120)
            got = ring_generate(socks[0], PROMPT, 12)
            assert got["tokens"] == want
            assert listening_tcp(nat.phone) == [], "the phone must open no listening TCP socket"
            assert listening_tcp(nat.pub)  # while rank 0, rank 2 and the relay do listen
        finally:
            ring.stop()
            for f in logs:
                f.close()


def test_links_redial_when_the_relay_restarts(tiny_model: Callable[..., Path], cache_dir: Path) -> None:
    model = tiny_model("qwen3", "f32")
    want = whole_model_tokens(model, PROMPT, 8)
    with running_ring(model, [(0, 3), (3, 6)], cache_dir, relay=True) as ring:
        assert ring_generate(ring.sockets[0], PROMPT, 8)["tokens"] == want
        assert ring.relay is not None and ring.relay_url is not None
        ring.relay.kill()
        ring.relay.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # both nodes notice their relayed links are gone
            states = []
            for sock in ring.sockets:
                with ControlClient(sock) as c:
                    states.append(c.status()["ready"])
            if not any(states):
                break
            time.sleep(0.1)
        assert not any(states)
        host, port = ring.relay_url.removeprefix("ws://").rsplit(":", 1)
        ring.relay = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvasir",
                "relay",
                "--listen",
                f"{host}:{port}",
                "--trust-key",
                str(ring.manifest.operator),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        ring.wait_ready(timeout=60)
        assert ring_generate(ring.sockets[1], PROMPT, 8)["tokens"] == want
