"""Edge tokens v2 (relay/grant.py): operator-signed grants, holder-signed short tokens; pure, time passed in."""

from __future__ import annotations

import hashlib

import pytest

from kvasir.core.identity import Identity
from kvasir.relay.errors import EdgeTokenError, EdgeTokenExpired
from kvasir.relay.grant import MAX_TOKEN_LIFETIME, EdgeGrant, make_token, sign_grant, verify_token
from kvasir.relay.spent import SpentTokens
from kvasir.relay.token import Role

RING = hashlib.sha256(b"manifest").hexdigest()
NOW = 1_800_000_000


@pytest.fixture
def parties() -> tuple[Identity, Identity, Identity]:
    return Identity.generate(), Identity.generate(), Identity.generate()


def _grant(operator: Identity, holder: Identity, edge: str = "r-e1", role: Role = Role.UPSTREAM) -> str:
    return sign_grant(operator, EdgeGrant(RING, edge, role, holder.public, NOW + 86400, operator.public))


def test_a_holder_token_under_an_operator_grant_verifies(parties: tuple[Identity, Identity, Identity]) -> None:
    operator, holder, _ = parties
    token = make_token(holder, _grant(operator, holder), NOW + MAX_TOKEN_LIFETIME)
    grant = verify_token(token, frozenset({operator.public}), "r-e1", Role.UPSTREAM, NOW)
    assert grant.holder == holder.public and grant.ring == RING


def test_forged_foreign_and_expired_tokens_are_refused(parties: tuple[Identity, Identity, Identity]) -> None:
    operator, holder, thief = parties
    trusted = frozenset({operator.public})
    signed = _grant(operator, holder)
    good = make_token(holder, signed, NOW + 60)
    # minted by someone who is not the operator (e.g. any node of the ring)
    with pytest.raises(EdgeTokenError, match="untrusted"):
        verify_token(make_token(thief, _grant(thief, thief), NOW + 60), trusted, "r-e1", Role.UPSTREAM, NOW)
    # another holder reusing a stolen grant with its own signature
    with pytest.raises(EdgeTokenError, match="holder"):
        verify_token(make_token(thief, signed, NOW + 60), trusted, "r-e1", Role.UPSTREAM, NOW)
    # foreign edge, foreign role
    with pytest.raises(EdgeTokenError, match="another edge"):
        verify_token(good, trusted, "r-e2", Role.UPSTREAM, NOW)
    with pytest.raises(EdgeTokenError, match="another edge"):
        verify_token(good, trusted, "r-e1", Role.DOWNSTREAM, NOW)
    # expired token; a token that claims to live too long
    with pytest.raises(EdgeTokenExpired):
        verify_token(good, trusted, "r-e1", Role.UPSTREAM, NOW + 60)
    with pytest.raises(EdgeTokenError, match="longer"):
        verify_token(make_token(holder, signed, NOW + 3600), trusted, "r-e1", Role.UPSTREAM, NOW)
    # a grant past its own expiry
    with pytest.raises(EdgeTokenExpired, match="grant"):
        verify_token(make_token(holder, signed, NOW + 86400 + 60), trusted, "r-e1", Role.UPSTREAM, NOW + 86400)
    # any flipped character of a good token
    for i in range(3, len(good), 7):
        flipped = good[:i] + ("A" if good[i] != "A" else "B") + good[i + 1 :]
        with pytest.raises(EdgeTokenError):
            verify_token(flipped, trusted, "r-e1", Role.UPSTREAM, NOW)
    for junk in ("", "v2", "v2.a.b.c.d", "v1.1.x", "v2." + "A" * 3000):
        with pytest.raises(EdgeTokenError):
            verify_token(junk, trusted, "r-e1", Role.UPSTREAM, NOW)


def test_spent_tokens_are_remembered_until_they_expire_and_bounded() -> None:
    spent = SpentTokens(limit=2)
    assert spent.spend(b"a", NOW + 10, NOW) is True
    assert spent.spend(b"a", NOW + 10, NOW + 9) is False  # a replay, however late in the token's life
    assert spent.spend(b"b", NOW + 20, NOW) is True
    assert spent.spend(b"c", NOW + 20, NOW) is None  # full: refused, not remembered, nothing forgotten early
    assert spent.spend(b"c", NOW + 20, NOW + 10) is True and len(spent) == 2  # "a" expired and left
