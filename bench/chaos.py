"""Chaos under load on ``kvasir ring up``: random SIGKILL/SIGSTOP of any node for minutes, then calm.

A 3-stage ``kvasir ring up --standby --api-port P`` (the chat model SmolLM2 by default) runs in its own session.
First each job (``--prompts`` chat prompts, each greedy and at T = 0.8 with a fixed seed) is answered alone through
the API front: its fault-free reference. Then ``--clients`` threads stream chat completions through the front back
to back (``--max-tokens`` each, client k starting at job k), while every ``--interval`` seconds for ``--minutes``
one random live node process (a primary or a standby, rank 0 included, dormant or not) gets SIGKILL or SIGSTOP. A
stopped node is left to the supervisor, which detects and kills it. ``--calm`` minutes without faults follow.

Each request is recorded: start time, phase (chaos or calm, by its start), outcome, time to first token and stall
(the largest gap between two content chunks). Outcomes:

- ``identical`` / ``different``: the stream ended with ``[DONE]``; its text and finish reason against the reference;
- ``failed``: the stream started (200) and ended with an error event (its code, e.g. ``entry_lost``: the entry node
  died mid-answer) or the client's read timed out;
- ``refused``: the front answered an error status (its code) or refused the connection: the request never started;
- ``cut``: the connection broke mid-stream with no error event.

Printed: per phase the counts, TTFT and stall percentiles (over completed requests), the ring's availability (the
fraction of 1-s slots in which a chunk of a completed request arrived; the calm phase is the baseline) and its
longest outage; the faults injected, by signal and victim, with the longest outage in the ``--interval`` after each;
the error codes; what the supervisor did. Every number comes from the run.

    python bench/chaos.py [--minutes 10] [--calm 2] [--interval 10] [--clients 8] [--seed 1] [--model PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
from rich.console import Console
from rich.table import Table

from kvasir.demo import chat_model_path
from kvasir.local.launcher import free_ports

PROMPTS = (
    "Name three rivers in Europe and say where each one starts.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about a ring of small computers.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
    "Why do cats purr? Answer briefly.",
    "Describe the water cycle for a ten-year-old.",
    "List four planets and one fact about each.",
)
#: The seed of every T = 0.8 job (fixed: its answer is reproducible, so it has a reference).
SAMPLE_SEED = 1234
OUTCOMES = ("identical", "different", "failed", "refused", "cut")


@attrs.frozen
class Job:
    prompt: str
    temperature: float

    def body(self, max_tokens: int) -> dict[str, Any]:
        params = {"temperature": 0.0} if self.temperature == 0 else {"temperature": 0.8, "seed": SAMPLE_SEED}
        messages = [{"role": "user", "content": self.prompt}]
        return {"messages": messages, "max_tokens": max_tokens, "stream": True, **params}


@attrs.frozen
class Answer:
    """What one streamed request got: its text and finish reason (when it ended with ``[DONE]``), or why not."""

    #: ``done``, ``error`` (an error event or a client timeout), ``refused`` (error status, no connection), ``cut``.
    end: str
    text: str = ""
    finish: str | None = None
    code: str | None = None
    #: Seconds from sending to each content chunk.
    chunks: tuple[float, ...] = ()


@attrs.frozen
class Record:
    job: int
    #: Seconds since the chaos began.
    start: float
    phase: str
    outcome: str
    code: str | None
    #: Seconds since the chaos began, of each content chunk.
    chunk_times: tuple[float, ...]

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def stall(self) -> float:
        """The largest gap between two content chunks (0 with fewer than two)."""
        return max((b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)), default=0.0)


def classify(answer: Answer, reference: Answer) -> tuple[str, str | None]:
    """An answer's outcome against its fault-free reference, and its error code if it has one."""
    if answer.end == "done":
        same = (answer.text, answer.finish) == (reference.text, reference.finish)
        return ("identical" if same else "different"), None
    if answer.end == "error":
        return "failed", answer.code
    if answer.end == "refused":
        return "refused", answer.code
    return "cut", answer.code


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def served_slots(records: Iterable[Record], begin: float, end: float) -> list[bool]:
    """For each whole second in [begin, end): whether a content chunk of a completed request arrived in it."""
    n = max(0, int(end - begin))
    served = [False] * n
    for r in records:
        if r.outcome not in ("identical", "different"):
            continue
        for t in r.chunk_times:
            slot = int(t - begin) if t >= begin else -1
            if 0 <= slot < n:
                served[slot] = True
    return served


def longest_gap(served: Sequence[bool]) -> int:
    """The longest run of unserved slots (seconds)."""
    best = run = 0
    for ok in served:
        run = 0 if ok else run + 1
        best = max(best, run)
    return best


def outage_after(records: Sequence[Record], at: float, window: float) -> float:
    """The longest run of unserved 1-s slots in the ``window`` seconds from ``at`` (a fault)."""
    return float(longest_gap(served_slots(records, at, at + window)))


def node_label(cmdline: Sequence[str]) -> str | None:
    """``rank N`` or ``rank N standby`` for a ``kvasir node`` command line of ``ring up``; None for anything else."""
    if "node" not in cmdline or "--rank" not in cmdline:
        return None
    rank = cmdline[cmdline.index("--rank") + 1]
    return f"rank {rank}" + (" standby" if "--standby" in cmdline else "")


def sse_answer(lines: Iterable[str], sent: float, chunks: list[float], clock: Any = time.monotonic) -> Answer:
    """Read a chat completion's SSE lines into an :class:`Answer` (``cut`` if they stop before ``[DONE]``); each
    content chunk's time since ``sent`` goes into ``chunks`` as it arrives (kept if the connection breaks)."""
    text: list[str] = []
    finish: str | None = None
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            return Answer("done", "".join(text), finish, None, tuple(chunks))
        event = json.loads(payload)
        if "error" in event:
            return Answer("error", "".join(text), finish, str(event["error"].get("code")), tuple(chunks))
        for choice in event.get("choices", []):
            content = choice.get("delta", {}).get("content")
            if content:
                text.append(content)
                chunks.append(clock() - sent)
            finish = choice.get("finish_reason") or finish
    return Answer("cut", "".join(text), finish, "no [DONE]", tuple(chunks))


def ask(client: httpx.Client, url: str, job: Job, max_tokens: int) -> Answer:
    """One streamed chat completion through the front."""
    sent = time.monotonic()
    chunks: list[float] = []
    try:
        with client.stream("POST", url + "/chat/completions", json=job.body(max_tokens)) as r:
            if r.status_code != 200:
                r.read()
                try:
                    code = str(r.json()["error"].get("code") or r.status_code)
                except (ValueError, KeyError, TypeError):
                    code = str(r.status_code)
                return Answer("refused", code=f"{r.status_code} {code}")
            lines = r.iter_lines()
            answer = sse_answer(lines, sent, chunks)
            with contextlib.suppress(httpx.HTTPError):
                for _ in lines:  # to the end of the response, as a client that reuses its connection does
                    pass
            return answer
    except httpx.ConnectError as exc:
        return Answer("refused", code=f"connect: {type(exc).__name__}")
    except httpx.TimeoutException as exc:
        return Answer("error", code=f"client {type(exc).__name__}", chunks=tuple(chunks))
    except httpx.HTTPError as exc:
        return Answer("cut", code=type(exc).__name__, chunks=tuple(chunks))


# ------------------------------------------------------------------------------------------------ the ring


@attrs.define
class RingUp:
    """``kvasir ring up`` in its own session and runtime directory; its node processes found through /proc."""

    proc: subprocess.Popen[bytes]
    workdir: Path
    url: str = ""
    seen: set[int] = attrs.field(factory=set)

    @classmethod
    def start(cls, model: Path, workdir: Path, port: int, args: argparse.Namespace) -> RingUp:
        runtime, tmp = workdir / "xdg", workdir / "tmp"
        runtime.mkdir(mode=0o700)
        tmp.mkdir()
        env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), TMPDIR=str(tmp))
        cmd = [sys.executable, "-m", "kvasir", "ring", "up", str(model), "--stages=3", "--standby"]
        cmd += [f"--api-port={port}", "--threads=1", f"--ctx={args.ctx}", f"--seqs={args.seqs}"]
        cmd += [f"--max-restart-delay={args.max_restart_delay}"]
        with (workdir / "ring-up.out").open("wb") as out, (workdir / "ring-up.err").open("wb") as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=workdir, start_new_session=True)
        up = cls(proc, workdir)
        deadline = time.monotonic() + 300
        while "stops the ring" not in up.stdout():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"ring up did not start:\n{up.stdout()}\n{up.stderr()}")
            time.sleep(0.2)
        match = re.search(r"OpenAI API: (http://\S+/v1)", up.stdout())
        if match is None:
            raise SystemExit(f"no API in ring up's banner:\n{up.stdout()}")
        up.url = match.group(1)
        return up

    def stdout(self) -> str:
        return (self.workdir / "ring-up.out").read_text(errors="replace")

    def stderr(self) -> str:
        return (self.workdir / "ring-up.err").read_text(errors="replace")

    def nodes(self) -> dict[int, tuple[str, str]]:
        """Every child of ``ring up`` that is a node: pid -> (label, state letter from /proc: R, S, T, Z...)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[1]) != self.proc.pid:
                    continue
                label = node_label((entry / "cmdline").read_bytes().decode(errors="replace").split("\0"))
            except (OSError, ValueError):
                continue  # gone meanwhile
            if label is not None:
                found[int(entry.name)] = (label, fields[0])
        self.seen |= set(found)
        return found

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for pid in self.seen:  # a node left stopped or orphaned: only ours, by pid
            with contextlib.suppress(OSError):
                if node_label(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")):
                    os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------------------ the run


def client_address(k: int) -> str:
    """Client ``k``'s loopback source address, each in its own /24."""
    return f"127.0.{10 + k}.1"


@attrs.define
class Run:
    url: str
    jobs: list[Job]
    references: list[Answer]
    max_tokens: int
    #: monotonic time the chaos began, and when the calm begins.
    t0: float
    calm_at: float
    records: list[Record] = attrs.field(factory=list)
    lock: threading.Lock = attrs.field(factory=threading.Lock)
    stop: threading.Event = attrs.field(factory=threading.Event)

    def client(self, k: int) -> None:
        n = k
        # Each client from its own address (its own /24): the front caps concurrent requests per address group.
        transport = httpx.HTTPTransport(local_address=client_address(k))
        with httpx.Client(transport=transport, timeout=httpx.Timeout(120.0, connect=10.0)) as http:
            while not self.stop.is_set():
                j = n % len(self.jobs)
                n += 1
                start = time.monotonic()
                answer = ask(http, self.url, self.jobs[j], self.max_tokens)
                outcome, code = classify(answer, self.references[j])
                rel = start - self.t0
                record = Record(
                    j,
                    rel,
                    "chaos" if start < self.calm_at else "calm",
                    outcome,
                    code,
                    tuple(rel + c for c in answer.chunks),
                )
                with self.lock:
                    self.records.append(record)
                if outcome not in ("identical", "different"):
                    time.sleep(0.5)  # as a client that got an error would wait before trying again


@attrs.frozen
class Fault:
    at: float
    label: str
    pid: int
    signal: str


@attrs.frozen
class Planned:
    """One fault of a ``--schedule``: at ``at`` s after the chaos began, ``signal`` to the live node ``label``."""

    at: float
    signal: str
    label: str


def parse_schedule(text: str) -> list[Planned]:
    """``--schedule``'s faults, in time order: comma-separated ``SECONDS:KILL|STOP:LABEL`` items, LABEL as
    :func:`node_label` writes it (``rank 1``, ``rank 0 standby``). ValueError names a bad item."""
    planned = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":", 2)
        if len(fields) != 3 or fields[1] not in ("KILL", "STOP") or not re.fullmatch(r"rank \d+( standby)?", fields[2]):
            raise ValueError(f"schedule item {item!r} is not SECONDS:KILL|STOP:rank N[ standby]")
        try:
            at = float(fields[0])
        except ValueError:
            raise ValueError(f"schedule item {item!r}: {fields[0]!r} is not a number of seconds") from None
        planned.append(Planned(at, "SIG" + fields[1], fields[2]))
    if not planned:
        raise ValueError("the schedule has no faults")
    return sorted(planned, key=lambda p: p.at)


def chaos(
    up: RingUp, run: Run, interval: float, rng: random.Random, schedule: Sequence[Planned] | None = None
) -> list[Fault]:
    """A fault every ``interval`` s from the start until the calm: a random live node SIGKILLed or SIGSTOPped; with a
    ``schedule``, its faults instead (one whose node is not live then is skipped, and said so)."""
    faults = []
    k = 0
    while (due := run.t0 + (schedule[k].at if schedule is not None else k * interval)) < run.calm_at:
        time.sleep(max(0.0, due - time.monotonic()))
        live = sorted((pid, label) for pid, (label, state) in up.nodes().items() if state not in "TtZX")
        if schedule is not None:
            plan = schedule[k]
            k += 1
            chosen = [(pid, label) for pid, label in live if label == plan.label]
            if not chosen:
                print(f"{time.monotonic() - run.t0:6.1f} s  {plan.label} is not live: skipped", flush=True)
                if k == len(schedule):
                    break
                continue
            pid, label = chosen[0]
            sig = signal.Signals[plan.signal]
        else:
            k += 1
            if not live:
                continue
            pid, label = rng.choice(live)
            sig = rng.choice((signal.SIGKILL, signal.SIGSTOP))
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            faults.append(Fault(time.monotonic() - run.t0, label, pid, sig.name))
        print(f"{time.monotonic() - run.t0:6.1f} s  {sig.name} {label} (pid {pid})", flush=True)
        if schedule is not None and k == len(schedule):
            break
    time.sleep(max(0.0, run.calm_at - time.monotonic()))
    return faults


def sample_load(run: Run, end: float, into: list[tuple[float, float]]) -> None:
    while (now := time.monotonic()) < end:
        into.append((now - run.t0, os.getloadavg()[0]))
        time.sleep(5.0)


def load_range(samples: Sequence[tuple[float, float]], begin: float, end: float) -> str:
    mine = [x for t, x in samples if begin <= t < end]
    return f"{min(mine):.1f}–{max(mine):.1f}" if mine else "–"


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def phase_table(records: list[Record], phases: list[tuple[str, float, float]], title: str) -> Table:
    t = Table("phase", "s", "sent", *OUTCOMES, "TTFT p50/p99/max s", "stall p50/p90/p99/max s", title=title)
    t.add_column("served 1-s slots")
    t.add_column("longest outage s")
    for name, begin, end in phases:
        mine = [r for r in records if r.phase == name]
        counts = Counter(r.outcome for r in mine)
        done = [r for r in mine if r.outcome in ("identical", "different")]
        ttfts = [r.ttft for r in done if r.ttft is not None]
        stalls = [r.stall for r in done]
        served = served_slots(records, begin, end)
        t.add_row(
            name,
            f"{end - begin:.0f}",
            str(len(mine)),
            *(str(counts[o]) for o in OUTCOMES),
            "/".join(fmt(percentile(ttfts, q)) for q in (50, 99, 100)),
            "/".join(fmt(percentile(stalls, q)) for q in (50, 90, 99, 100)),
            f"{sum(served)}/{len(served)} ({100 * sum(served) / max(1, len(served)):.1f}%)",
            str(longest_gap(served)),
        )
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="default: SmolLM2-135M-Instruct (kvasir[chat])")
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of chaos")
    ap.add_argument("--calm", type=float, default=2.0, help="minutes without faults after the chaos")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between faults")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1, help="chooses the victims and the signals")
    ap.add_argument(
        "--schedule",
        default=None,
        help="these faults instead of random ones: 'SECONDS:KILL|STOP:LABEL,...', LABEL 'rank N' or 'rank N standby'",
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"1..{len(PROMPTS)}")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--seqs", type=int, default=None, help="sequences per node (default: 2 x clients)")
    ap.add_argument("--max-restart-delay", type=float, default=30.0, help="ring up's (its default: 30)")
    ap.add_argument("--save", type=Path, default=None, help="write every request and fault here (JSON)")
    ap.add_argument("--keep", action="store_true", help="keep the run's directory (ring up's output, node logs)")
    args = ap.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS) or not 1 <= args.clients <= 200 or args.interval <= 0:
        ap.error("--prompts 1..8, --clients 1..200, --interval > 0")
    try:
        schedule = None if args.schedule is None else parse_schedule(args.schedule)
    except ValueError as exc:
        ap.error(str(exc))
    args.seqs = args.seqs or 2 * args.clients
    model = args.model or chat_model_path()
    console = Console(width=max(160, shutil.get_terminal_size().columns))
    workdir = Path(tempfile.mkdtemp(prefix="kvasir-chaos-"))
    (port,) = free_ports(1)
    up = RingUp.start(model, workdir, port, args)
    try:
        jobs = [Job(p, temp) for p in PROMPTS[: args.prompts] for temp in (0.0, 0.8)]
        with httpx.Client(timeout=120) as http:
            references = [ask(http, up.url, job, args.max_tokens) for job in jobs]
        bad = [i for i, a in enumerate(references) if a.end != "done"]
        if bad:
            raise SystemExit(f"fault-free references failed: {[references[i] for i in bad]}")
        print(f"{len(jobs)} fault-free references; load average {os.getloadavg()[0]:.1f}", flush=True)
        t0 = time.monotonic()
        run = Run(up.url, jobs, references, args.max_tokens, t0, t0 + 60 * args.minutes)
        end = run.calm_at + 60 * args.calm
        load: list[tuple[float, float]] = []  # (seconds since the chaos began, 1-min load average)
        threads = [threading.Thread(target=run.client, args=(k,), daemon=True) for k in range(args.clients)]
        threads.append(threading.Thread(target=sample_load, args=(run, end, load), daemon=True))
        for th in threads:
            th.start()
        faults = chaos(up, run, args.interval, random.Random(args.seed), schedule)
        time.sleep(max(0.0, end - time.monotonic()))
        run.stop.set()
        for th in threads:
            th.join(timeout=180)
        alive = sum(th.is_alive() for th in threads)
        notes = up.stderr()
        ring_alive = up.proc.poll() is None
    finally:
        up.stop()
    records = sorted(run.records, key=lambda r: r.start)
    chaos_s, calm_s = run.calm_at - t0, end - run.calm_at
    console.print(
        phase_table(
            records,
            [("chaos", 0.0, chaos_s), ("calm", chaos_s, chaos_s + calm_s)],
            f"{model.name}, 3 stages + standbys, {args.clients} streaming clients, {args.max_tokens} tokens, "
            f"a fault every {args.interval:.0f} s",
        )
    )
    by_kind = Counter((f.signal, f.label) for f in faults)
    labels = sorted({f.label for f in faults})
    ft = Table("signal", *labels, "total", "outage after it p50/max s", title="faults injected")
    for sig in ("SIGKILL", "SIGSTOP"):
        outages = [outage_after(records, f.at, args.interval) for f in faults if f.signal == sig]
        ft.add_row(
            sig,
            *(str(by_kind[(sig, lb)]) for lb in labels),
            str(len(outages)),
            "/".join(fmt(percentile(outages, q), 0) for q in (50, 100)),
        )
    console.print(ft)
    codes = Counter((r.phase, r.outcome, r.code) for r in records if r.outcome not in ("identical", "different"))
    ct = Table("phase", "outcome", "code", "count", title="errors")
    for (phase, outcome, code), n in sorted(codes.items(), key=lambda kv: (kv[0][0], -kv[1])):
        ct.add_row(phase, outcome, str(code), str(n))
    console.print(ct)
    for r in records:
        if r.outcome == "different" or (r.phase == "calm" and r.outcome != "identical"):
            ref = references[r.job]
            console.print(
                f"[red]{r.phase} {r.start:.1f} s job {r.job}: {r.outcome} {r.code}[/] (reference {ref.text!r})"
            )
    different = sum(r.outcome == "different" for r in records)
    calm = [r for r in records if r.phase == "calm"]
    calm_ok = sum(r.outcome == "identical" for r in calm)
    console.print(
        f"answers different from the fault-free ones: {different}; requests sent after the chaos answered "
        f"identically: {calm_ok}/{len(calm)}; longest outage during the chaos: "
        f"{longest_gap(served_slots(records, 0.0, chaos_s))} s"
    )
    exits = len(re.findall(r"exited with code", notes))
    hung = len(re.findall(r"stopped answering|was stopped for", notes))
    console.print(
        f"supervisor: {exits} exits seen, {hung} stopped nodes detected and killed; ring up "
        f"{'still running at the end' if ring_alive else 'HAD EXITED'}; clients still hanging at the end: {alive}; "
        f"load average (1 min) chaos {load_range(load, 0, chaos_s)}, calm {load_range(load, chaos_s, 1e9)}; "
        f"{os.cpu_count()} cores"
    )
    if args.save is not None:
        saved = {"requests": [attrs.asdict(r) for r in records], "faults": [attrs.asdict(f) for f in faults]}
        args.save.write_text(json.dumps({**saved, "supervisor": notes.splitlines()}, indent=1))
    if args.keep:
        console.print(f"run directory kept: {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
