"""Faults on a real local ring (bench/failover.py, tests/test_failover.py): a supervisor thread like ``kvasir ring
up``'s, streamed requests that inject a fault at a given token, and a soak that kills a random node every few
seconds under concurrent clients and checks every answer against its fault-free one."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from kvasir.control.client import ControlClient
from kvasir.core.errors import RingError
from kvasir.local.launcher import LocalRing, Supervisor


class Supervised:
    """``Supervisor.check`` in a thread, as ``kvasir ring up`` runs it; ``notes`` collects what it did."""

    def __init__(self, ring: LocalRing, *, probe_interval_s: float = 0.5, max_delay_s: float = 0.0) -> None:
        # No backoff by default: the faults here are injected on purpose, and each restart is measured.
        self.supervisor = Supervisor(ring, probe_interval_s=probe_interval_s, max_delay_s=max_delay_s)
        self.notes: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.notes.extend(self.supervisor.check())
            time.sleep(0.1)

    def __enter__(self) -> Supervised:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids (BOS, then seeded draws from the middle of a ~20k vocabulary)."""
    rng = random.Random(seed)
    return [2, *(rng.randrange(1000, 20000) for _ in range(n - 1))]


@attrs.frozen
class Answer:
    tokens: list[int]
    #: perf_counter time each token arrived, and when the request was sent.
    times: list[float]
    started: float
    end: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.end.get("reason") in ("max_tokens", "eog", "stop") and self.end.get("error") is None


def stream(
    sock: Path,
    *,
    max_tokens: int,
    fault: Callable[[], object] | None = None,
    at: int = 16,
    timeout: float = 600,
    **request: Any,
) -> Answer:
    """One request through ``sock``'s node (``prompt=`` text or ``tokens=`` ids); ``fault()`` runs once the
    ``at``-th token has arrived."""
    tokens: list[int] = []
    times: list[float] = []
    started = time.perf_counter()
    with ControlClient(sock, timeout=timeout) as c:
        for msg in c.generate(max_tokens=max_tokens, **request):
            if msg.get("type") == "token" and msg["token"] >= 0:
                tokens.append(msg["token"])
                times.append(time.perf_counter())
                if fault is not None and len(tokens) == at:
                    fault()
            elif msg.get("type") == "end":
                return Answer(tokens, times, started, msg)
    raise RingError("the stream ended without an end message")


#: A kill is noted just before the signal; the process may still take a request in the moment it takes to die.
KILL_GRACE_S = 1.0

#: What a node answers when every sequence is in use (admission refused: the request never started).
BUSY = "has no free sequence"


def soak(
    ring: LocalRing, *, seconds: float, every: float, clients: int, seed: int, max_tokens: int = 48
) -> dict[str, Any]:
    """``clients`` threads stream requests (half greedy, half T=0.8 with a seed), each entering at a random node,
    while one random node is SIGKILLed every ``every`` seconds for ``seconds``, under a supervisor.

    Counts: ``completed`` (``identical``/``different`` to the fault-free answer), ``lost_at_killed_entry`` (the
    stream broke and its entry node was killed meanwhile: lost by design), ``entry_down_retried`` (the chosen entry
    was being restarted), ``busy_retried`` (refused at admission, no free sequence: never started, the client
    retries as it would on a 503; requests orphaned by a killed entry hold sequences until the ring frees them),
    ``errors`` (anything else, messages in ``messages``), ``kills``, ``restarts``."""
    rng = random.Random(seed)
    size = len(ring.processes)
    jobs = []
    for k in range(clients):
        params: dict[str, Any] = {"temperature": 0.0} if k % 2 == 0 else {"temperature": 0.8, "seed": 100 + k}
        ids = prompt_ids(24 + 8 * k, 1000 + k)
        jobs.append((ids, params, stream(ring.sockets[0], tokens=ids, max_tokens=max_tokens, **params).tokens))
    counts = dict.fromkeys(
        (
            "completed",
            "identical",
            "different",
            "lost_at_killed_entry",
            "entry_down_retried",
            "busy_retried",
            "errors",
            "kills",
        ),
        0,
    )
    messages: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()
    kills: list[tuple[float, int]] = []

    def client(k: int) -> None:
        ids, params, want = jobs[k]
        crng = random.Random(seed * 100 + k)
        while not stop.is_set():
            entry = crng.randrange(size)
            t0 = time.monotonic()
            try:
                with ControlClient(ring.sockets[entry], timeout=5):
                    pass
            except (RingError, OSError):  # being restarted right now: choose again
                with lock:
                    counts["entry_down_retried"] += 1
                time.sleep(0.5)
                continue
            try:
                res = stream(ring.sockets[entry], tokens=ids, max_tokens=max_tokens, **params)
            except (RingError, OSError, ValueError) as exc:
                with lock:
                    if BUSY in str(exc):
                        counts["busy_retried"] += 1
                    elif any(r == entry and at >= t0 - KILL_GRACE_S for at, r in kills):
                        counts["lost_at_killed_entry"] += 1
                    else:
                        counts["errors"] += 1
                        messages.append(f"entry {entry}: {exc!r}")
                time.sleep(0.5)
                continue
            with lock:
                if not res.ok and BUSY in str(res.end.get("error")):
                    counts["busy_retried"] += 1
                elif not res.ok:
                    counts["errors"] += 1
                    messages.append(f"entry {entry}: {res.end.get('code')}: {res.end.get('error')}")
                else:
                    counts["completed"] += 1
                    counts["identical" if res.tokens == want else "different"] += 1

    with Supervised(ring) as sup:
        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(every)
            victim = rng.randrange(size)
            with lock:
                kills.append((time.monotonic(), victim))
            ring.processes[victim].kill()
            counts["kills"] += 1
        stop.set()
        for t in threads:
            t.join(timeout=300)
        restarts = sum("exited" in n for n in sup.notes)
        notes = list(sup.notes)
    return {**counts, "restarts": restarts, "messages": messages, "notes": notes}
