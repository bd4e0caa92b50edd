"""Signed encodings pinned byte for byte: every format that carries an Ed25519 signature (or the v1 HMAC), made from
fixed keys and fixed fields, must keep producing these exact strings (Ed25519 signatures are deterministic). A change
here is a wire change: old nodes, relays and markets would refuse the new text (docs/protocol.md).

The pins were taken from the code before the signed formats moved onto :mod:`kvasir.core.signed`."""

from __future__ import annotations

import hashlib
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvasir.core import signed
from kvasir.core.errors import InputError
from kvasir.core.identity import Identity, PublicKey
from kvasir.core.sampling import SamplingParams
from kvasir.market import auth
from kvasir.market.records import ModelRecord
from kvasir.market.tickets import WindowTicket, issue_ticket, parse_ticket
from kvasir.relay.grant import EdgeGrant, make_token, read_grant, sign_grant, verify_token
from kvasir.relay.token import Role, make_edge_token, verify_edge_token
from kvasir.verify.audit import FraudProof, LoggedInput, proof_id
from kvasir.verify.commit import Recorder, WindowReceipt


def _identity(n: int) -> Identity:
    return Identity.from_private(Ed25519PrivateKey.from_private_bytes(bytes([n]) * 32))


OPERATOR, MARKET, HOLDER = _identity(1), _identity(2), _identity(3)
NOW = 1_700_000_000

PINS = {
    "operator key": "ed25519:iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w",
    "ticket": (
        "kt1.a3Zhc2lyLXdpbmRvdy10aWNrZXQvdjEKYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFiYWJhYmFi"
        "YWJhYmFiYWJhYmFiYWJhYgowCjQKZWQyNTUxOTo3VWtveGlqUndzYnE2UU00a0ZtVllTbFpKenBjWV9rMk5zRkdGS3lITjlFCjE3"
        "MDAwMDAzMDAKZWRnZS0xCmVkMjU1MTk6Z1RsM0RxaDlGMTlXbzFSbXcweC16TXVOaXBHMDdqZWlYZllQVzRfSnM1UQ.MegP_mHAb"
        "FqkaYqAk1D13NLGBrriwgKcFxKvK67D6NFE_ho6eHbOX1V3SKEQiZM6pma6it87GoBtJWXXDrY6Bw"
    ),
    "grant": (
        "a3Zhc2lyLWVkZ2UtZ3JhbnQvdjIKY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNk"
        "Y2RjZGNkY2RjZAplMQoxCmVkMjU1MTk6N1Vrb3hpalJ3c2JxNlFNNGtGbVZZU2xaSnpwY1lfazJOc0ZHRkt5SE45RQoxNzAwMDAw"
        "NjAwCmVkMjU1MTk6aW9qajNYUUo4Wlg5VXRzdFBMcGRjc3BuQ2I4ZGxCSWI4M1NJQWJRUGIxdw.bx4FgFWQzJ91A1mYb7qnlR_CK"
        "-jBMq393lE_omoxj0F5r-2i3xqVcXXpLiAZRlNuaFibecluXY40Eohs_eLjBQ"
    ),
    "token v2": (
        "v2.a3Zhc2lyLWVkZ2UtZ3JhbnQvdjIKY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZGNkY2RjZ"
        "GNkY2RjZGNkY2RjZAplMQoxCmVkMjU1MTk6N1Vrb3hpalJ3c2JxNlFNNGtGbVZZU2xaSnpwY1lfazJOc0ZHRkt5SE45RQoxNzAwM"
        "DAwNjAwCmVkMjU1MTk6aW9qajNYUUo4Wlg5VXRzdFBMcGRjc3BuQ2I4ZGxCSWI4M1NJQWJRUGIxdw.bx4FgFWQzJ91A1mYb7qnlR"
        "_CK-jBMq393lE_omoxj0F5r-2i3xqVcXXpLiAZRlNuaFibecluXY40Eohs_eLjBQ.1700000100.SIKFLEE80AxcDl8J0lgbyYDl"
        "_zzMhwIevyKsw_O5M9J6KR3dolYVCaGZxtdqdpBCNYT-vN63clJO9fdSGyASDg"
    ),
    "token v1": "v1.1700000000.0uzNrINF3XjBfuwmHRbKRxBON_7QJMzlYmA2xsZPgj8",
    "request signature": "918CwMSYUB5aUPiv06cHWBEFIujLBlTh6ePhje1EeIszF6MiO4yPmGM_kyD8F0880ZhjnmschqpfOq1XXC0yDg",
    "model signature": "4TCv2_Ydx9Gm2KhTmyq6WuX4_1re8op715URQ7tx7XimAZ6EcpoJeTV8qxv2G0OQX19Ui57MtsRU9nekEwc4Aw",
    "delegation": "E_SEhSwfuhzurOBWPHdIGXNswZVRZnWKLko9C8gVeutu-OoUOUmO7rpWQcRuGQ4DWManmV5pDx0bN2SmSE1dAw",
    "receipt": (
        '{"request":7,"model_sha256":"efefefefefefefefefefefefefefefefefefefefefefefefefefefefefefefef","laye'
        'rs":[2,4],"kernel_class":"cpu-test","schedule":[[0,2],[2,1]],"input_head":"c05d8e146a9ffde9012a86060'
        '089f94083fc7627821fa29ebd7b8ba3c3571d82","output_head":"9a358c5856efabf231d17b9985e587091ab5c5ed91c7'
        '168ca6150d727423dee4","input_hashes":["5d73ba77a2eac0cb9380c4d6491b1b9780dfc41cdfdcebf909961e1c3069b'
        '935","7b673b57c92004be4f7395d6f206af477e2634d62efc78287d224ebe8dc3f273"],"output_hashes":["483606fcd'
        '7ed1e46d5c10ca60d553cfd90cce31f7d821fed3bc4d6d469ad0ce0","3f772c05df0c34b71796e431a168ac0e4feaadff16'
        '237a86b54cb5ac02ac7296"],"in_dtype":0,"out_dtype":101,"node_key":"ed25519:7UkoxijRwsbq6QM4kFmVYSlZJz'
        'pcY_k2NsFGFKyHN9E","sampling":{"temperature":0.5,"top_k":40,"top_p":0.95,"min_p":0.05,"repeat_penalt'
        'y":1.0,"repeat_last_n":64,"seed":42},"tokens":[5,-1],"history":[1,2],"signature":"ldmTcGzuK1PtdHGtY5'
        'x7NRtWnWGa6Tlh-ehTo_DGqBwG3MFbzKU2xbu9zOOad2Nmaj7rufS8o-EhjngbyaHGBA"}'
    ),
    "proof id": "5678ccbb23c79f220f97b26f24e4e970e4109392ab35b8e760815b7dd86bc010",
}


def _ticket() -> str:
    ticket = WindowTicket("ab" * 32, 0, 4, HOLDER.public, NOW + 300, MARKET.public, "edge-1")
    return issue_ticket(MARKET, ticket)


def _grant() -> str:
    return sign_grant(OPERATOR, EdgeGrant("cd" * 32, "e1", Role.UPSTREAM, HOLDER.public, NOW + 600, OPERATOR.public))


def _model() -> ModelRecord:
    return ModelRecord.from_wire(
        {
            "sha256": "ef" * 32,
            "name": "tiny",
            "layers": 4,
            "file_bytes": 10_000,
            "header_bytes": 1000,
            "sources": ["http://127.0.0.1:1/m.gguf"],
            "layer_bytes": [1000] * 4,
            "outside_bytes": 3000,
            "stages": [{"layers": [0, 2], "sha256": "01" * 32, "bytes": 4000}],
        }
    ).signed(OPERATOR)


def _receipt() -> WindowReceipt:
    rec = Recorder(7, "ef" * 32, (2, 4), "cpu-test", sampling=SamplingParams(temperature=0.5, seed=42), history=(1, 2))
    rec.on_input(0, 2, b"\1" * 16, 0)
    rec.on_sample(0, 2, b"\2" * 8, 5)
    rec.on_input(2, 1, b"\3" * 8, 0)
    rec.on_skip(2, 1)
    return rec.receipt(HOLDER)


def _proof() -> FraudProof:
    return FraudProof(_receipt(), (LoggedInput.of_tokens(0, [1, 2]), LoggedInput(2, 1, 0, b"\3" * 8)), 1)


def _request_signature() -> str:
    return signed.sign(HOLDER, auth.request_message("POST", "/v1/claims", NOW, "0f" * 16, b"{}"))


def made() -> dict[str, str]:
    return {
        "operator key": OPERATOR.public.to_text(),
        "ticket": _ticket(),
        "grant": _grant(),
        "token v2": make_token(HOLDER, _grant(), NOW + 100),
        "token v1": make_edge_token(b"s" * 16, "e1", Role.DOWNSTREAM, NOW),
        "request signature": _request_signature(),
        "model signature": str(_model().signature),
        "delegation": auth.sign_delegation(OPERATOR, MARKET.public),
        "receipt": json.dumps(_receipt().to_wire(), separators=(",", ":")),
        "proof id": proof_id(_proof()),
    }


@pytest.mark.parametrize("name", list(PINS))
def test_signed_encodings_are_pinned(name: str) -> None:
    assert made()[name] == PINS[name]


def test_pinned_encodings_read_back() -> None:
    assert PublicKey.from_text(PINS["operator key"]) == OPERATOR.public
    ticket = parse_ticket(PINS["ticket"], MARKET.public)
    assert (ticket.model, ticket.start, ticket.end, ticket.relay_edge) == ("ab" * 32, 0, 4, "edge-1")
    assert ticket.holder == HOLDER.public
    assert read_grant(PINS["grant"]).holder == HOLDER.public
    grant = verify_token(PINS["token v2"], frozenset({OPERATOR.public}), "e1", Role.UPSTREAM, NOW)
    assert grant.ring == "cd" * 32
    assert verify_edge_token(b"s" * 16, PINS["token v1"], "e1", Role.DOWNSTREAM, NOW - 1) == NOW
    message = auth.request_message("POST", "/v1/claims", NOW, "0f" * 16, b"{}")
    assert signed.verify(HOLDER.public, PINS["request signature"], message)
    assert _model().signed_by(OPERATOR.public)
    assert auth.signature_ok(OPERATOR.public, auth.delegation_message(MARKET.public), PINS["delegation"])
    receipt = WindowReceipt.from_wire(json.loads(PINS["receipt"]))
    receipt.verify()
    assert receipt == _receipt()
    assert proof_id(FraudProof.from_wire(_proof().to_wire())) == PINS["proof id"]


def test_base64url_is_unpadded_and_refuses_junk() -> None:
    assert signed.b64url(b"\xff\xfe") == "__4"
    assert signed.unb64url("__4", "x") == signed.unb64url("__4=", "x") == b"\xff\xfe"
    for junk in (5, None, "ü", "a" * 9, "ab+/", "ab c", "ab\n", "a===", "=ab"):
        with pytest.raises(InputError, match=r"^x is not base64url$"):
            signed.unb64url(junk, "x", max_chars=8)
    assert not signed.verify(OPERATOR.public, 5, b"m")
    assert not signed.verify(OPERATOR.public, "!!", b"m")


def test_canonical_bytes() -> None:
    assert signed.canonical_lines(b"d/v1\n", "a", 1, "") == b"d/v1\na\n1\n"
    assert signed.split_lines(b"d/v1\na\n1\n", b"d/v1\n", 3, "thing") == ["a", "1", ""]
    for data, why in ((b"x\na", "not a thing"), (b"d/v1\n\xff", "is ASCII"), (b"d/v1\na", "has 3 fields")):
        with pytest.raises(InputError, match=why):
            signed.split_lines(data, b"d/v1\n", 3, "thing")
    body = {"b": 1, "a": [1, "x"], "signature": "s"}
    assert signed.canonical_json(b"D\n", body) == b'D\n{"a":[1,"x"],"b":1}'
    assert (
        hashlib.sha256(signed.canonical_json(b"", body, drop=None)).hexdigest()
        == hashlib.sha256(b'{"a":[1,"x"],"b":1,"signature":"s"}').hexdigest()
    )
