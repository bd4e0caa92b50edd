"""The one schema layer: SamplingParams' default sets and ranges, the strict converter, host:port parsing, the
manifest's TOML, control-socket ops, and the TUI form that must not offer what the node refuses."""

from __future__ import annotations

import importlib
import json
import math
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvasir.api.schema import ApiError, parse_generation
from kvasir.control.ops import CancelOp, GenerateOp, StatusOp, WatchOp, parse_op
from kvasir.core import validators
from kvasir.core.errors import InputError
from kvasir.core.sampling import MAX_REPEAT_LAST_N, MAX_SEED, SamplingError, SamplingParams
from kvasir.core.schema import FieldError, SchemaError, is_registered, register_record, structure, unstructure
from kvasir.market.records import ClaimRequest, CoverageEntry, ModelRecord
from kvasir.ring.manifest import Manifest, RankEntry, parse_manifest
from kvasir.ring.status import (
    FailoverStatus,
    LinkStatus,
    MarketWindow,
    NodeStatus,
    RankStatus,
    RequestCounters,
    SupervisedProcess,
    SupervisorStatus,
)
from kvasir.tui.screens import MAX_TOKENS, parse_sampling
from kvasir.util.addr import format_hostport, parse_hostport
from kvasir.verify.audit import FraudProof, LoggedInput, WindowLog
from kvasir.verify.commit import TOKENS
from kvasir.wire import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS

SHA = "ab" * 32
REPO = Path(__file__).resolve().parent.parent

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
    keys = "model rank layers weight reward bytes sha256 holder lease_expires state endpoint confirmed claimable"
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


# ---------------------------------------------------------------------------------------------- one converter


def test_a_fresh_interpreter_refuses_a_list_for_any_record() -> None:
    """Strictness does not depend on what was imported first: in a new process that imports only the schema and
    SamplingParams, a JSON list is not "every field at its default"; nor is it for a class nobody registered."""
    code = (
        "import attrs\n"
        "from kvasir.core.sampling import SamplingParams\n"
        "from kvasir.core.schema import SchemaError, structure\n"
        "@attrs.frozen\n"
        "class Unregistered:\n"
        "    a: int = 1\n"
        "for cls in (SamplingParams, Unregistered):\n"
        "    try:\n"
        "        structure(['x'], cls, where='s')\n"
        "    except SchemaError as exc:\n"
        "        print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["s: must be an object, not ['x']"] * 2


def _attrs_classes() -> Iterator[type]:
    for base, package in ((REPO / "kvasir", "kvasir"), (REPO / "relay", "kvasir.relay"), (REPO / "tui", "kvasir.tui")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            if name in _UNIMPORTABLE:
                continue
            module = importlib.import_module(name)
            for obj in vars(module).values():
                if isinstance(obj, type) and attrs.has(obj) and obj.__module__ == name:
                    yield obj


#: Modules the walk does not import (their imports need what a test machine may lack), with why.
_UNIMPORTABLE: dict[str, str] = {"kvasir.__main__": "runs the CLI on import"}

#: attrs classes that never cross JSON or TOML through the converter, by module (every class in it) or by class,
#: with the reason. Anything else must be registered with the converter next to its class.
EXEMPT: dict[str, str] = {
    "kvasir.wire.frames": "binary frames: their own byte codec (docs/protocol.md § Frames)",
    "kvasir.wire.boundary": "binary boundary payloads: their own byte codec",
    "kvasir.shard": "GGUF files and their parse state: a binary format, read by the bounded parser",
    "kvasir.stage": "in-process stage configuration and results (llama.cpp), never serialised",
    "kvasir.ring.requests": "per-request state inside a node",
    "kvasir.ring.speculation": "in-process speculation state",
    "kvasir.ring.batching": "in-process batch gathering",
    "kvasir.ring.secure": "TLS and handshake state; the handshake is a binary frame",
    "kvasir.ring.edges": "relay edges derived from the manifest in process",
    "kvasir.ring.node": "node configuration and in-process state",
    "kvasir.ring.opener": "handshake state of a connection being admitted, in process",
    "kvasir.relay.conns": "the relay's table of open connections, in process",
    "kvasir.ring.config": "the node's configuration, built from flags in process",
    "kvasir.ring.links.LinkStats": "live link counters; the status reports them as LinkStatus (registered)",
    "kvasir.ring.manifest.Manifest": "the parsed manifest; its TOML goes through _ManifestFile (registered)",
    "kvasir.ring.manifest.RankEntry": "a parsed rank; its TOML goes through _RankTable (registered)",
    "kvasir.ring.manifest.StandbyEntry": "a parsed standby; its TOML goes through _StandbyTable (registered)",
    "kvasir.net": "HTTP server plumbing",
    "kvasir.util": "helpers (backoff state)",
    "kvasir.testing": "test and bench harnesses",
    "kvasir.local": "the `ring up` process supervisor's state",
    "kvasir.commands.ring._Outcome": "how a `ring up` run ended (what to keep of its run directory), in-process only",
    "kvasir.core.identity": "keys: they travel as text (PublicKey.to_text), never as objects",
    "kvasir.core.speculate": "in-process drafting state and counters",
    "kvasir.core.oracle.Oracle": "the benchmark oracle's drafting state, in process (its file is OracleSpec)",
    "kvasir.core.config.Config": "the resolved configuration; its TOML goes through ConfigFile (registered)",
    "kvasir.core.config.Setting": "one resolved setting and where it came from, built in process",
    "kvasir.planner.estimate": "planner results, printed (kvasir plan), never parsed",
    "kvasir.planner.speculation": "the speculation estimate, printed (kvasir plan --accept), never parsed",
    "kvasir.planner.profile.ModelProfile": "a profile in process; its TOML goes through _ProfileFile (registered)",
    "kvasir.planner.profile.LayerProfile": "one layer of a ModelProfile (the TOML lists columns, _ProfileFile)",
    "kvasir.api.schema.GenerationRequest": "built from an OpenAI body by hand (unions); _Options is registered",
    "kvasir.api.server.ApiAccess": "the API keys, loaded from a file in process",
    "kvasir.market.tickets": "window tickets: a signed text format (kvasir.core.signed), not JSON",
    "kvasir.core.clientauth": "client authorisations: a signed text format (kvasir.core.signed), not JSON",
    "kvasir.market.server.settle": "a paid request's receipts as the settlement rule reads them, in process",
    "kvasir.market.auth.Signed": "a verified request's signer, built from headers",
    "kvasir.market.records.FraudRecord": "the market store keeps it as SQL columns, never as JSON",
    "kvasir.market.agent": "the node agent's in-process state",
    "kvasir.market.server.ratelimit": "rate-limit buckets and rates, in process (built from the market's settings)",
    "kvasir.market.server.standing.LeaseRules": "the market's lease rules, built from `kvasir market` flags",
    "kvasir.verify.select": "which requests to keep for audit, in process",
    "kvasir.verify.audit.StepOutput": "a step computed in process; logged as LoggedInput (registered)",
    "kvasir.verify.audit.AuditResult": "an audit's verdict, printed, never parsed",
    "kvasir.relay.grant": "edge grants: a signed text format (kvasir.core.signed), not JSON",
    "kvasir.relay.server": "relay configuration and state, built from CLI flags",
}


def _exempt(cls: type) -> str | None:
    name = f"{cls.__module__}.{cls.__qualname__}"
    for key in sorted(EXEMPT, key=len, reverse=True):
        if name == key or name.startswith(key + "."):
            return EXEMPT[key]
    return None


def test_every_attrs_class_is_registered_or_exempt() -> None:
    classes = list(_attrs_classes())
    assert len(classes) > 100  # the walk found the tree
    loose = [f"{c.__module__}.{c.__qualname__}" for c in classes if not is_registered(c) and _exempt(c) is None]
    assert not loose, f"register these next to their class, or exempt them with a reason: {loose}"
    names = [f"{c.__module__}.{c.__qualname__}" for c in classes if not is_registered(c)]
    stale = [key for key in EXEMPT if not any(n == key or n.startswith(key + ".") for n in names)]
    assert not stale, f"exemptions that match no unregistered class: {stale}"


def test_registering_is_idempotent_of_import_order() -> None:
    """A record structures the same whichever modules were imported: the hooks live beside the classes."""
    assert is_registered(SamplingParams) and is_registered(NodeStatus) and is_registered(LoggedInput)
    with pytest.raises(SchemaError, match=r"^s: must be an object"):
        structure([], SamplingParams, where="s")


# ---------------------------------------------------------------------------------------------- node status

#: A status as the node wrote it before the status moved onto the converter: the bytes must not change.
STATUS_WIRE = (
    '{"node_id": "n1", "rank": 1, "ring_size": 3, "model": {"name": "m", "sha256": "' + "ab" * 32 + '", '
    '"layers": 18}, "window": [6, 12], "backend": "CPU", "threads": 4, "busy_s": 1.5, "handoff_s": 0.25, '
    '"send_s": 0.125, "ready": true, "uptime_s": 10.0, "ranks": [{"rank": 0, "layers": [0, 6], "address": "h:1", '
    '"link": "direct"}, {"rank": 1, "layers": [6, 12], "address": "h:2", "link": "relay"}], "links": '
    '{"predecessor": {"state": "down"}, "successor": {"state": "connected", "kind": "relay", "peer": "r:443", '
    '"frames_out": 1, "bytes_out": 2, "frames_in": 3, "bytes_in": 4, "rtt_ms": 15.1, "up_s": 9.6, "secure": true}}, '
    '"requests": {"in_flight": 1, "free_sequences": 2, "requests": 3, "tokens": 4, "boundaries": 5, "errors": 6, '
    '"verify_batches": 7, "drafted": 8, "accepted": 9, "decode_batches": 10, "batched_steps": 11, "eager_steps": 12}, '
    '"contribution": {"tokens": 4, "layer_tokens": 24}, "memory": {"rss_bytes": 1234}, "market": [{"rank": 0, '
    '"layers": [0, 6], "holder": "k", "reward": 1.5, "state": "serving"}, {"rank": 1, "layers": [6, 12], '
    '"holder": null, "reward": null, "state": null}], "failover": {"replays": 1, "requests": 2, "frames": 3, '
    '"bytes": 4, "duplicates": 5, "last_stall_s": 0.5, "last_window": [6, 12], "log_bytes": 99}}'
)
STATUS = NodeStatus(
    "n1", 1, 3, "m", "ab" * 32, 18, (6, 12), backend="CPU", threads=4, busy_s=1.5, handoff_s=0.25, send_s=0.125,
    ready=True, uptime_s=10.0, ranks=(RankStatus(0, (0, 6), "h:1"), RankStatus(1, (6, 12), "h:2", "relay")),
    predecessor=LinkStatus("down"), successor=LinkStatus("connected", "relay", "r:443", 1, 2, 3, 4, 15.1, 9.6, True),
    requests=RequestCounters(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), rss_bytes=1234,
    market=(MarketWindow(0, (0, 6), "k", 1.5, "serving"), MarketWindow(1, (6, 12))),
    failover=FailoverStatus(1, 2, 3, 4, 5, 0.5, (6, 12), 99),
)  # fmt: skip


def test_status_wire_bytes_are_unchanged() -> None:
    assert json.dumps(STATUS.to_wire()) == STATUS_WIRE
    assert NodeStatus.from_wire(json.loads(STATUS_WIRE)) == STATUS
    bare = NodeStatus("n1", 0, 1, "m", "", 4, (0, 4)).to_wire()
    assert bare["links"] == {"predecessor": {"state": "unknown"}, "successor": {"state": "unknown"}}
    assert bare["memory"] == {} and bare["market"] is None and bare["threads"] is None
    assert "supervisor" not in bare  # only a node under `ring up` says what its supervisor wrote


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ready": "false"}, "status: ready: must be true or false, not 'false'"),
        ({"rank": 3.9}, "status: rank: must be an integer, not 3.9"),
        ({"rank": "3"}, "status: rank: must be an integer, not '3'"),
        ({"window": ["0", 4]}, "status: window[0]: must be an integer, not '0'"),
        ({"window": [0, 4, 8]}, "status: window: must be a list of 2, not [0, 4, 8]"),
        ({"window": "04"}, "status: window: must be a list of 2, not '04'"),
        ({"threads": "4"}, "status: threads: must be an integer, not '4'"),
        ({"busy_s": "1.5"}, "status: busy_s: must be a finite number, not '1.5'"),
        ({"model": {"layers": "18"}}, "status: model.layers: must be an integer, not '18'"),
        ({"links": {"successor": {"secure": 1}}}, "status: links.successor.secure: must be true or false, not 1"),
        ({"requests": {"tokens": True}}, "status: requests.tokens: must be an integer, not True"),
        ({"ranks": [{"rank": 0}]}, "status: ranks[0].layers: required field missing"),
        ({"market": [{"rank": 0, "layers": [0, 6], "reward": "1"}]}, "status: market[0].reward: must be a finite"),
        ({"failover": {"last_window": [6]}}, "status: failover.last_window: must be a list of 2, not [6]"),
        ({"memory": []}, "status: memory: must be an object, not []"),
    ],
)
def test_status_refuses_wrong_types_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SchemaError) as info:
        NodeStatus.from_wire({**json.loads(STATUS_WIRE), **change})
    assert str(info.value).startswith(message)


def test_status_is_lenient_only_about_absent_fields() -> None:
    status = NodeStatus.from_wire({"rank": 2, "window": [0, 4], "links": {"successor": {"kind": "direct"}}})
    assert (status.node_id, status.ready, status.requests, status.market) == ("", False, RequestCounters(), None)
    assert status.predecessor == LinkStatus("unknown") and status.successor.up and status.successor.state == "unknown"
    for required in ("rank", "window"):
        with pytest.raises(SchemaError, match=f"^status: {required}: required field missing$"):
            NodeStatus.from_wire({k: v for k, v in {"rank": 2, "window": [0, 4]}.items() if k != required})


_counts = st.integers(min_value=0, max_value=2**53)
_floats = st.floats(allow_nan=False, allow_infinity=False)
_pairs = st.tuples(st.integers(0, 1000), st.integers(0, 1000))
_links = st.one_of(
    st.builds(LinkStatus, st.text()),
    st.builds(LinkStatus, st.text(), st.text(), st.text(), _counts, _counts, _counts, _counts,
              st.none() | _floats, st.none() | _floats, st.booleans()),
)  # fmt: skip
_statuses = st.builds(
    NodeStatus,
    node_id=st.text(), rank=_counts, ring_size=_counts, model_name=st.text(), model_sha256=st.text(),
    n_layers=_counts, window=_pairs, backend=st.text(), threads=st.none() | _counts, busy_s=_floats,
    handoff_s=_floats, send_s=_floats, ready=st.booleans(), uptime_s=_floats,
    ranks=st.lists(st.builds(RankStatus, _counts, _pairs, st.text(), st.text()), max_size=3).map(tuple),
    predecessor=_links, successor=_links,
    requests=st.builds(RequestCounters, *[_counts] * len(attrs.fields(RequestCounters))),
    rss_bytes=st.none() | _counts,
    market=st.none() | st.lists(st.builds(MarketWindow, _counts, _pairs, st.none() | st.text(),
                                          st.none() | _floats, st.none() | st.text()), max_size=3).map(tuple),
    failover=st.builds(FailoverStatus, _counts, _counts, _counts, _counts, _counts, st.none() | _floats,
                       st.none() | _pairs, _counts),
    supervisor=st.none() | st.builds(
        SupervisorStatus, _floats,
        st.lists(st.builds(SupervisedProcess, st.text(), st.text(), st.none() | _counts, _counts,
                           st.none() | st.integers(-64, 255), st.none() | _floats, st.none() | _floats),
                 max_size=3).map(tuple),
    ),
)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(_statuses)
def test_status_round_trips_through_json(status: NodeStatus) -> None:
    wire = json.loads(json.dumps(status.to_wire()))
    assert NodeStatus.from_wire(wire) == status
    assert wire["contribution"] == {"tokens": status.requests.tokens, "layer_tokens": status.layer_tokens}


_sampling = st.builds(
    SamplingParams,
    temperature=st.floats(0, 100),
    top_k=st.integers(0, 2**31 - 1),
    top_p=st.floats(0, 1, exclude_min=True),
    min_p=st.floats(0, 1),
    seed=st.none() | st.integers(0, MAX_SEED),
)


@settings(max_examples=60, deadline=None)
@given(_sampling)
def test_sampling_round_trips_through_json(params: SamplingParams) -> None:
    assert structure(json.loads(json.dumps(unstructure(params))), SamplingParams, where="s") == params


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_keyed_json = st.fixed_dictionaries(
    {},
    optional={
        k: _json
        for k in ("kind", "suspect", "step", "inputs", "predecessor", "receipt", "pos", "n_tokens", "dtype", "payload")
    },
)


@settings(max_examples=150, deadline=None)
@given(st.one_of(_json, _keyed_json))
def test_untrusted_json_parses_or_is_one_schema_error(data: object) -> None:
    """What a market or a TUI reads from a peer either parses or is refused as one SchemaError line; no other
    exception escapes (the market answers it 400, the TUI skips the snapshot)."""
    for cls in (FraudProof, WindowLog, LoggedInput, NodeStatus):
        try:
            cls.from_wire(data)
        except SchemaError as exc:
            assert "\n" not in str(exc)


_logged = st.integers(1, 8).flatmap(
    lambda n: st.builds(
        LoggedInput,
        st.integers(0, 2**32 - 1),
        st.just(n),
        st.sampled_from([TOKENS, 0, 1, 2]),
        st.binary(min_size=0, max_size=0),
    ).flatmap(
        lambda b: st.binary(min_size=4 * n, max_size=4 * n).map(
            lambda raw: attrs.evolve(b, payload=raw if b.dtype in (TOKENS, 0) else raw[: 2 * n])
        )
    )
)


@settings(max_examples=100, deadline=None)
@given(_logged)
def test_logged_inputs_round_trip_through_json(logged: LoggedInput) -> None:
    wire = json.loads(json.dumps(logged.to_wire()))
    assert list(wire) == ["pos", "n_tokens", "dtype", "payload"] and "=" not in wire["payload"]
    assert LoggedInput.from_wire(wire) == logged


# ---------------------------------------------------------------------------------------------- field validators


@attrs.frozen
class _Rules:
    count: int = attrs.field(default=1, validator=validators.int_in(1, 9))
    low: int = attrs.field(default=0, validator=validators.int_in(0, key="lower"))
    ratio: float = attrs.field(default=0.5, validator=validators.number_in(0, 1, open_low=True))
    size: float | None = attrs.field(default=None, validator=validators.at_least(1, optional=True))
    rate: float = attrs.field(default=1.0, validator=validators.positive())
    gap: float = attrs.field(default=0.0, validator=validators.positive(zero=True))
    kind: str = attrs.field(default="a", validator=validators.one_of("a", "b"))
    name: str | None = attrs.field(default=None, validator=validators.optional(validators.matches("[a-z]+", "lower")))


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"count": 10}, "count", "must be an integer in [1, 9]"),
        ({"count": True}, "count", "must be an integer in [1, 9]"),
        ({"low": -1}, "lower", "must be an integer >= 0"),
        ({"ratio": 0}, "ratio", "must be a number in (0, 1]"),
        ({"ratio": "1"}, "ratio", "must be a number, got str"),
        ({"ratio": math.inf}, "ratio", "must be a number in (0, 1]"),
        ({"size": 0.5}, "size", "must be at least 1, not 0.5"),
        ({"rate": 0}, "rate", "must be a positive number, not 0"),
        ({"gap": -1}, "gap", "must be a positive number, not -1"),
        ({"kind": "c"}, "kind", "must be one of a, b"),
        ({"name": "A"}, "name", "lower"),
    ],
)
def test_validators_name_the_field_and_the_rule(change: dict[str, Any], field: str, reason: str) -> None:
    with pytest.raises(FieldError) as info:
        _Rules(**change)
    assert (info.value.field, info.value.reason) == (field, reason)


def test_validators_take_another_error_and_pass_good_values() -> None:
    assert _Rules(count=9, low=5, ratio=1, size=None, rate=0.1, gap=0, kind="b", name="ok").count == 9

    class Wrong(InputError):
        pass

    check = validators.positive(error=lambda field, reason: Wrong(f"{field} {reason}"))
    with pytest.raises(Wrong, match=r"^t must be a positive number, not 0$"):
        check(None, attrs.fields(_Rules).rate.evolve(name="t"), 0)
