"""Security N1: the market signs every reply, and a node acts on none its market key did not sign.

The coverage map decides which key and address a market node's successor link pins. It used to be unsigned: anyone
on the path to a plain-http market could rewrite it and aim a node's successor link at themselves. The same path
could answer ``/v1/operator`` for a node trusting the operator key on first use.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvasir.core.errors import MarketError
from kvasir.core.identity import Identity
from kvasir.market import replies
from kvasir.market.agent.client import MarketClient, is_transient
from kvasir.market.agent.config import market_trust_problem
from kvasir.market.server.service import serve_market
from kvasir.market.server.store import MarketStore
from tests.marketutil import Proc, coverage, procs, wait_for
from tests.ringutil import ring_generate, whole_model_tokens
from tests.test_market_ring import BUDGETS, PROMPT, _enrolled, _node, _seed_and_publish

ATTACKER = Identity.generate()


class Rewriter:
    """An on-path attacker between one node and a plain-http market: passes everything on, and while ``evil`` is
    set rewrites the coverage map so window 0 shows the attacker's key and address (headers, signature included,
    are passed on as they came)."""

    def __init__(self, market: str, attacker: str) -> None:
        self.market, self.attacker = market, attacker
        self.evil = False
        self.rewritten = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.relay(self)

            def do_POST(self) -> None:
                outer.relay(self)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.http = httpx.Client(timeout=10)

    def relay(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("content-length") or 0))
        skip = ("host", "content-length", "connection", "transfer-encoding")
        headers = {k: v for k, v in h.headers.items() if k.lower() not in skip}
        try:
            r = self.http.request(h.command, self.market + h.path, content=body, headers=headers)
        except (httpx.HTTPError, RuntimeError):  # the market, or this proxy, is closing at the test's end
            h.close_connection = True
            return
        raw = r.content
        if self.evil and h.path.startswith("/v1/coverage") and r.status_code == 200:
            doc = json.loads(raw)
            for model in doc["models"]:
                for w in model["windows"]:
                    if w["rank"] == 0:
                        w["holder_key"], w["endpoint"] = ATTACKER.public.to_text(), self.attacker
            raw = json.dumps(doc).encode()
            self.rewritten += 1
        h.send_response(r.status_code)
        for k, v in r.headers.items():
            if k.lower() not in (*skip, "content-encoding", "server", "date"):
                h.send_header(k, v)
        h.send_header("content-length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)

    def __enter__(self) -> Rewriter:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.http.close()


class Listener:
    """The attacker's link listener: counts who dials it (a dial is the node pinning the attacker's key)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.dialled = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.dialled += 1
            conn.close()


@pytest.fixture
def listener() -> Iterator[Listener]:
    ln = Listener()
    yield ln
    ln.sock.close()


@pytest.mark.slow
def test_a_rewritten_coverage_map_is_not_acted_on_and_the_ring_answers(
    tiny_model: Callable[..., Path], tmp_path: Path, listener: Listener
) -> None:
    """N1. The entry node ("big", window 4:6, rank 2; its successor is window 0) reaches the market through an
    on-path rewriter. Before: the rewritten map (window 0 = the attacker's key and address) was taken as it came,
    the node dropped its successor link and dialled the attacker (``listener.dialled`` > 0), and the request failed
    (``RingError: no link to the successor for 30 s (rank 0: peer closed during the handshake)``).
    Now: the market signs every reply with its delegated key, bound to the request's nonce; the node refuses the
    rewritten map (``not signed by market key``), keeps its link, and answers exactly the whole model's tokens."""
    model = tiny_model("llama", "q8_0")
    want = whole_model_tokens(model, PROMPT, 12)
    with procs() as ps:
        operator = ("--identity", str(tmp_path / "operator.pem"), "--create-identity")
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "market.sqlite"), *operator)
        ps.append(market)
        url = market.wait_line(r"listening on (http://\S+)").group(1)
        key = market.wait_line(r"operator (ed25519:\S+)").group(1)
        _seed_and_publish(ps, model, url, *operator)
        with Rewriter(url, listener.address) as mitm:
            nodes = {
                name: _node(mitm.url if name == "big" else url, name, tmp_path, budget, "--market-key", key)
                for name, budget in BUDGETS.items()
            }
            ps.extend(nodes.values())
            for p in nodes.values():
                _enrolled(p)
            assert wait_for(lambda: coverage(url)["live"], 120, "full coverage")
            assert ring_generate(tmp_path / "big.sock", PROMPT, 12)["tokens"] == want  # the honest ring

            mitm.evil = True
            wait_for(lambda: mitm.rewritten >= 5, 30, "five rewritten coverage maps read by the entry node")
            refused = [line for line in nodes["big"].err if "not signed by market key" in line]
            got = ring_generate(tmp_path / "big.sock", PROMPT, 12)
            assert listener.dialled == 0, f"the entry node dialled the attacker {listener.dialled} times"
            assert refused, nodes["big"].err[-10:]
            assert got["tokens"] == want
            print(f"rewritten maps {mitm.rewritten}, refused {len(refused)}, attacker dialled {listener.dialled}")


def test_a_node_off_loopback_pins_the_operator_and_refuses_plain_http(tmp_path: Path) -> None:
    """N1 (trust on first use): a node could enroll at any market without ``--market-key`` and over plain http, so
    the first answer to ``/v1/operator`` (an on-path attacker's too) chose the key everything else was checked
    with. Now that is allowed on loopback only: off loopback ``--market-key`` is required and http needs
    ``--allow-plain-http``, each refused in one line with exit code 2; the honest setups pass."""
    pin = Identity.generate().public
    base = ("node", "--memory-budget", "1GiB", "--stage-dir", str(tmp_path))
    for url, flags, says in (
        ("https://market.example.com", (), "--market-key is required"),
        ("http://10.0.0.2:8480", ("--market-key", pin.to_text()), "--allow-plain-http"),
    ):
        p = Proc(*base, "--market", url, *flags)
        assert p.wait(60) == 2
        assert len(p.err) == 1 and says in p.err[0], p.err
    assert market_trust_problem("https://market.example.com", pin) is None
    assert market_trust_problem("http://10.0.0.2:8480", pin, allow_plain_http=True) is None
    for inside in ("http://127.0.0.1:8480", "http://localhost:1", "http://[::1]:8480", "http://127.9.0.3:2"):
        assert market_trust_problem(inside, None) is None  # loopback: trust on first use, as before
    assert market_trust_problem("ftp://x.example.com", pin) is not None


async def test_every_reply_a_node_acts_on_is_checked(tmp_path: Path) -> None:
    """N1, reply by reply: the coverage map and a refusal (404) are signed by
    the market's key over the request's nonce (leases and grants: the end-to-end test, whose entry node claims
    through the rewriter). A reply altered on the way, one signed for another request (replay),
    or one checked against another key is ``bad_reply`` (transient: not acted on, asked again later)."""
    market_id = Identity.generate()
    node = Identity.generate()
    store = MarketStore(tmp_path / "m.sqlite")
    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            lambda task_status: serve_market(
                tmp_path, "127.0.0.1", 0, store=store, identity=market_id, task_status=task_status
            )
        )
        url = f"http://127.0.0.1:{port}"
        async with MarketClient(url, identity=node) as client:
            client.reply_key = market_id.public
            assert await client.coverage() == []  # signed and checked
            with pytest.raises(MarketError) as err:
                await client.model("00" * 32)
            assert err.value.status == 404  # a signed refusal is an answer
            client.reply_key = ATTACKER.public
            with pytest.raises(MarketError, match="not signed by market key") as err:
                await client.coverage()
            assert err.value.code == "bad_reply" and is_transient(err.value)

        async with httpx.AsyncClient(base_url=url) as raw:
            nonce = replies.new_nonce()
            r = await raw.get("/v1/coverage", headers={replies.H_REPLY_NONCE: nonce})
            args = ("GET", "/v1/coverage", 200)
            when, sig = r.headers["x-kvasir-market-time"], r.headers[replies.H_REPLY_SIG]
            replies.check_reply(market_id.public, *args, nonce, when, r.content, sig)
            for bad in (
                (nonce, when, r.content.replace(b"[]", b"[{}]"), sig),  # rewritten body
                (replies.new_nonce(), when, r.content, sig),  # replayed to another request
                (nonce, when, r.content, None),  # unsigned
            ):
                with pytest.raises(MarketError, match="market"):
                    replies.check_reply(market_id.public, *args, *bad)
        nursery.cancel_scope.cancel()
    store.close()
