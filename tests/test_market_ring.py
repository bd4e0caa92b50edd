"""End to end on loopback: a market, a model seeder and empty nodes that claim windows, fetch only them, form a
ring that gives exactly the whole model's tokens, are paid from a client's account for its paid requests, and heal
when a node dies."""

from __future__ import annotations

import itertools
import json
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvasir.control.client import ControlClient
from kvasir.core.clientauth import MICRO, sign_auth
from kvasir.core.identity import Identity, PublicKey
from kvasir.shard.gguf_io import read_gguf
from kvasir.shard.slice import window_ranges
from kvasir.verify.audit import read_json
from kvasir.verify.commit import WindowReceipt, first_mismatch
from tests.marketutil import Proc, coverage, procs, wait_for
from tests.ringutil import ring_generate, whole_model, whole_model_tokens

PROMPT = "The ring passes the hidden state on"
WINDOWS = "0:2,2:4,4:6"
# Reward per byte: 4:6 best, then 0:2, then 2:4, so nodes with these budgets start together and never collide.
WEIGHTS = "2,1,3"
BUDGETS = {"big": "1MB", "mid": "150kB", "small": "100kB"}
LEASE = "2"


def _node(market: str, name: str, tmp: Path, budget: str, *extra: str) -> Proc:
    return Proc(
        "node",
        "--market",
        market,
        "--memory-budget",
        budget,
        "--lease",
        LEASE,
        "--poll",
        "0.3",
        "--seed",
        "1",
        "--threads",
        "1",
        "--ctx",
        "256",
        "--seqs",
        "2",
        "--control",
        str(tmp / f"{name}.sock"),
        "--stage-dir",
        str(tmp / f"stages-{name}"),
        *extra,
    )


def _seed_and_publish(ps: list[Proc], model: Path, market_url: str, *extra: str) -> None:
    """Serve the model over HTTP (Range) and publish it, with the test's windows and weights, on the market."""
    seeder = Proc("serve-model", str(model), "--listen", "127.0.0.1:0")
    ps.append(seeder)
    source = seeder.wait_line(r"serving (http://\S+)").group(1)
    pub = Proc(
        "market",
        "publish",
        str(model),
        "--url",
        market_url,
        "--source",
        source,
        "--windows",
        WINDOWS,
        "--weights",
        WEIGHTS,
        *extra,
    )
    assert pub.wait(120) == 0, pub.err


def _enrolled(p: Proc) -> dict[str, Any]:
    m = p.wait_line(r"^kvasir node: enrolled (.*)$", timeout=120)
    status: dict[str, Any] = json.loads(m.group(1))
    return status


@pytest.mark.slow
def test_empty_nodes_enroll_serve_earn_and_heal(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "q8_0")
    want = whole_model_tokens(model, PROMPT, 12)
    gg = read_gguf(model)
    with procs() as ps:
        operator = ("--identity", str(tmp_path / "operator.pem"), "--create-identity")
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "market.sqlite"), *operator)
        ps.append(market)
        url = market.wait_line(r"listening on (http://\S+)").group(1)
        key = market.wait_line(r"operator (ed25519:\S+)").group(1)
        _seed_and_publish(ps, model, url, *operator)  # signed by the operator: nodes pinned to its key load it

        t0 = time.monotonic()
        record = ("--record", str(tmp_path / "record"))  # market nodes sign receipts of what they serve
        nodes = {
            name: _node(url, name, tmp_path, budget, "--market-key", key, *record) for name, budget in BUDGETS.items()
        }
        ps.extend(nodes.values())
        status = {name: _enrolled(p) for name, p in nodes.items()}
        live = wait_for(lambda: coverage(url)["live"], 120, "full coverage")
        t_full = time.monotonic() - t0
        assert live
        held = {name: tuple(s["window"]) for name, s in status.items()}
        assert held == {"big": (4, 6), "mid": (0, 2), "small": (2, 4)}
        for name, s in status.items():
            (fetch,) = s["fetched"]
            a, b = held[name]
            window_bytes = sum(n for _, n in window_ranges(gg, a, b))
            assert fetch["window_bytes"] == window_bytes
            assert fetch["bytes_fetched"] <= (window_bytes + gg.data_offset) * 1.01, fetch
            print(
                f"{name}: window {a}:{b} fetched {fetch['bytes_fetched']} bytes (window {window_bytes},"
                f" header {fetch['header_bytes']}, file {gg.file_size}), joined after {s['joined_after_s']:.2f} s"
            )
        print(f"full coverage after {t_full:.2f} s")

        got = wait_for(lambda: ring_generate(tmp_path / "big.sock", PROMPT, 12), 60, "a ring reply")
        assert got["tokens"] == want
        receipts = wait_for(lambda: _receipts(tmp_path / "record", 3), 30, "three receipts of the request")
        assert {r.key.fingerprint for r in receipts} == {st["node_id"] for st in status.values()}
        chain = sorted(receipts, key=lambda r: r.start)
        for a, b in itertools.pairwise(chain):
            assert first_mismatch(a.output_hashes, b.input_hashes) is None
        for name in nodes:  # every link authenticated by key and window ticket, and encrypted (protocol v2)
            with ControlClient(tmp_path / f"{name}.sock", 10) as c:
                links = c.status()["links"]
            assert links["predecessor"]["secure"] and links["successor"]["secure"], (name, links)

        # Nobody paid for that request: after several report periods nothing is credited (paid requests:
        # test_a_paid_request_through_a_market_ring_moves_its_price).
        time.sleep(3)  # reports go every lease / 3 s
        assert httpx.get(f"{url}/v1/ledger", timeout=10).json()["nodes"] == []

        # A node dies without releasing: its window is uncovered once its lease ends, a fresh node claims it.
        nodes["mid"].stop(signal.SIGKILL)
        t1 = time.monotonic()
        wait_for(lambda: coverage(url)["windows"][0]["holder"] is None, 30, "the dead node's lease to end")
        fresh = _node(url, "fresh", tmp_path, BUDGETS["mid"])
        ps.append(fresh)
        st = _enrolled(fresh)
        assert tuple(st["window"]) == (0, 2)
        wait_for(lambda: coverage(url)["live"], 60, "full coverage again")
        print(f"healed after {time.monotonic() - t1:.2f} s")
        got = wait_for(lambda: _try(tmp_path / "small.sock"), 60, "requests to succeed again")
        assert got["tokens"] == want

        # Graceful stop releases the lease at once.
        assert fresh.stop() == 0
        assert coverage(url)["windows"][0]["holder"] is None
        status_cli = Proc("market", "status", "--url", url)
        assert status_cli.wait(60) == 0
        text = "\n".join(status_cli.out)
        assert "2/3 windows covered, not live" in text and "contributions" in text


def test_a_paid_request_through_a_market_ring_moves_its_price(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Issue 24 item 4 end to end: three empty nodes enroll from a real market and form a ring; the operator funds a
    client (`kvasir market fund`); the client's request with its signed authorisation enters at the last rank's API
    and is answered bit-exactly; every window's holder sends its receipt, and the market moves exactly tokens ×
    each window's price from the client's account to each holder's, once. An unpaid request earns nothing."""
    model = tiny_model("llama", "q8_0")
    want = whole_model(model, PROMPT, 12)
    client = Identity.generate()
    with procs() as ps:
        db = tmp_path / "market.sqlite"
        operator = ("--identity", str(tmp_path / "operator.pem"), "--create-identity")
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(db), *operator)
        ps.append(market)
        url = market.wait_line(r"listening on (http://\S+)").group(1)
        key = market.wait_line(r"operator (ed25519:\S+)").group(1)
        _seed_and_publish(ps, model, url, *operator)
        port = _free_port()
        nodes = {
            name: _node(
                url, name, tmp_path, budget, "--market-key", key, *(("--api-port", str(port)) if name == "big" else ())
            )
            for name, budget in BUDGETS.items()
        }
        ps.extend(nodes.values())
        for p in nodes.values():
            _enrolled(p)
        windows = wait_for(lambda: coverage(url)["live"] and coverage(url)["windows"], 120, "full coverage")
        fund = Proc("market", "fund", "--db", str(db), "--key", client.public.to_text(), "--credits", "1000")
        assert fund.wait(60) == 0, fund.err
        sha = httpx.get(f"{url}/v1/models", timeout=10).json()["models"][0]["sha256"]
        auth = sign_auth(client, PublicKey.from_text(key), sha, max_tokens=12, max_price=100 * MICRO,
                         not_after=int(time.time()) + 600)  # fmt: skip
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}

        def paid() -> dict[str, Any] | None:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60,
                               headers={"x-kvasir-client-auth": auth})  # fmt: skip
            except httpx.HTTPError:
                return None
            return r.json() if r.status_code == 200 else None

        answer = wait_for(paid, 60, "a paid answer from the ring's API")
        assert answer["choices"][0]["text"] == want.text and answer["usage"]["completion_tokens"] == len(want.tokens)
        assert ring_generate(tmp_path / "mid.sock", PROMPT, 12)["tokens"] == want.tokens  # unpaid, bit-exact too

        def account(k: str) -> dict[str, Any]:
            r = httpx.get(f"{url}/v1/accounts", params={"key": k}, timeout=10)
            return r.json() if r.status_code == 200 else {"balance": 0, "paid": 0, "earned": 0}

        paid_by = wait_for(lambda: account(client.public.to_text())["paid"] or None, 30, "the request to settle")
        # Weights 2, 1, 3 at no prior demand: 6 credits a token in all, 12 tokens.
        prices = [2 * MICRO, 1 * MICRO, 3 * MICRO]
        assert paid_by == 12 * sum(prices)
        assert account(client.public.to_text())["balance"] == 1000 * MICRO - paid_by
        assert [account(w["holder_key"])["earned"] for w in windows] == [12 * p for p in prices]
        time.sleep(2)  # the unpaid request's receipts would have come by now: nothing more moved
        assert account(client.public.to_text())["paid"] == paid_by
        ledger = {n["node_id"]: n for n in httpx.get(f"{url}/v1/ledger", timeout=10).json()["nodes"]}
        for w in windows:
            row = ledger[w["holder"]]
            a, b = w["layers"]
            assert (row["tokens"], row["layer_tokens"]) == (12, 12 * (b - a))
            assert set(row["confirmed_by"]) == {v["holder"] for v in windows} - {w["holder"]}
        print(f"settled: client paid {paid_by / MICRO} credits for 12 tokens; holders earned "
              f"{[account(w['holder_key'])['earned'] / MICRO for w in windows]}")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _receipts(directory: Path, n: int) -> list[WindowReceipt] | None:
    found = [WindowReceipt.from_wire(read_json(p)) for p in sorted((directory / "receipts").glob("*.json"))]
    for r in found:
        r.verify()
    return found if len(found) >= n else None


def _try(sock: Path) -> dict[str, object] | None:
    try:
        r = ring_generate(sock, PROMPT, 12)
    except Exception:
        return None
    return r if r.get("reason") in ("max_tokens", "eog") else None


def test_enrollment_through_a_relay_with_the_market_inside_it(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """`kvasir relay --market`: one process bridges every ring edge and runs the market; nodes dial out only. No
    secret anywhere: the market signs each holder's relay edge grants, and the relay trusts the market's key."""
    model = tiny_model("llama", "q8_0")
    want = whole_model_tokens(model, PROMPT, 12)
    with procs() as ps:
        relay = Proc(
            "relay",
            "--listen",
            "127.0.0.1:0",
            "--market",
            "127.0.0.1:0",
            "--db",
            str(tmp_path / "market.sqlite"),
        )
        ps.append(relay)
        relay_url = relay.wait_line(r"listening on (ws://\S+)").group(1)
        url = relay.wait_line(r"market on (http://\S+)").group(1)
        _seed_and_publish(ps, model, url)
        nodes = {name: _node(url, name, tmp_path, budget, "--relay", relay_url) for name, budget in BUDGETS.items()}
        ps.extend(nodes.values())
        for p in nodes.values():
            _enrolled(p)
        assert wait_for(lambda: coverage(url)["live"], 120, "full coverage")
        got = wait_for(lambda: _try(tmp_path / "mid.sock"), 60, "a ring reply through the relay")
        assert got["tokens"] == want
        with ControlClient(tmp_path / "small.sock") as c:
            links = c.status()["links"]
        assert links["predecessor"]["kind"] == "relay" and links["successor"]["kind"] == "relay"

        def market_view() -> list[dict[str, object]] | None:
            with ControlClient(tmp_path / "big.sock") as c:
                view = c.status()["market"]
            return view if view and all(w["holder"] for w in view) else None

        view = wait_for(market_view, 30, "the market's map in the node's status (the TUI's coverage map)")
        assert [w["layers"] for w in view] == [[0, 2], [2, 4], [4, 6]] and all(w["reward"] > 0 for w in view)


@pytest.mark.slow
def test_a_killed_holder_is_replaced_by_a_waiting_claimant_and_answers_go_on(
    gemma_path: Path, cache_dir: Path, tmp_path: Path
) -> None:
    """A market ring of Gemma 3 270M: the holder of the middle window is SIGKILLed at token 16 of 64; a spare node
    that was waiting for work claims the window when the dead lease ends, fetches and loads it, its predecessor
    replays the request into it, and the client's answer is exactly the fault-free one."""
    with procs() as ps:
        operator = ("--identity", str(tmp_path / "operator.pem"), "--create-identity")
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "market.sqlite"), *operator)
        ps.append(market)
        url = market.wait_line(r"listening on (http://\S+)").group(1)
        seeder = Proc("serve-model", str(gemma_path), "--listen", "127.0.0.1:0")
        ps.append(seeder)
        source = seeder.wait_line(r"serving (http://\S+)").group(1)
        windows = ("--windows", "0:6,6:12,12:18")
        pub = Proc("market", "publish", str(gemma_path), "--url", url, "--source", source, *windows, *operator)
        assert pub.wait(300) == 0, pub.err
        nodes = {}
        for k in range(3):
            nodes[f"n{k}"] = _node(url, f"n{k}", tmp_path, "1GB", "--seed", str(k), "--ctx", "512")
            ps.append(nodes[f"n{k}"])
        status = {name: _enrolled(p) for name, p in nodes.items()}
        wait_for(lambda: coverage(url)["live"], 120, "full coverage")
        by_window = {tuple(s["window"]): name for name, s in status.items()}
        victim, entry = by_window[(6, 12)], by_window[(0, 6)]
        spare = _node(url, "spare", tmp_path, "1GB", "--seed", "9", "--ctx", "512")
        ps.append(spare)
        sock = tmp_path / f"{entry}.sock"

        def answer(fault: Callable[[], None] | None) -> tuple[list[int], dict[str, Any]]:
            tokens: list[int] = []
            with ControlClient(sock, 300) as c:
                for msg in c.generate(prompt=PROMPT, max_tokens=64, temperature=0.0):
                    if msg["type"] == "token" and msg["token"] >= 0:
                        tokens.append(msg["token"])
                        if len(tokens) == 16 and fault is not None:
                            fault()
                    elif msg["type"] == "end":
                        return tokens, msg
            raise AssertionError("no end")

        want, _ = wait_for(lambda: _ok(answer, None), 60, "a fault-free answer")
        got, end = answer(lambda: nodes[victim].p.kill())
        assert end["reason"] == "max_tokens" and end.get("error") is None, end
        assert got == want
        st = _enrolled(spare)
        assert tuple(st["window"]) == (6, 12)
        with ControlClient(sock, 10) as c:
            assert c.status()["failover"]["replays"] >= 1


def _ok(answer: Callable[..., tuple[list[int], dict[str, Any]]], fault: Any) -> tuple[list[int], dict[str, Any]] | None:
    try:
        tokens, end = answer(fault)
    except Exception:
        return None
    return (tokens, end) if end.get("reason") == "max_tokens" else None
