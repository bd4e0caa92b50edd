"""The unit that per-address limits count: an IPv4 address, or an IPv6 /64 (one host usually owns a whole /64)."""

from __future__ import annotations

import ipaddress


def address_group(host: str) -> str:
    """``host`` as the key of a per-address cap; IPv4-mapped IPv6 counts as its IPv4 address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def network_group(host: str) -> str:
    """``host``'s network for caps an attacker could spread over a few addresses of one network: an IPv4 /24 (its
    addresses are cheap to hold together), or :func:`address_group`'s IPv6 /64."""
    group = address_group(host)
    try:
        return str(ipaddress.IPv4Network((ipaddress.IPv4Address(group), 24), strict=False))
    except ValueError:  # an IPv6 /64, or not an address
        return group


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback address (127.0.0.0/8, ::1): a host no one else's network sits between."""
    host = host.strip("[]").rstrip(".").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
