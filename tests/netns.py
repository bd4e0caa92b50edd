"""Linux network namespaces for tests: a 'phone' behind a carrier NAT that admits no inbound connections.

    phone 10.77.1.2 ── carrier 10.77.1.1 | 10.77.2.1 (masquerade; forwards replies only) ── pub 10.77.2.2

Everything lives in namespaces this test creates and deletes; no traffic leaves the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator

import attrs

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
