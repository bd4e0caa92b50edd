"""Kvasir's relay: lets ring neighbours that cannot accept connections (phones behind carrier NAT) link up
through a WebSocket service both of them dial out to. See docs/protocol.md § Relay edges for the protocol."""

from kvasir.relay.client import RelayLink, edge_url, open_relay_link
from kvasir.relay.codes import CloseCode
from kvasir.relay.errors import (
    EdgeTokenError,
    EdgeTokenExpired,
    RelayConfigError,
    RelayConnectError,
    RelayError,
    RelayLinkClosed,
)
from kvasir.relay.server import DEFAULT_MAX_MESSAGE_BYTES, Relay, RelayConfig, RelayStatistics, serve_relay
from kvasir.relay.token import Role, make_edge_token, verify_edge_token

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "CloseCode",
    "EdgeTokenError",
    "EdgeTokenExpired",
    "Relay",
    "RelayConfig",
    "RelayConfigError",
    "RelayConnectError",
    "RelayError",
    "RelayLink",
    "RelayLinkClosed",
    "RelayStatistics",
    "Role",
    "edge_url",
    "make_edge_token",
    "open_relay_link",
    "serve_relay",
    "verify_edge_token",
]
