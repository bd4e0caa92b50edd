"""Start a whole ring on this machine: one ``kvasir node`` process per rank (``kvasir ring up``, tests, benches)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

import attrs

from kvasir.control.client import ControlClient
from kvasir.control.paths import node_socket_path
from kvasir.core.config import without_config
from kvasir.core.errors import RingError
from kvasir.core.identity import PublicKey, create_identity
from kvasir.local.front import Entry
from kvasir.relay.ringlink import grant_relay_edges
from kvasir.ring.manifest import Manifest, RankEntry, StandbyEntry
from kvasir.ring.status import SupervisedProcess, SupervisorStatus
from kvasir.shard.cache import model_sha256, stage_files
from kvasir.util.files import atomic_output

log = logging.getLogger("kvasir.ring")

#: The internal API key's file in a run directory (``start_ring(entries=True)``).
ENTRY_KEY_FILE = "entry-api.key"
#: The supervisor's view of the processes, in a run directory (``start_ring(supervised=True)``).
SUPERVISOR_FILE = "supervisor.json"

#: How long ``ring up --relay``'s edge grants last; the nodes' own tokens still live ten minutes at most.
GRANT_LIFETIME_S = 30 * 24 * 3600


def free_ports(n: int, host: str = "127.0.0.1", exclude: Collection[int] = ()) -> list[int]:
    """``n`` distinct ports free on ``host`` now, none of them in ``exclude`` (ports the ring listens on itself: the
    kernel may hand out an ``--api-port`` that lies in its ephemeral range)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            socks.append(s)  # every one stays bound until the end, so the kernel never hands a port out twice
            s.bind((host, 0))
            if (port := s.getsockname()[1]) not in exclude:
                ports.append(port)
        return ports
    finally:
        for s in socks:
            s.close()


@attrs.define
class LocalRing:
    manifest: Manifest
    run_dir: Path
    processes: list[subprocess.Popen[bytes]]
    sockets: list[Path]
    api_port: int | None
    relay: subprocess.Popen[bytes] | None = None
    relay_url: str | None = None
    #: Each rank's command line and environment, so a rank can be restarted as it was started.
    commands: list[tuple[list[str], dict[str, str]]] = attrs.field(factory=list)
    #: The processes die with the one that started them (see :func:`spawn`).
    tied: bool = False
    #: The relay's command line and environment, to restart it on the same port.
    relay_command: tuple[list[str], dict[str, str]] | None = None
    #: With standbys (``start_ring(standby=True)``): the index in ``processes``/``sockets``/``commands`` of the
    #: first standby; standby ``i`` (from there) holds rank ``i``'s window. They start once the primaries are ready.
    standby_start: int | None = None
    #: With ``start_ring(entries=True)``: every process's own API port on loopback (``processes`` indices,
    #: standbys included), each behind :attr:`entry_key`; ``ring up``'s front (kvasir.local.front) forwards to them.
    entry_ports: list[int] = attrs.field(factory=list)
    entry_key: str | None = None
    #: With ``start_ring(supervised=True)``: where the :class:`Supervisor` writes its view of the processes, which
    #: every node reads into its status (``--supervisor-state``).
    supervisor_file: Path | None = None

    def label(self, i: int) -> str:
        """What process ``i`` is: ``rank K`` or ``rank K's standby``."""
        if self.standby_start is None or i < self.standby_start:
            return f"rank {i}"
        return f"rank {i - self.standby_start}'s standby"

    def entries(self) -> tuple[Entry, ...]:
        """Every process as an entry of the API front (standbys too: the front routes to whichever is linked)."""
        return tuple(Entry(i, self.label(i), port, self.sockets[i]) for i, port in enumerate(self.entry_ports))

    def log_path(self, i: int) -> Path:
        if self.standby_start is None or i < self.standby_start:
            return self.run_dir / f"rank{i}.log"
        return self.run_dir / f"rank{i - self.standby_start}-standby.log"

    def restart(self, rank: int) -> None:
        """Start process ``rank`` (a rank or a standby) again after it died or was stopped, logging to the same file."""
        cmd, env = self.commands[rank]
        self.processes[rank] = spawn(cmd, env, self.log_path(rank), append=True, tied=self.tied)

    def restart_relay(self) -> None:
        assert self.relay_command is not None
        cmd, env = self.relay_command
        self.relay = spawn(cmd, env, self.run_dir / "relay.log", append=True, tied=self.tied)

    def answers(self, rank: int, timeout: float = 2.0) -> bool:
        """Whether rank ``rank``'s node answers a status request on its control socket within ``timeout``."""
        if rank >= len(self.sockets):
            return False
        try:
            with ControlClient(self.sockets[rank], timeout=timeout) as c:
                c.status()
            return True
        except (RingError, OSError):
            return False

    def log_tail(self, rank: int, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path(rank).read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Wait until a node of every rank has both links (the rank's primary or, after a failover, its standby); then
        start the standbys not started yet (one started with the primaries could be dialed while its primary is still
        loading, and hold the window from the start) and wait until every node answers (a standby stays dormant)."""
        deadline = time.monotonic() + timeout
        ranks = len(self.processes) if self.standby_start is None else self.standby_start
        self._wait_for({k: self.holders(k) for k in range(ranks)}, deadline, timeout, linked=True)
        for i in range(len(self.processes), len(self.commands)):
            cmd, env = self.commands[i]
            self.processes.append(spawn(cmd, env, self.log_path(i), tied=self.tied))
        self._wait_for({i: [i] for i in range(len(self.processes))}, deadline, timeout, linked=False)

    def holders(self, rank: int) -> list[int]:
        """The processes (indices) that hold ``rank``'s window: its primary, and its standby once started."""
        standby = None if self.standby_start is None else self.standby_start + rank
        return [rank] if standby is None or standby >= len(self.processes) else [rank, standby]

    def _wait_for(self, pending: dict[int, list[int]], deadline: float, timeout: float, *, linked: bool) -> None:
        """Until, for each key of ``pending``, one of its processes answers (and, ``linked``, has both links)."""
        while pending:
            for key, members in sorted(pending.items()):
                for k in members:
                    code = self.processes[k].poll()
                    if code is not None:
                        raise RingError(f"{self.label(k)} exited with code {code}:\n{self.log_tail(k)}")
                    if not self.sockets[k].exists():
                        continue
                    try:
                        with ControlClient(self.sockets[k], timeout=5) as c:
                            if c.status()["ready"] or not linked:
                                pending.pop(key, None)
                    except (RingError, OSError):
                        pass
            if time.monotonic() > deadline:
                waiting = ", ".join(self.label(k) for k in sorted(pending))
                raise RingError(f"ring not ready after {timeout:.0f} s (waiting for {waiting})")
            if pending:
                time.sleep(0.1)

    def dead(self) -> list[tuple[int, int]]:
        """``(rank, exit code)`` of every node process that has exited (a negative code: killed by that signal)."""
        return [(k, code) for k, p in enumerate(self.processes) if (code := p.poll()) is not None]

    def stop(self, timeout: float = 10.0) -> None:
        procs = [*self.processes, *([self.relay] if self.relay else [])]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sock in self.sockets:  # a node killed (and not restarted) leaves its control socket behind
            sock.unlink(missing_ok=True)


def remove_run_dir(run_dir: Path, *, keep_logs: bool = False) -> None:
    """Remove a ring's run directory once its processes are gone: the nodes' private keys, the manifest, the logs.
    With ``keep_logs`` the logs and the manifest (public keys only) stay, to read why it failed; the secrets go
    anyway."""
    if not keep_logs:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for path in run_dir.iterdir():
        if path.suffix == ".log" or path.name == "ring.toml":
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


#: Key of the relay in the :class:`Supervisor`'s per-process state (the nodes' keys are their ``processes`` indices).
RELAY = -1


def restart_delay(streak: int, first_s: float, max_s: float) -> float:
    """How long to wait before restarting a process that died ``streak`` times in a row (this death included), each
    time before it had run stably: the first death at once (a failover is waiting for the window), then ``first_s``,
    doubling, up to ``max_s``. A flapping window costs a few restarts a minute, never the rest of the ring."""
    if streak <= 1:
        return 0.0
    return float(min(first_s * 2.0 ** (streak - 2), max_s))


@attrs.define
class _Watched:
    """The supervisor's view of one process (a node or the relay)."""

    #: When it was last (re)started, by the supervisor's clock (or first seen running).
    started_at: float
    #: Deaths in a row, each before it had run ``stable_s``.
    streak: int = 0
    #: When it last died (for the line saying how long it was away once it answers again).
    down_since: float | None = None
    #: When the next restart is due (None: no restart pending).
    retry_at: float | None = None
    #: Restarted since it last answered: its first answer is a state change worth a line.
    restarted: bool = False


@attrs.define
class Supervisor:
    """Restarts the ring's nodes (and its relay) when they die, and kills a node that stopped answering (hung: a
    deadlock) or is stopped (SIGSTOP, loading or not) so that it is restarted too. A process that keeps dying is
    restarted with a growing delay (:func:`restart_delay`), never given up on: the other windows keep serving, and
    the ring is whole again as soon as the cause goes away (memory freed, a disk back, a flapping device steady).

    A restarted node takes its window back and its predecessor replays the requests in flight into it
    (docs/architecture.md § Failover). ``check`` is called periodically by the owner of the ring (``kvasir ring
    up``); it returns one line per change of state (died and restarted, down until a given time, restarted, answers
    again, hung and killed). ``probe(rank)`` says whether a node answers (default: its control socket).
    """

    ring: LocalRing
    #: Restart delays after the second death in a row: ``first_delay_s``, doubling, up to ``max_delay_s``.
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0
    #: A process that ran this long before it died starts a new streak (it is restarted at once).
    stable_s: float = 60.0
    #: A node that answered once and then misses this many probes in a row, for at least ``hang_s`` since its last
    #: answer, is killed (and then restarted). Both, so that a node slowed by a loaded machine is not taken for hung.
    hang_strikes: int = 3
    hang_s: float = 6.0
    probe_interval_s: float = 1.0
    probe: Callable[[int], bool] | None = None
    #: Whether a process (by pid) is stopped (SIGSTOP, a debugger): such a node is killed after ``hang_s`` stopped
    #: even if it never answered (stopped while loading, it has no control socket to miss probes on).
    stopped: Callable[[int], bool] = attrs.field(factory=lambda: process_stopped)
    #: The wall clock, only to print when a restart is due.
    wall: Callable[[], float] = time.time
    watched: dict[int, _Watched] = attrs.field(factory=dict)
    strikes: dict[int, int] = attrs.field(factory=dict)
    #: Ranks that answered since their last (re)start: only those can be hung (one still loading is not).
    answered: set[int] = attrs.field(factory=set)
    #: Since when (supervisor's clock) each rank's process has been seen stopped.
    stopped_since: dict[int, float] = attrs.field(factory=dict)
    last_answer: dict[int, float] = attrs.field(factory=dict)
    last_probe: float = -1e9
    #: Deaths seen (a hung node killed here included): ``ring up`` keeps the logs of a run that had any.
    deaths: int = 0
    #: The last view written to the ring's supervisor file (rewritten when it changes).
    written: tuple[SupervisedProcess, ...] | None = None
    #: Each process's last exit code (the view shows it).
    exit_codes: dict[int, int] = attrs.field(factory=dict)

    def down(self) -> list[int]:
        """The processes (keys: ``processes`` indices, :data:`RELAY`) that are down, waiting for their restart."""
        return sorted(k for k, w in self.watched.items() if w.retry_at is not None)

    def _label(self, key: int) -> str:
        return "the relay" if key == RELAY else self.ring.label(key)

    def _pid(self, key: int) -> int:
        proc = self.ring.relay if key == RELAY else self.ring.processes[key]
        assert proc is not None
        return proc.pid

    def _restart(self, key: int) -> None:
        if key == RELAY:
            self.ring.restart_relay()
        else:
            self.ring.restart(key)
            self.answered.discard(key)
            self.strikes.pop(key, None)
            self.stopped_since.pop(key, None)

    def check(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        exited = [(RELAY, code)] if self.ring.relay is not None and (code := self.ring.relay.poll()) is not None else []
        exited += self.ring.dead()
        for key in [RELAY, *range(len(self.ring.processes))]:
            if key != RELAY or self.ring.relay is not None:
                self.watched.setdefault(key, _Watched(started_at=now))
        notes = []
        for key, code in exited:
            w = self.watched[key]
            if w.retry_at is None:  # newly dead (one already down is waiting for its retry time)
                notes.append(self._died(key, w, code, now))
            elif now >= w.retry_at:
                notes.append(self._retry(key, w, now))
        if now - self.last_probe >= self.probe_interval_s:
            self.last_probe = now
            notes += self._probe_all(now)
        self._write_view(now)
        return notes

    def view(self, now: float) -> tuple[SupervisedProcess, ...]:
        """Every process as ``kvasir status`` shows it: up, starting (not answering yet) or down until its retry."""
        out = []
        wall = self.wall() - now  # the supervisor's clock to Unix time
        for key in sorted(self.watched, key=lambda k: (k == RELAY, k)):
            w = self.watched[key]
            if w.retry_at is not None:
                state = "down"
            elif key == RELAY or key in self.answered:
                state = "up"
            else:
                state = "starting"
            out.append(
                SupervisedProcess(
                    self._label(key),
                    state,
                    pid=None if state == "down" else self._pid(key),
                    streak=w.streak,
                    exit_code=self.exit_codes.get(key),
                    down_since=None if w.down_since is None or state == "up" else round(w.down_since + wall, 1),
                    retry_at=None if w.retry_at is None else round(w.retry_at + wall, 1),
                )
            )
        return tuple(out)

    def _write_view(self, now: float) -> None:
        """Rewrite the ring's supervisor file when the view changed (the nodes read it into their status)."""
        path = self.ring.supervisor_file
        if path is None:
            return
        view = self.view(now)
        if view == self.written:
            return
        try:
            with atomic_output(path) as tmp:
                tmp.write_text(json.dumps(SupervisorStatus(round(self.wall(), 1), view).to_wire()))
        except OSError as exc:  # a full disk must not stop the supervisor: the status is only late
            log.warning("cannot write %s: %s", path, exc)
            return
        self.written = view

    def _died(self, key: int, w: _Watched, code: int, now: float) -> str:
        what = f"{self._label(key)} exited with code {code}"
        self.deaths += 1
        self.exit_codes[key] = code
        if now - w.started_at >= self.stable_s:
            w.streak = 0
        w.streak += 1
        w.down_since = now
        delay = restart_delay(w.streak, self.first_delay_s, self.max_delay_s)
        if delay > 0:
            w.retry_at = now + delay
            return f"{what} ({w.streak} times in a row); {self._down_for(key, delay)}"
        try:
            self._restart(key)
        except OSError as exc:  # no fork, no log file: try again later, as after a quick death
            w.retry_at = now + self.first_delay_s
            return f"{what}; cannot restart it ({exc}); {self._down_for(key, w.retry_at - now)}"
        w.started_at, w.restarted = now, True
        return f"{what}; restarted as pid {self._pid(key)}"

    def _retry(self, key: int, w: _Watched, now: float) -> str:
        since = now - (w.down_since if w.down_since is not None else now)
        try:
            self._restart(key)
        except OSError as exc:
            w.streak += 1
            delay = max(restart_delay(w.streak, self.first_delay_s, self.max_delay_s), self.first_delay_s)
            w.retry_at = now + delay
            return f"{self._label(key)}: cannot restart it ({exc}); {self._down_for(key, delay)}"
        w.started_at, w.retry_at, w.restarted = now, None, True
        return f"{self._label(key)} restarted as pid {self._pid(key)} after {since:.1f} s down"

    def _down_for(self, key: int, delay: float) -> str:
        at = time.strftime("%H:%M:%S", time.localtime(self.wall() + delay))
        what = "every link through it is down" if key == RELAY else "its window is down"
        return f"{what}; next restart in {delay:.1f} s (at {at})"

    def _probe_all(self, now: float) -> list[str]:
        probe = self.probe or self.ring.answers
        notes = []
        for rank, proc in enumerate(self.ring.processes):
            if proc.poll() is not None:
                continue
            if self.stopped(proc.pid):
                # Stopped, answering or not: a node stopped while it loads never misses a probe (it has no socket
                # yet), and left alone it stays stopped for good, its window down (the chaos benchmark's stall).
                since = self.stopped_since.setdefault(rank, now)
                if now - since >= self.hang_s:
                    proc.kill()
                    proc.wait()
                    notes.append(f"{self.ring.label(rank)} was stopped for {now - since:.1f} s; killed it")
                continue
            self.stopped_since.pop(rank, None)
            if probe(rank):
                w = self.watched.get(rank)
                if w is not None and w.restarted:
                    w.restarted = False
                    since = now - (w.down_since if w.down_since is not None else now)
                    notes.append(f"{self.ring.label(rank)} answers again, {since:.1f} s after it went down")
                self.answered.add(rank)
                self.last_answer[rank] = now
                self.strikes.pop(rank, None)
                continue
            if rank not in self.answered:
                continue
            self.strikes[rank] = self.strikes.get(rank, 0) + 1
            silent = now - self.last_answer.get(rank, now)
            if self.strikes[rank] >= self.hang_strikes and silent >= self.hang_s:
                proc.kill()  # SIGKILL works on a stopped process too; the next check restarts it
                proc.wait()
                what = f"{self.strikes[rank]} probes, {silent:.1f} s"
                notes.append(f"{self.ring.label(rank)} stopped answering ({what}); killed it")
        return notes


def process_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T or t in /proc, Linux and Android); False where that is not known."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    return bool(fields) and fields[0] in ("T", "t")


def default_threads(n_nodes: int) -> int:
    """llama.cpp threads for each of ``n_nodes`` co-located nodes: this machine's cores shared, never oversubscribed.

    All nodes compute at once under concurrent requests; threads beyond the cores make every ggml barrier wait for a
    descheduled thread (measured on a 3-node ring: 8 requests at cpu_count threads each gave 8.4 tokens/s in total,
    at 1 thread each 64.6).
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, n_nodes))


def start_ring(
    model: Path,
    windows: Sequence[tuple[int, int]],
    cache_dir: Path,
    *,
    run_dir: Path | None = None,
    api_port: int | None = None,
    api_key_file: Path | None = None,
    threads: int | None = None,
    ctx: int = 2048,
    seqs: int = 8,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    relay: bool = False,
    default_control: bool = False,
    tied: bool = False,
    secure: bool = True,
    standby: bool = False,
    entries: bool = False,
    supervised: bool = False,
) -> LocalRing:
    """Cut the stage files, write the manifest, start one node process per window.

    Control sockets go into ``run_dir``; with ``default_control`` (``kvasir ring up``) each node's default path in the
    runtime directory instead, where a bare ``kvasir status``/``kvasir tui`` finds rank 0. ``tied``: the processes
    die with this one (:func:`spawn`). ``secure``: each node gets its own key (``rank{k}.pem`` in ``run_dir``, mode
    0600) and the manifest names them, so the links authenticate and encrypt (protocol v2). ``standby``: one
    standby node per rank (its own port and key, ``rank{k}-standby.pem``), started by :meth:`LocalRing.wait_ready`
    once the primaries are ready and supervised like them (docs/architecture.md § Failover). ``entries``: every
    node (standbys too) serves the API on its own loopback port behind a key made for this run
    (:attr:`LocalRing.entry_ports`, :attr:`LocalRing.entry_key`), for ``ring up``'s front; ``api_port`` is the
    older way, the API on rank 0 only (tests and benches that talk to one node). ``supervised``: every node shows
    the :class:`Supervisor`'s view of the ring in its status (:attr:`LocalRing.supervisor_file`).
    """
    paths = stage_files(model, windows, cache_dir)
    sha = model_sha256(model, cache_dir)
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="kvasir-ring-"))
    n = len(windows)
    processes = 2 * n if standby else n
    ports = free_ports(2 * processes if entries else processes, host, exclude=() if api_port is None else (api_port,))
    standbys = [(StandbyEntry(host, ports[n + k]),) if standby else () for k in range(n)]
    manifest = Manifest(
        model_sha256=sha,
        n_layers=windows[-1][1],
        ranks=tuple(
            RankEntry(k, a, b, host, ports[k], str(paths[k]), standby=standbys[k]) for k, (a, b) in enumerate(windows)
        ),
        model_name=model.stem,
        # A keyless ring's relay edges need the v1 shared secret; a keyed ring's use the operator's grants instead.
        secret=None if secure else secrets.token_hex(16),
    )
    if secure:
        manifest = manifest.with_keys([create_identity(run_dir / f"rank{k}.pem").public for k in range(len(windows))])
        if standby:
            keyed = [
                attrs.evolve(r, standby=(attrs.evolve(r.standby[0], key=_standby_identity(run_dir, r.rank)),))
                for r in manifest.ranks
            ]
            manifest = attrs.evolve(manifest, ranks=tuple(keyed))
        if relay:
            # This run is the ring's operator: its key signs every rank's edge grants, the relay trusts only it.
            operator = create_identity(run_dir / "operator.pem")
            manifest = grant_relay_edges(manifest, operator, int(time.time()) + GRANT_LIFETIME_S)
    manifest_path = run_dir / "ring.toml"
    manifest.write(manifest_path)
    ring = LocalRing(manifest, run_dir, [], [], api_port, tied=tied)
    if entries:
        ring.entry_ports, ring.entry_key = ports[processes:], _entry_key_file(run_dir)
    if supervised:
        ring.supervisor_file = run_dir / SUPERVISOR_FILE
    env = importable_env(without_config(os.environ))  # every setting is a flag below
    # Several nodes share this machine's cores and only one computes at a time. ggml's OpenMP workers meet at a
    # barrier after every graph op: spinning forever (OMP_WAIT_POLICY=active) starves the busy stage, sleeping at
    # once (passive) makes every barrier a futex round trip. A short spin keeps barriers fast and idle nodes quiet
    # (measured in bench/ring_loopback.py: 4 nodes x 2 threads on 2 cores, compute 45 -> 33 ms/token).
    env.setdefault("GOMP_SPINCOUNT", "30000")
    try:  # whatever fails half-way, no process it started outlives it
        _launch(ring, env, host, threads, ctx, seqs, extra_args, relay, default_control, api_key_file)
    except BaseException:
        ring.stop()
        raise
    return ring


def _entry_key_file(run_dir: Path) -> str:
    """A key for this run's internal API ports (:data:`ENTRY_KEY_FILE` in ``run_dir``, mode 0600): the nodes
    require it, only the front (and whoever can read the run directory: this user) has it."""
    key = secrets.token_urlsafe(32)
    with atomic_output(run_dir / ENTRY_KEY_FILE) as tmp:
        tmp.write_text(key + "\n")
        tmp.chmod(0o600)
    return key


def _entry_args(ring: LocalRing, i: int) -> list[str]:
    """Process ``i``'s internal API flags (none without ``entries``)."""
    if not ring.entry_ports:
        return []
    return ["--api-port", str(ring.entry_ports[i]), "--api-key-file", str(ring.run_dir / ENTRY_KEY_FILE)]


def _supervisor_args(ring: LocalRing) -> list[str]:
    return [] if ring.supervisor_file is None else ["--supervisor-state", str(ring.supervisor_file)]


def _standby_identity(run_dir: Path, rank: int) -> PublicKey:
    return create_identity(run_dir / f"rank{rank}-standby.pem").public


def _launch(
    ring: LocalRing,
    env: dict[str, str],
    host: str,
    threads: int | None,
    ctx: int,
    seqs: int,
    extra_args: Sequence[str],
    relay: bool,
    default_control: bool,
    api_key_file: Path | None = None,
) -> None:
    manifest, run_dir, manifest_path, tied = ring.manifest, ring.run_dir, ring.run_dir / "ring.toml", ring.tied
    if relay:
        taken = [p for r in manifest.ranks for p in (r.port, *(s.port for s in r.standby))]
        (relay_port,) = free_ports(1, host, exclude=[*taken, *([] if ring.api_port is None else [ring.api_port])])
        relay_cmd = [sys.executable, "-m", "kvasir", "relay", "--listen", f"{host}:{relay_port}"]
        if manifest.operator is not None:
            relay_cmd += ["--trust-key", manifest.operator.to_text()]  # public: fine on a command line
        else:
            secret_file = run_dir / "relay.secret"  # a file (0600), never argv: /proc/*/cmdline is world-readable
            with atomic_output(secret_file) as tmp:
                tmp.write_text(manifest.secret or "")
                tmp.chmod(0o600)
            relay_cmd += ["--secret-file", str(secret_file)]
        ring.relay = spawn(relay_cmd, env, run_dir / "relay.log", tied=tied)
        ring.relay_command = (relay_cmd, env)
        ring.relay_url = f"ws://{host}:{relay_port}"
        wait_listening(host, relay_port, ring.relay, timeout=30)
        extra_args = [*extra_args, "--relay", ring.relay_url]
    for k, rank in enumerate(manifest.ranks):
        sock = node_socket_path(k, rank.port) if default_control else run_dir / f"rank{k}.sock"
        cmd = _node_command(manifest_path, k, sock, ctx, seqs, extra_args, threads)
        if rank.key is not None:
            cmd += ["--identity", str(run_dir / f"rank{k}.pem")]
        if ring.api_port is not None and k == 0:
            cmd += ["--api-port", str(ring.api_port)]
            if api_key_file is not None:
                cmd += ["--api-key-file", str(api_key_file)]
        cmd += _entry_args(ring, k) + _supervisor_args(ring)
        ring.commands.append((cmd, env))
        ring.sockets.append(sock)
        ring.processes.append(spawn(cmd, env, run_dir / f"rank{k}.log", tied=tied))
    if any(r.standby for r in manifest.ranks):
        ring.standby_start = len(ring.processes)
    for k, rank in enumerate(manifest.ranks):
        if not rank.standby:
            continue
        # Started by wait_ready once the primaries are linked; restarted by the Supervisor like them. No public API
        # (its clients would lose it with the primary it stands in for); an entry of the front when entries are on.
        sock = node_socket_path(k, rank.standby[0].port) if default_control else run_dir / f"rank{k}-standby.sock"
        cmd = [*_node_command(manifest_path, k, sock, ctx, seqs, extra_args, threads), "--standby", "0"]
        if rank.key is not None:
            cmd += ["--identity", str(run_dir / f"rank{k}-standby.pem")]
        cmd += _entry_args(ring, len(ring.commands)) + _supervisor_args(ring)
        ring.commands.append((cmd, env))
        ring.sockets.append(sock)


def _node_command(
    manifest_path: Path, k: int, sock: Path, ctx: int, seqs: int, extra_args: Sequence[str], threads: int | None
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "kvasir",
        "node",
        "--manifest",
        str(manifest_path),
        "--rank",
        str(k),
        "--control",
        str(sock),
        "--ctx",
        str(ctx),
        "--seqs",
        str(seqs),
        *extra_args,
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    return cmd


def importable_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a ``sys.executable -m kvasir`` child that imports what this process imports.

    A wrapped interpreter (nixpkgs' ``wrapPythonPrograms``) puts Kvasir's dependencies on ``sys.path`` inside the
    ``kvasir`` script, not in the environment: the bare interpreter a child runs would find none of them. So the child
    gets this process's import path, ahead of any ``PYTHONPATH`` it had.
    """
    ours = [p for p in sys.path if p and os.path.isdir(p)]
    theirs = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(dict.fromkeys([*ours, *theirs]))}


def spawn(
    cmd: list[str], env: dict[str, str], log: Path, *, append: bool = False, tied: bool = False
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session (a terminal's Ctrl-C goes to its owner, who stops it in order), output to
    ``log``. ``tied``: on Linux and Android the kernel sends it SIGTERM when its parent dies, even by SIGKILL, so a
    killed ``kvasir ring up`` leaves no node behind (strictly: when the thread that started it ends, so start tied
    processes from the main thread)."""
    preexec = _die_with_parent(os.getpid()) if tied and has_pdeathsig() else None
    with log.open("ab" if append else "wb") as log_file:
        return subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=preexec
        )


_PR_SET_PDEATHSIG = 1


def has_pdeathsig() -> bool:
    """Whether this kernel can stop a child when its parent dies: Linux, and Android (Termux's Python says
    ``sys.platform == "android"``; Bionic has the same ``prctl``, and its phantom-process killer sends SIGKILL)."""
    return sys.platform.startswith(("linux", "android"))


def _die_with_parent(parent: int) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before the fork: the child only calls into it

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the line above: nobody is left to stop us
            os._exit(1)

    return preexec


def wait_listening(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RingError(f"process exited with code {proc.returncode} before listening on {host}:{port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.05)
    raise RingError(f"nothing listening on {host}:{port} after {timeout:.0f} s")
