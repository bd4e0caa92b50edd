"""The pure parts of bench/chaos.py (its real run is the benchmark itself: docs/benchmarks.md § Chaos): reading a
stream, classifying an answer against its reference, percentiles, served seconds, and finding ``ring up``'s nodes."""

from __future__ import annotations

import importlib.util
import itertools
import json
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_chaos", REPO / "bench" / "chaos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chaos = _load()


def _event(content: str | None = None, finish: str | None = None, role: bool = False) -> str:
    delta = {"role": "assistant", "content": ""} if role else ({"content": content} if content is not None else {})
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


STREAM = [_event(role=True), "", _event("Hel"), "", _event("lo"), _event(finish="length"), "data: [DONE]", ""]


def _read(lines: list[str]) -> tuple[Any, list[float]]:
    ticks = itertools.count(1.0)
    chunks: list[float] = []
    return chaos.sse_answer(iter(lines), 0.0, chunks, clock=lambda: next(ticks)), chunks


def test_a_stream_read_to_done_keeps_its_text_finish_and_chunk_times() -> None:
    answer, chunks = _read(STREAM)
    assert (answer.end, answer.text, answer.finish, answer.chunks) == ("done", "Hello", "length", (1.0, 2.0))
    assert chunks == [1.0, 2.0]  # the role preamble and the finish event are not content


def test_an_error_event_fails_with_its_code_and_a_stream_without_done_is_cut() -> None:
    error = "data: " + json.dumps({"error": {"message": "x", "code": "entry_lost"}})
    failed, _ = _read([*STREAM[:3], error])
    assert (failed.end, failed.code, failed.text) == ("error", "entry_lost", "Hel")
    cut, chunks = _read(STREAM[:5])
    assert (cut.end, cut.text) == ("cut", "Hello") and chunks == [1.0, 2.0]


def test_classify_compares_text_and_finish_with_the_reference() -> None:
    ref = chaos.Answer("done", "Hello", "length")
    assert chaos.classify(chaos.Answer("done", "Hello", "length"), ref) == ("identical", None)
    assert chaos.classify(chaos.Answer("done", "Help", "length"), ref) == ("different", None)
    assert chaos.classify(chaos.Answer("done", "Hello", "stop"), ref) == ("different", None)
    assert chaos.classify(chaos.Answer("error", code="entry_lost"), ref) == ("failed", "entry_lost")
    assert chaos.classify(chaos.Answer("refused", code="503 x"), ref) == ("refused", "503 x")
    assert chaos.classify(chaos.Answer("cut", code="ReadError"), ref) == ("cut", "ReadError")


@pytest.mark.parametrize(("q", "want"), [(50, 5.0), (90, 9.0), (99, 10.0), (100, 10.0), (1, 1.0)])
def test_percentile_by_nearest_rank(q: float, want: float) -> None:
    assert chaos.percentile([float(x) for x in range(10, 0, -1)], q) == want


def test_percentile_of_nothing_is_none() -> None:
    assert chaos.percentile([], 50) is None


def test_served_slots_count_only_completed_requests_and_the_longest_outage() -> None:
    done = chaos.Record(0, 0.2, "chaos", "identical", None, (0.5, 1.2, 4.9))
    cut = chaos.Record(1, 0.1, "chaos", "failed", "entry_lost", (2.5, 3.5))
    served = chaos.served_slots([done, cut], 0.0, 6.0)
    assert served == [True, True, False, False, True, False]
    assert chaos.longest_gap(served) == 2
    assert chaos.served_slots([done], 1.0, 3.0) == [True, False]  # a later phase: slots from its own start
    assert done.stall == pytest.approx(3.7) and done.ttft == pytest.approx(0.3)
    assert chaos.outage_after([done, cut], 1.0, 4.0) == 2.0  # slots 1..4 s: served, out, out, served


def test_node_label_names_primaries_and_standbys_and_nothing_else() -> None:
    base = ["python", "-m", "kvasir", "node", "--manifest", "m.toml", "--rank", "2", "--ctx", "1024"]
    assert chaos.node_label(base) == "rank 2"
    assert chaos.node_label([*base, "--standby", "0"]) == "rank 2 standby"
    assert chaos.node_label(["python", "-m", "kvasir", "ring", "up"]) is None
    assert chaos.node_label([""]) is None


def test_a_schedule_reads_in_time_order_and_names_a_bad_item() -> None:
    planned = chaos.parse_schedule("40:STOP:rank 0 standby, 20:KILL:rank 1,")
    assert [(p.at, p.signal, p.label) for p in planned] == [
        (20.0, "SIGKILL", "rank 1"),
        (40.0, "SIGSTOP", "rank 0 standby"),
    ]
    for bad in ("20:KILL", "20:TERM:rank 1", "x:KILL:rank 1", "20:KILL:rank one", ""):
        with pytest.raises(ValueError, match="schedule"):
            chaos.parse_schedule(bad)
