"""Rings whose links run through the real relay: on loopback, and with a phone behind a carrier NAT."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvasir.control.client import ControlClient
from kvasir.ring.manifest import load_manifest
from tests.netns import PHONE_IP, carrier_nat, listening_tcp, netns_unavailable, phone_ring
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
    with carrier_nat() as nat, phone_ring(nat, model, [(0, 2), (2, 4), (4, 6)], cache_dir, tmp_path) as ring:
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
        got = ring_generate(ring.sockets[0], PROMPT, 12)
        assert got["tokens"] == want
        assert listening_tcp(nat.phone) == [], "the phone must open no listening TCP socket"
        assert listening_tcp(nat.pub)  # while rank 0, rank 2 and the relay do listen


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
