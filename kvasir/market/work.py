"""Proof of work for a market's admission of new keys (hashcash-style; pure: data in, decision out).

An open market may ask each new key for some work before its first claim (``kvasir market --work-bits N``;
0: off). The work is a nonce such that SHA-256 of the domain, the market's key, the node's key and the nonce starts
with ``bits`` zero bits: about 2**bits hashes to find, one to check. It is bound to both keys, so it is done once
per key and market and is worth nothing elsewhere; it does not expire (a key is admitted once). What it buys
against squatting is a price per fresh key (docs/market.md § Admission).
"""

from __future__ import annotations

import hashlib
import itertools

#: What the hash covers before the keys: no other protocol's hash can double as an admission.
WORK_DOMAIN = b"kvasir-market-admission/v1\n"
#: The most bits a market may ask (2**32 hashes: hours in Python, the end of what is sensible to ask).
MAX_WORK_BITS = 32


def _prefix(market_key: str, node_key: str) -> bytes:
    return WORK_DOMAIN + market_key.encode() + b"\n" + node_key.encode() + b"\n"


def leading_zero_bits(digest: bytes) -> int:
    """How many zero bits ``digest`` starts with."""
    n = int.from_bytes(digest, "big")
    return len(digest) * 8 - n.bit_length()


def work_ok(market_key: str, node_key: str, nonce: str, bits: int) -> bool:
    """Whether ``nonce`` is ``bits`` bits of work admitting ``node_key`` to the market of ``market_key``."""
    if bits <= 0:
        return True
    if not (0 < len(nonce) <= 64 and nonce.isascii() and nonce.isalnum()):
        return False
    digest = hashlib.sha256(_prefix(market_key, node_key) + nonce.encode()).digest()
    return leading_zero_bits(digest) >= bits


def mint_work(market_key: str, node_key: str, bits: int, start: int = 0) -> str:
    """The first nonce (a decimal counter from ``start``) that is ``bits`` bits of work for these keys."""
    if not 0 <= bits <= MAX_WORK_BITS:
        raise ValueError(f"work bits must be 0..{MAX_WORK_BITS}, not {bits}")
    base = hashlib.sha256(_prefix(market_key, node_key))
    shift = 256 - bits
    for i in itertools.count(start):
        nonce = str(i)
        h = base.copy()
        h.update(nonce.encode())
        if int.from_bytes(h.digest(), "big") >> shift == 0:
            return nonce
    raise AssertionError("unreachable")
