"""bench/market_attack.py: its pure parts, and the bench itself at a tiny size on a real market ring (slow).

The slow tests read one run of the bench (all four attackers, a tiny llama): its table must be well formed, and per
phase no honest answer may differ from the whole model's, every honest request must be served, and every attack
must be refused. Attacks that still succeed on this code are marked ``xfail(strict=True)`` with the finding that
fixes them: once the fix is merged the test passes, strict xfail turns that into a failure, and the marker goes.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvasir.core.sampling import SamplingParams
from kvasir.wire import StartRequest
from tests.conftest import REPO
from tests.harness.evil_start import rewrite
from tests.harness.marketattack import (
    OUTCOMES,
    Answer,
    check_row,
    classify,
    cut_links,
    jobs,
    phase_row,
)

PHASES = ("squat", "baseline", "sybil", "start", "slots", "after")
CALM = ("baseline", "after")


def test_classify_tells_identical_different_and_failed() -> None:
    end = {"type": "end", "reason": "max_tokens"}
    assert classify([1, 2, 3], end, None, [1, 2, 3]) == ("identical", None)
    outcome, detail = classify([1, 2, 4, 5], end, None, [1, 2, 3])
    assert outcome == "different" and detail is not None and "first difference at 2" in detail
    assert classify([1, 2], end, None, [1, 2, 3])[0] == "different"  # a cut-short answer is not the reference
    assert classify([], None, "RingError: gone", [1])[0] == "failed"
    assert classify([1], {"reason": "error", "error": {"code": "params_mismatch"}}, None, [1])[0] == "failed"
    assert classify([1], None, None, [1]) == ("failed", "no end")


def test_phase_rows_count_and_check_their_structure() -> None:
    answers = [
        Answer("p", 0, "identical", 1.0),
        Answer("p", 1, "different", 3.0, "x"),
        Answer("p", 2, "failed", 9.0, "y"),
    ]
    row = phase_row("p", answers, {"attacker": "a", "attempted": "", "achieved": "", "succeeded": False})
    assert (row["requests"], row["served"], row["identical"], row["different"], row["failed"]) == (3, 2, 1, 1, 1)
    assert row["p95_s"] == 3.0  # over served requests only
    assert check_row(row) == []
    assert check_row({**row, "served": 3}) != []
    assert check_row({k: v for k, v in row.items() if k != "p50_s"}) == ["missing p50_s"]
    assert check_row({**row, "attack": {"attacker": "a"}}) != []
    assert phase_row("q", [Answer("q", 0, "failed", 0.0)], None)["p50_s"] is None


def test_jobs_alternate_greedy_and_seeded() -> None:
    js = jobs(4)
    assert [j.temperature == 0 for j in js] == [True, False, True, False]
    assert js[1].seed is not None and js[1].seed != js[3].seed
    assert js[1].sampling().seed == js[1].seed and js[0].sampling() == SamplingParams.GREEDY


def test_the_evil_member_rewrites_sampling_and_max_tokens() -> None:
    start = StartRequest(request_id=3, prompt=(1, 2), max_tokens=8, entry_rank=0, entry_node_id="n" * 16)
    out = rewrite(start)
    assert out.max_tokens == 32 and out.sampling.temperature == 1.5 and out.prompt == start.prompt


def test_cut_links_drops_an_established_connection() -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as c:
            a, _ = srv.accept()
            with a:
                what = cut_links(port)
                if what.startswith("failed"):
                    pytest.skip(f"this machine cannot cut sockets: {what}")
                a.settimeout(5)
                with pytest.raises(OSError):
                    if a.recv(1) == b"":  # a clean end would be no cut
                        raise AssertionError("closed, not cut")
                    c.recv(1)


@pytest.fixture(scope="module")
def bench_run(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = tiny_model("llama", "q8_0", n_layer=8)
    out = tmp_path_factory.mktemp("attack") / "rows.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "bench" / "market_attack.py"), "--model", str(model), "--windows",
         "0:3,3:4,4:6,6:8", "--requests", "2", "--max-tokens", "8", "--squat-wait", "75", "--save", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.exists(), r.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    result["rc"], result["stdout"] = r.returncode, r.stdout
    return result


def _row(run: dict[str, Any], phase: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [r for r in run["rows"] if r["phase"] == phase]
    (row,) = rows
    return row


@pytest.mark.slow
def test_the_bench_reports_every_phase(bench_run: dict[str, Any]) -> None:
    assert [r["phase"] for r in bench_run["rows"]] == list(PHASES)
    for r in bench_run["rows"]:
        assert check_row(r) == [], r
        assert r["requests"] == 2 and sum(r[k] for k in OUTCOMES) == 2
        assert (r["attack"] is None) == (r["phase"] in ("baseline", "after"))
        if r["attack"] is not None:
            assert isinstance(r["attack"]["succeeded"], bool), r["attack"]
    base = _row(bench_run, "baseline")
    assert base["identical"] == 2 and base["p50_s"] > 0
    assert "honest requests per phase" in bench_run["stdout"]
    assert bench_run["rc"] == (1 if any(r["different"] for r in bench_run["rows"]) else 0)
    assert _row(bench_run, "start")["attack"]["rewrites"] >= 2  # the member really rewrote the honest STARTs


def _open(*phases: str, why: str) -> list[Any]:
    return [pytest.param(p, marks=pytest.mark.xfail(strict=True, reason=why)) if p in phases else p for p in PHASES]


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_no_honest_answer_differs(bench_run: dict[str, Any], phase: str) -> None:
    row = _row(bench_run, phase)
    assert row["different"] == 0, row["details"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase",
    _open(
        "start",
        why="a member on the path that rewrites START fails those requests (PARAMS_MISMATCH: detected, never an altered"
        " answer); the ring does not route around it yet",
    ),
)
def test_every_honest_request_is_served(bench_run: dict[str, Any], phase: str) -> None:
    row = _row(bench_run, phase)
    assert row["failed"] == 0, row["details"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase",
    [p for p in PHASES if p not in CALM],
)
def test_every_attack_is_refused(bench_run: dict[str, Any], phase: str) -> None:
    attack = _row(bench_run, phase)["attack"]
    assert attack["succeeded"] is False, attack
