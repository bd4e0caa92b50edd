"""The one schema layer: SamplingParams' default sets and ranges, the strict converter, host:port parsing, the
manifest's TOML, control-socket ops, and the TUI form that must not offer what the node refuses."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import attrs
import pytest

from kvasir.api.schema import ApiError, parse_generation
from kvasir.control.ops import CancelOp, GenerateOp, StatusOp, WatchOp, parse_op
from kvasir.core.sampling import MAX_REPEAT_LAST_N, MAX_SEED, SamplingError, SamplingParams
from kvasir.core.schema import SchemaError, register_record, structure, unstructure
from kvasir.errors import InputError
from kvasir.market.records import ClaimRequest, CoverageEntry, ModelRecord
from kvasir.ring.manifest import Manifest, RankEntry, parse_manifest
from kvasir.tui.screens import MAX_TOKENS, parse_sampling
from kvasir.util.addr import format_hostport, parse_hostport
from kvasir.wire import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS

SHA = "ab" * 32

# ---------------------------------------------------------------------------------------------- sampling


def test_named_default_sets() -> None:
    assert SamplingParams() == SamplingParams.LLAMA_CPP
    assert SamplingParams.LLAMA_CPP.temperature == 0.8 and SamplingParams.LLAMA_CPP.top_p == 0.95
    assert (SamplingParams.OPENAI.temperature, SamplingParams.OPENAI.top_p) == (1.0, 1.0)
    assert SamplingParams.GREEDY.greedy and SamplingParams.GREEDY.top_k == 40
    # the sets differ only where they say they do
    assert attrs.evolve(SamplingParams.OPENAI, temperature=0.8, top_p=0.95) == SamplingParams.LLAMA_CPP
    assert attrs.evolve(SamplingParams.GREEDY, temperature=0.8) == SamplingParams.LLAMA_CPP


def test_sampling_limits_agree_with_the_wire() -> None:
    assert MAX_REPEAT_LAST_N == MAX_PROMPT_TOKENS and MAX_TOKENS == MAX_NEW_TOKENS
    assert SamplingParams(seed=MAX_SEED).seed == MAX_SEED


def test_with_fields_ignores_other_keys_and_none() -> None:
    p = SamplingParams.GREEDY.with_fields({"top_k": 3, "seed": None, "prompt": "x", "max_tokens": 5})
    assert p == attrs.evolve(SamplingParams.GREEDY, top_k=3)
    assert SamplingParams.GREEDY.with_fields({}) is SamplingParams.GREEDY
    with pytest.raises(SamplingError) as info:
        SamplingParams.GREEDY.with_fields({"top_k": 1.5})
    assert info.value.field == "top_k"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_p": 0}, "top_p"),
        ({"min_p": "x"}, "min_p"),
        ({"repeat_last_n": -5}, "repeat_last_n"),
        ({"seed": -1}, "seed"),
    ],
)
def test_api_400_names_the_field_from_the_typed_error(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_generation("completion", {"prompt": "x", **body})
    assert info.value.status == 400 and info.value.param == param and info.value.message.startswith(param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stream": 1}, "stream"),
        ({"stream_options": []}, "stream_options"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"model": 5}, "model"),
    ],
)
def test_api_body_fields_name_their_path(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_generation("completion", {"prompt": "x", **body})
    assert info.value.param == param and info.value.message.startswith(f"'{param}' ")


def test_api_uses_the_openai_set() -> None:
    assert parse_generation("completion", {"prompt": "x"}).params == SamplingParams.OPENAI


@pytest.mark.parametrize(
    ("field", "value"),
    [("top_p", "0"), ("seed", str(2**63 - 1)), ("seed", str(2**32 - 1)), ("temperature", "-1"), ("top_k", "-1")],
)
def test_tui_form_refuses_what_the_node_refuses(field: str, value: str) -> None:
    values = {"temperature": "0", "top_k": "40", "top_p": "0.95", "max_tokens": "16", "seed": "", field: value}
    with pytest.raises(ValueError, match=field):
        parse_sampling(values, True)
    # ... and what it accepts, the node accepts
    ok = parse_sampling({**values, field: {"top_p": "1", "seed": str(MAX_SEED)}.get(field, "0")}, True)
    SamplingParams(temperature=ok.temperature, top_k=ok.top_k, top_p=ok.top_p, seed=ok.seed)


# ---------------------------------------------------------------------------------------------- converter


@attrs.frozen
class _Shape:
    start: int
    end: int
    count: int
    ratio: float = 1.0
    tags: tuple[str, ...] = ()
    note: str | None = None


register_record(_Shape, window=True, forbid_extra=True, omit_if_none=("note",))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"layers": [0, 2], "count": True}, "where: count: must be an integer, not True"),
        ({"layers": [0, 2], "count": 1.0}, "where: count: must be an integer"),
        ({"layers": [0, 2], "count": "1"}, "where: count: must be an integer"),
        ({"layers": [0, 2], "count": 1, "ratio": float("nan")}, "where: ratio: must be a finite number"),
        ({"layers": [0, 2], "count": 1, "tags": "ab"}, "where: tags: must be a list"),
        ({"layers": [0, 2], "count": 1, "tags": ["a", 3]}, "where: tags[1]: must be a string"),
        ({"layers": [0, 2], "count": 1, "extra": 0}, "where: unknown field 'extra'"),
        ({"layers": [2, 2], "count": 1}, "where: layers: [2, 2] is not a non-empty window"),
        ({"layers": [0, 2]}, "where: count: required field missing"),
        ({"count": 1}, "where: layers: required field missing"),
        ([1], "where: must be an object"),
    ],
)
def test_converter_is_strict_and_names_the_path(data: object, message: str) -> None:
    with pytest.raises(InputError) as info:
        structure(data, _Shape, where="where")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_converter_round_trip_and_error_type() -> None:
    shape = structure({"layers": [1, 3], "count": 2, "ratio": 2, "tags": ["x"]}, _Shape, where="w")
    assert shape == _Shape(1, 3, 2, 2.0, ("x",))
    assert unstructure(shape) == {"layers": [1, 3], "count": 2, "ratio": 2.0, "tags": ["x"]}
    with pytest.raises(SchemaError) as info:
        structure({"layers": [1, 3], "count": 1, "tags": [1]}, _Shape, where="peer")
    assert (info.value.where, info.value.path, info.value.reason) == ("peer", "tags[0]", "must be a string, not 1")


def test_market_records_keep_their_json_shape() -> None:
    claim = ClaimRequest(SHA, 0, 2, "n1", 30.0)
    assert json.dumps(claim.to_wire()) == json.dumps(
        {"model": SHA, "layers": [0, 2], "node_id": "n1", "lease_s": 30.0, "endpoint": None, "state": "fetching"}
    )
    renew = attrs.evolve(claim, lease_id="L", state="serving", endpoint="[::1]:7000")
    assert ClaimRequest.from_wire(renew.to_wire(), renew=True) == renew
    assert ClaimRequest.from_wire(renew.to_wire()).lease_id is None  # only a renewal names its lease
    entry = CoverageEntry(SHA, 1, 2, 4, 1.0, 1.5, 10, SHA, "a", 5.0, "serving", "h:1")
    keys = "model rank layers weight reward bytes sha256 holder lease_expires state endpoint"
    assert list(entry.to_wire()) == keys.split()
    assert CoverageEntry.from_wire(entry.to_wire()) == entry


def test_model_record_errors_name_the_nested_path() -> None:
    body = {
        "sha256": SHA, "layers": 2, "file_bytes": 100, "header_bytes": 30, "sources": ["http://h/m"],
        "layer_bytes": [1, 2], "stages": [{"layers": [0, 2], "sha256": SHA, "bytes": 0}],
    }  # fmt: skip
    with pytest.raises(InputError, match=r"^model: stages\[0\]\.bytes: must be an integer >= 1$"):
        ModelRecord.from_wire(body)


def test_records_refuse_bad_values_when_built_locally_too() -> None:
    with pytest.raises(InputError, match="node_id"):
        ClaimRequest(SHA, 0, 2, "bad id!", 30.0)
    with pytest.raises(InputError, match="endpoint"):
        ClaimRequest(SHA, 0, 2, "n", 30.0, endpoint="nohost", state="serving")


# ---------------------------------------------------------------------------------------------- host:port


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7100", ("127.0.0.1", 7100)),
        ("example.org:1", ("example.org", 1)),
        ("[::1]:9000", ("::1", 9000)),
        ("[fe80::1%eth0]:65535", ("fe80::1%eth0", 65535)),
    ],
)
def test_hostport_parses(text: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(text) == expected
    assert parse_hostport(format_hostport(*expected)) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("nohost", "must be HOST:PORT"),
        (":80", "must be HOST:PORT"),
        ("h:", "bad port"),
        ("h:+80", "bad port"),
        ("h: 80", "bad port"),
        ("h:８０", "bad port"),
        ("h:65536", "out of range"),
        ("h:0", "out of range [1, 65535]"),
        ("::1:80", "IPv6 host goes in brackets"),
        ("[::1]80", "[IPV6]:PORT"),
        ("[::1", "[IPV6]:PORT"),
        ("a b:80", "must be HOST:PORT"),
        (5, "must be HOST:PORT"),
    ],
)
def test_hostport_refuses(text: object, reason: str) -> None:
    with pytest.raises(InputError, match=f"^--listen.*{re.escape(reason)}"):
        parse_hostport(text, what="--listen")


def test_hostport_port_zero_only_when_allowed() -> None:
    assert parse_hostport("127.0.0.1:0", allow_port_zero=True) == ("127.0.0.1", 0)
    with pytest.raises(InputError):
        parse_hostport("127.0.0.1:0")


# ---------------------------------------------------------------------------------------------- manifest TOML


def test_manifest_toml_survives_newlines_quotes_and_ipv6() -> None:
    ranks = (
        RankEntry(0, 0, 3, "127.0.0.1", 7100, 'stage "0"\\\n.gguf'),
        RankEntry(1, 3, 6, "::1", 7101, None, "relay"),
    )
    m = Manifest(SHA, 6, ranks, model_name='evil\nname = "x"\n[model]', secret="ff", relay="wss://r/")
    text = m.to_toml()
    assert parse_manifest(tomllib.loads(text)) == m
    assert 'listen = "[::1]:7101"' in text


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({"rank": [{"layers": [0, 2], "listen": "h:1"}]}, "model: required field missing"),
        ({"model": {"sha256": SHA, "layers": 2}}, "needs at least one"),
        ({"model": {"sha256": SHA, "layers": 2}, "rank": [{"layers": [0, 2], "listen": "h:0"}]}, "out of range"),
        ({"model": {"sha256": SHA, "layers": 2}, "rank": [{"layers": [0, 2], "listen": "h:1", "link": "x"}]}, "link"),
        ({"model": {"sha256": "", "layers": 2}, "rank": [{"layers": [0, 2], "listen": "h:1"}]}, "sha256"),
        ({"model": {"sha256": SHA, "layers": 0}, "rank": [{"layers": [0, 2], "listen": "h:1"}]}, "layers"),
    ],
)
def test_manifest_refuses(data: dict[str, Any], reason: str) -> None:
    with pytest.raises(InputError, match=reason):
        parse_manifest(data, "ring.toml")


# ---------------------------------------------------------------------------------------------- control ops


def test_control_ops_parse() -> None:
    assert parse_op({"op": "status", "anything": 1}) == StatusOp()
    assert parse_op({"op": "watch", "interval": 0.01}) == WatchOp(0.01)
    assert WatchOp(99).clamped_interval == 10.0
    assert parse_op({"op": "cancel", "request": 7}) == CancelOp(7)
    gen = parse_op({"op": "generate", "prompt": "hi", "temperature": 0.5, "stop": ["\n"], "max_tokens": 3})
    assert isinstance(gen, GenerateOp)
    assert gen.sampling == attrs.evolve(SamplingParams.GREEDY, temperature=0.5)
    assert (gen.prompt, gen.stop, gen.max_tokens, gen.tokens) == ("hi", ("\n",), 3, None)
    assert parse_op({"op": "generate"}) == GenerateOp()  # the CLI's defaults: greedy, 64 tokens


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        ({"op": "nope"}, "unknown op 'nope'"),
        ({}, "unknown op None"),
        ({"op": "generate", "max_tokens": float("inf")}, "generate: max_tokens: must be an integer"),
        ({"op": "cancel", "request": 1e400}, "cancel: request: must be an integer"),
        ({"op": "generate", "top_p": 0}, "generate: top_p: must be in"),
        ({"op": "generate", "tokens": [1, "x"]}, r"generate: tokens\[1\]: must be an integer"),
        ({"op": "watch", "interval": "1"}, "watch: interval: must be a finite number"),
    ],
)
def test_control_ops_refuse(msg: dict[str, Any], reason: str) -> None:
    with pytest.raises(InputError, match=f"^{reason}"):
        parse_op(msg)
