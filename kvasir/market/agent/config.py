"""How a self-enrolling node is set up (``kvasir node --market URL …``), and which hosts it may be aimed at."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx

from kvasir.core.identity import Identity, PublicKey
from kvasir.stage.engine import StageConfig
from kvasir.util.addrgroup import is_loopback_host


@attrs.frozen
class EnrollConfig:
    market_url: str
    budget_bytes: int
    stage_dir: Path
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    #: The host the market shows neighbours (default: the listen host).
    advertise_host: str | None = None
    lease_s: float = 30.0
    poll_s: float = 2.0
    seed: int | None = None
    relay: str | None = None
    ring_secret: str | None = None
    #: The key that signs this node's claims and reports; its fingerprint is the node id.
    identity: Identity = attrs.field(factory=Identity.generate)
    #: The operator key records must be signed by (None: trust the market's on first use, and log it).
    market_key: PublicKey | None = None
    #: Whether neighbours and sources may be private or loopback addresses (None: only if the market's is).
    allow_private: bool | None = None
    #: A PEM bundle of CAs trusted besides the system's, for an https market and https sources.
    market_ca: Path | None = None
    #: Stage settings and node settings (everything but the manifest and rank).
    stage_config: Callable[[Path], StageConfig] = StageConfig
    node_options: dict[str, Any] = attrs.field(factory=dict)
    #: ``kvasir node --record DIR``: signed receipts of every request on the window held (kvasir.ring.record). A
    #: market node always records (recording is required in market rings); None: in ``stage_dir / "record"``.
    record_dir: Path | None = None
    record_keep: int = 1 << 30

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    def host_ok(self, host: str) -> bool:
        """Whether the node may dial or fetch from ``host`` (what the market says must not aim it at the inside of
        its own network, unless the market itself lives there)."""
        allow = self.allow_private
        if allow is None:
            allow = not is_public_host(httpx.URL(self.market_url).host)
        return allow or is_public_host(host)

    @property
    def report_s(self) -> float:
        return max(0.2, min(self.lease_s / 3, 5.0))


def market_trust_problem(url: str, market_key: PublicKey | None, *, allow_plain_http: bool = False) -> str | None:
    """Why a node must not enroll at ``url`` as set up, or None (pure; security N1). Off loopback the operator key
    must be pinned (trust on first use would trust whoever answers first, an on-path attacker included), and plain
    http is refused unless explicitly allowed: replies are signed either way, but http shows the whole exchange
    to the path."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"--market {url!r} is not a URL ({exc})"
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return f"--market {url!r} is not an http:// or https:// URL"
    if is_loopback_host(parsed.host):
        return None
    if market_key is None:
        return (
            f"--market-key is required for a market off loopback ({parsed.host}):"
            " its operator key is never trusted on first use there"
        )
    if parsed.scheme == "http" and not allow_plain_http:
        return f"--market {url} is plain http off loopback: use https://, or pass --allow-plain-http"
    return None


def is_public_host(host: str) -> bool:
    """A global IP address, or a DNS name other than localhost and .local/.internal/one-label names (pure: a name
    is not resolved, so a public name that resolves inside is not caught here)."""
    host = host.strip("[]").rstrip(".").lower()
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        pass
    return "." in host and not host.endswith((".local", ".internal", ".localhost", ".lan", ".home.arpa"))
