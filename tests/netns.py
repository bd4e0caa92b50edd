"""Linux network namespaces for tests: a 'phone' behind a carrier NAT that admits no inbound connections.

    phone 10.77.1.2 ── carrier 10.77.1.1 | 10.77.2.1 (masquerade; forwards replies only) ── pub 10.77.2.2

Everything lives in namespaces this test creates and deletes; no traffic leaves the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from kvasir.core.identity import create_identity
from kvasir.local.launcher import LocalRing
from kvasir.relay.ringlink import grant_relay_edges
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.shard.cache import model_sha256, stage_files

PHONE_IP = "10.77.1.2"
PUB_IP = "10.77.2.2"

NFT_RULES = """
table ip nat {
  chain post { type nat hook postrouting priority 100; oifname "cg-pub" masquerade; }
}
table ip filter {
  chain forwarding {
    type filter hook forward priority 0; policy drop;
    ct state established,related accept
    iifname "cg-phone" oifname "cg-pub" accept
  }
}
"""


def netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for ip netns"
    for tool in ("ip", "nft", "ss"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install iproute2 nftables)"
    return None


@attrs.frozen
class CarrierNat:
    phone: str
    carrier: str
    pub: str

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]


def _run(*cmd: str, input: str | None = None) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, input=input)


@contextlib.contextmanager
def carrier_nat() -> Iterator[CarrierNat]:
    tag = uuid.uuid4().hex[:6]
    nat = CarrierNat(f"kv-phone-{tag}", f"kv-carrier-{tag}", f"kv-pub-{tag}")
    try:
        for ns in (nat.phone, nat.carrier, nat.pub):
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run(
            "ip",
            "link",
            "add",
            f"p{tag}",
            "netns",
            nat.phone,
            "type",
            "veth",
            "peer",
            "name",
            "cg-phone",
            "netns",
            nat.carrier,
        )
        _run(
            "ip",
            "link",
            "add",
            f"u{tag}",
            "netns",
            nat.pub,
            "type",
            "veth",
            "peer",
            "name",
            "cg-pub",
            "netns",
            nat.carrier,
        )
        _run("ip", "-n", nat.phone, "addr", "add", f"{PHONE_IP}/24", "dev", f"p{tag}")
        _run("ip", "-n", nat.carrier, "addr", "add", "10.77.1.1/24", "dev", "cg-phone")
        _run("ip", "-n", nat.carrier, "addr", "add", "10.77.2.1/24", "dev", "cg-pub")
        _run("ip", "-n", nat.pub, "addr", "add", f"{PUB_IP}/24", "dev", f"u{tag}")
        for ns, dev in (
            (nat.phone, f"p{tag}"),
            (nat.carrier, "cg-phone"),
            (nat.carrier, "cg-pub"),
            (nat.pub, f"u{tag}"),
        ):
            _run("ip", "-n", ns, "link", "set", dev, "up")
        _run("ip", "-n", nat.phone, "route", "add", "default", "via", "10.77.1.1")
        _run("ip", "netns", "exec", nat.carrier, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "netns", "exec", nat.carrier, "nft", "-f", "-", input=NFT_RULES)
        yield nat
    finally:
        for ns in (nat.phone, nat.carrier, nat.pub):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def listening_tcp(ns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], check=True, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


@contextlib.contextmanager
def phone_ring(
    nat: CarrierNat, model: Path, windows: Sequence[tuple[int, int]], cache_dir: Path, tmp_path: Path, ctx: int = 512
) -> Iterator[LocalRing]:
    """A keyed 3-rank ring with rank 1 on the phone behind the carrier NAT: both its edges through a relay in "pub"
    (granted by an operator key the relay trusts), the edge from rank 2 to rank 0 direct TCP in "pub"."""
    paths = stage_files(model, windows, cache_dir)
    manifest = Manifest(
        model_sha256=model_sha256(model, cache_dir),
        n_layers=windows[-1][1],
        ranks=(
            RankEntry(0, *windows[0], PUB_IP, 7100, str(paths[0]), link="direct"),  # edge 2 -> 0: direct TCP
            RankEntry(1, *windows[1], PHONE_IP, 7101, str(paths[1]), link="relay"),  # the phone: both edges relayed
            RankEntry(2, *windows[2], PUB_IP, 7102, str(paths[2]), link="relay"),
        ),
        relay=f"ws://{PUB_IP}:8443",
    )
    manifest = manifest.with_keys([create_identity(tmp_path / f"rank{k}.pem").public for k in range(3)])
    operator = create_identity(tmp_path / "operator.pem")
    manifest = grant_relay_edges(manifest, operator, int(time.time()) + 3600)
    manifest.write(tmp_path / "ring.toml")
    logs = [(tmp_path / f"{name}.log").open("wb") for name in ("relay", "rank0", "rank1", "rank2")]
    relay_cmd = [sys.executable, "-m", "kvasir", "relay", "--listen", f"{PUB_IP}:8443"]
    relay_cmd += ["--trust-key", operator.public.to_text()]
    relay = subprocess.Popen([*nat.exec_prefix(nat.pub), *relay_cmd], stdout=logs[0], stderr=subprocess.STDOUT)
    nodes: list[subprocess.Popen[bytes]] = []
    socks = [tmp_path / f"rank{k}.sock" for k in range(3)]
    ring = LocalRing(manifest, tmp_path, nodes, socks, None, relay, manifest.relay)
    try:
        for k, ns in enumerate((nat.pub, nat.phone, nat.pub)):
            cmd = [sys.executable, "-m", "kvasir", "node", "--manifest", str(tmp_path / "ring.toml"), "--rank", str(k)]
            cmd += ["--control", str(socks[k]), "--threads", "1", "--ctx", str(ctx)]
            cmd += ["--identity", str(tmp_path / f"rank{k}.pem")]
            nodes.append(subprocess.Popen([*nat.exec_prefix(ns), *cmd], stdout=logs[k + 1], stderr=subprocess.STDOUT))
        ring.wait_ready(timeout=120)
        yield ring
    finally:
        ring.stop()
        for f in logs:
            f.close()


def set_link(nat: CarrierNat, up: bool) -> None:
    """Cut (or restore) the phone's only way out: the carrier's interface towards it."""
    _run("ip", "-n", nat.carrier, "link", "set", "cg-phone", "up" if up else "down")
