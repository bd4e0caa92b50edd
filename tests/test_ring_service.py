"""`kvasir ring up` as a service: signals stop all its nodes, a bare `kvasir status` finds it, dead nodes restart."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from kvasir.commands import ring as ring_command
from kvasir.control.client import ControlClient
from kvasir.core.errors import RingError
from kvasir.local import launcher
from kvasir.local.launcher import LocalRing, Supervisor, default_threads, restart_delay
from kvasir.ring.linkmgr import TcpTransport
from kvasir.ring.manifest import Manifest
from kvasir.ring.status import SupervisorStatus, read_supervisor_state, supervisor_lines
from kvasir.util.cli import error_line
from tests.conftest import REPO
from tests.ringutil import ring_generate


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def banner_pids(banner: str) -> dict[str, int]:
    """Rank and relay pids from the banner of `kvasir ring up`."""
    found = re.findall(r"^\s+(rank \d+|relay):.*? pid (\d+)", banner, re.M)
    return {name: int(pid) for name, pid in found}


@attrs.define
class RingUp:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    env: dict[str, str]

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def pids(self) -> dict[str, int]:
        return banner_pids(self.stdout())

    def kvasir(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvasir", *args], env=self.env, capture_output=True, text=True, timeout=60
        )


def service_env(tmp_path: Path, cache_dir: Path) -> dict[str, str]:
    """`ring up`'s environment in a test: its own runtime directory (control sockets) and TMPDIR (run directory)."""
    runtime, tmp = tmp_path / "xdg", tmp_path / "tmp"
    runtime.mkdir(mode=0o700)
    tmp.mkdir()
    return dict(
        os.environ, XDG_RUNTIME_DIR=str(runtime), TMPDIR=str(tmp), KVASIR_CACHE=str(cache_dir), PYTHONPATH=str(REPO)
    )


def run_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").glob("kvasir-ring-*"))


@contextlib.contextmanager
def ring_up(model: Path | None, tmp_path: Path, cache_dir: Path, *extra: str) -> Iterator[RingUp]:
    """`kvasir ring up [MODEL] EXTRA...` serving, in its own runtime directory, until the banner is out."""
    env = service_env(tmp_path, cache_dir)
    out, err = tmp_path / "ring-up.out", tmp_path / "ring-up.err"
    cmd = [sys.executable, "-m", "kvasir", "ring", "up", *([str(model)] if model else []), "--threads=1", "--seqs=2"]
    cmd += ["--ctx=256", *extra]
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=tmp_path)
    up = RingUp(proc, out, err, env)
    try:
        wait_for(lambda: "stops the ring" in up.stdout() or proc.poll() is not None, 180, "the ring")
        assert proc.poll() is None, up.stderr()
        yield up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in up.pids().values():  # never leave a node behind, whatever the test found
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_stop_signal_ends_every_node_and_the_relay(
    signum: signal.Signals, tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model("llama", "f32")
    extra = ("--stages=3", "--relay") if signum == signal.SIGTERM else ("--stages=2",)
    with ring_up(model, tmp_path, cache_dir, *extra) as up:
        pids = up.pids()
        assert len(pids) == (4 if signum == signal.SIGTERM else 2), up.stdout()
        assert all(alive(pid) for pid in pids.values())
        # A bare `kvasir status` (no --socket) finds rank 0 of this ring in the runtime directory.
        st = up.kvasir("status", "--json")
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["rank"] == 0 and status["ring_size"] == len(pids) - ("relay" in pids)
        up.proc.send_signal(signum)
        assert up.proc.wait(timeout=30) == 0, up.stderr()
        assert signum.name in up.stderr()
        assert [name for name, pid in pids.items() if alive(pid)] == []
        assert list((tmp_path / "xdg" / "kvasir").glob("*.sock")) == []
        # A clean stop leaves nothing of the run: no private key, no log.
        assert run_dirs(tmp_path) == [] and "logs are kept" not in up.stderr()


@pytest.mark.slow
def test_a_killed_node_is_restarted_and_the_ring_serves_again(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    model = tiny_model("llama", "f32")
    with ring_up(model, tmp_path, cache_dir, "--stages=3") as up:
        pids = up.pids()
        sock0 = next((tmp_path / "xdg" / "kvasir").glob("rank0-*.sock"))
        before = ring_generate(sock0, "Hello world", 8)
        os.kill(pids["rank 1"], signal.SIGKILL)
        wait_for(lambda: "rank 1 exited" in up.stderr(), 30, "the restart")
        match = re.search(r"rank 1 exited with code -9; restarted as pid (\d+)", up.stderr())
        assert match, up.stderr()
        new_pid = int(match.group(1))
        assert new_pid != pids["rank 1"] and alive(new_pid)

        def serves() -> bool:
            try:
                return bool(ring_generate(sock0, "Hello world", 8)["tokens"] == before["tokens"])
            except (RingError, OSError):
                return False

        wait_for(serves, 90, "the relinked ring")
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0
        assert not alive(new_pid) and not any(alive(p) for p in pids.values())


@pytest.mark.slow
def test_a_window_killed_again_and_again_is_restarted_with_backoff_and_the_rest_keeps_serving(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """The review's crash loop (rank 2 SIGKILLed as soon as it was back, 6 times in 11 s) made `ring up` exit 2 and
    take ranks 0 and 1 down. Now: restarts back off, the healthy ranks stay, the ring answers once it is left alone."""
    model = tiny_model("llama", "f32")
    with ring_up(model, tmp_path, cache_dir, "--stages=3", "--max-restart-delay=1") as up:
        pids = up.pids()
        sock0 = next((tmp_path / "xdg" / "kvasir").glob("rank0-*.sock"))
        before = ring_generate(sock0, "Hello world", 8)
        victim = pids["rank 2"]

        def restarts() -> list[str]:
            return re.findall(r"rank 2 (?:exited with code -9; )?restarted as pid (\d+)", up.stderr())

        def restarted(n: int) -> bool:
            return len(restarts()) == n

        for kill in range(1, 5):  # each as soon as it is back (still loading, from the second on)
            os.kill(victim, signal.SIGKILL)
            wait_for(functools.partial(restarted, kill), 30, f"restart {kill}")
            victim = int(restarts()[-1])
        err = up.stderr()
        assert "rank 2 exited with code -9; restarted as pid" in err  # the first death: at once
        for streak, delay in ((2, "0.5"), (3, "1.0"), (4, "1.0")):  # then backing off, up to the cap
            assert (
                f"rank 2 exited with code -9 ({streak} times in a row); its window is down; next restart in {delay} s"
                in err
            )
        assert up.proc.poll() is None
        assert alive(pids["rank 0"]) and alive(pids["rank 1"])  # never taken down with it

        def serves() -> bool:
            try:
                return bool(ring_generate(sock0, "Hello world", 8)["tokens"] == before["tokens"])
            except (RingError, OSError):
                return False

        wait_for(serves, 90, "the relinked ring")
        wait_for(lambda: "rank 2 answers again" in up.stderr(), 10, "the note that rank 2 is back")
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=30) == 0, up.stderr()
        # Nodes died during the run: their logs stay, and where; the private keys go anyway.
        (kept,) = run_dirs(tmp_path)
        assert f"a node died during the run; the nodes' logs are kept in {kept}" in up.stderr()
        assert sorted(p.name for p in kept.iterdir()) == ["rank0.log", "rank1.log", "rank2.log", "ring.toml"]
        assert not alive(victim) and not any(alive(p) for p in pids.values())


@pytest.mark.slow
def test_kvasir_status_shows_a_window_down_and_when_it_is_retried(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 killed as soon as it is back, 4 times: the 4th restart waits 2 s. Meanwhile rank 0's status (its
    control socket, `kvasir status`) says rank 1 is down, why, and when it is retried; then that all are up again."""
    model = tiny_model("llama", "f32")
    with ring_up(model, tmp_path, cache_dir, "--stages=3", "--max-restart-delay=4") as up:
        sock0 = next((tmp_path / "xdg" / "kvasir").glob("rank0-*.sock"))
        victim = up.pids()["rank 1"]

        def restarts() -> list[str]:
            return re.findall(r"rank 1 (?:exited with code -9; )?restarted as pid (\d+)", up.stderr())

        for kill in range(1, 4):
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda n=kill: len(restarts()) == n, 30, f"restart {kill}")  # type: ignore[misc]
            victim = int(restarts()[-1])
        os.kill(victim, signal.SIGKILL)  # the 4th death in a row: down for 2 s

        def rank1() -> dict[str, Any] | None:
            with ControlClient(sock0, timeout=10) as c:
                sup = c.status().get("supervisor") or {}
            return next((p for p in sup.get("processes", []) if p["label"] == "rank 1"), None)

        wait_for(lambda: (rank1() or {}).get("state") == "down", 10, "rank 0's status to show rank 1 down")
        down = rank1()
        assert down is not None and (down["streak"], down["exit_code"]) == (4, -9), down
        assert down["retry_at"] - down["down_since"] == pytest.approx(2.0, abs=0.15) and down["pid"] is None
        shown = up.kvasir("status", "--socket", str(sock0))
        assert shown.returncode == 0, shown.stderr
        clock = time.strftime("%H:%M:%S", time.localtime(down["retry_at"]))
        assert re.search(
            rf"^ring up: rank 1 down since \d\d:\d\d:\d\d \(exit -9, 4 times in a row\); next restart at {clock}$",
            shown.stdout,
            re.M,
        ), shown.stdout
        wait_for(lambda: (rank1() or {}).get("state") == "up", 60, "rank 1 to answer again")
        shown = up.kvasir("status", "--socket", str(sock0))
        assert "ring up: all 3 processes up" in shown.stdout, shown.stdout
        as_json = json.loads(up.kvasir("status", "--json", "--socket", str(sock0)).stdout)
        assert [p["state"] for p in as_json["supervisor"]["processes"]] == ["up", "up", "up"]


def _refused_ring_up(tmp_path: Path, *args: str) -> str:
    """`kvasir ring up ARGS` that must fail before it cuts the model or starts a node: its one line of stderr."""
    cache = tmp_path / "cache"  # fresh: a balanced split would calibrate and cut into it
    env = service_env(tmp_path, cache)
    cmd = [sys.executable, "-m", "kvasir", "ring", "up", *args, "--stages=2", "--threads=1"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert not cache.exists() and run_dirs(tmp_path) == []  # nothing cut, no run directory, no key
    assert list((tmp_path / "xdg").iterdir()) == []  # no node made its control socket
    return r.stderr


def test_ring_up_refuses_a_taken_api_port_before_anything_starts(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _refused_ring_up(tmp_path, str(tiny_model("llama", "f32")), f"--api-port={port}")
    assert err == f"kvasir ring: error: 127.0.0.1:{port} is already in use (--api-port)\n"


@pytest.mark.parametrize("problem", ["mode 0644", "missing", "empty"])
def test_ring_up_refuses_a_bad_api_key_file_before_anything_starts(
    problem: str, tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    keys = tmp_path / "api-keys"
    if problem != "missing":
        keys.write_text("sk-kvasir-test-0123456789\n" if problem == "mode 0644" else "# none yet\n")
        keys.chmod(0o644 if problem == "mode 0644" else 0o600)
    (port,) = launcher.free_ports(1)
    err = _refused_ring_up(tmp_path, str(tiny_model("llama", "f32")), f"--api-port={port}", f"--api-key-file={keys}")
    expected = {
        "mode 0644": f"API key file {keys} is readable by others; chmod 600 it",
        "missing": f"cannot read API key file {keys}: No such file or directory",
        "empty": f"API key file {keys} holds no key",
    }
    assert err == f"kvasir ring: error: {expected[problem]}\n"


def test_ring_up_refuses_a_missing_model_before_anything_starts(tmp_path: Path) -> None:
    model = tmp_path / "nope.gguf"
    assert _refused_ring_up(tmp_path, str(model)) == f"kvasir ring: error: {model}: no such file\n"


def test_a_node_whose_link_port_is_taken_names_the_address() -> None:
    """`kvasir node` prints this line (one OSError, its strerror) instead of a bare "Address already in use"."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]

        async def listen() -> None:
            async def handler(stream: trio.abc.Stream, peer: str) -> None:
                pass

            await TcpTransport().listen("127.0.0.1", port, handler)

        with pytest.raises(OSError) as raised:
            trio.run(listen)
    assert error_line(raised.value) == f"127.0.0.1:{port} is already in use"


@pytest.mark.slow
def test_ring_up_prompt_leaves_no_run_directory(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    env = service_env(tmp_path, cache_dir)
    cmd = [sys.executable, "-m", "kvasir", "ring", "up", str(tiny_model("llama", "f32")), "--splits=0,3,6"]
    cmd += ["--threads=1", "--ctx=256", "--prompt=Hello world", "--max-tokens=4", "--json"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["tokens"]) == 4
    assert run_dirs(tmp_path) == [] and "logs are kept" not in r.stderr  # keys, manifest and logs all gone


@pytest.mark.slow
def test_ring_up_prompt_runs_under_the_supervisor_a_node_killed_mid_answer_changes_nothing(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """`ring up --prompt`: rank 1 SIGKILLed once the answer streams. The supervisor restarts it, the ring replays the
    request into it, the text is the fault-free one. (Unsupervised, the request failed after the failover wait.)"""
    env = service_env(tmp_path, cache_dir)
    cmd = [sys.executable, "-m", "kvasir", "ring", "up", str(tiny_model("llama", "f32")), "--stages=3"]
    cmd += ["--threads=1", "--ctx=256", "--prompt=Hello world", "--max-tokens=200", "--temperature=0"]
    clean = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    # Unbuffered: communicate() reads the pipe itself, past anything a buffered read(1) had taken in.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path, bufsize=0)
    victim = None
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.read(1)  # the answer streams: the request is in the ring
        for line in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            argv = Path(f"/proc/{line}/cmdline").read_bytes().split(b"\0")
            if b"--rank" in argv and argv[argv.index(b"--rank") + 1] == b"1":
                victim = int(line)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err.decode()
    assert (first + rest).decode() == clean.stdout
    assert re.search(r"rank 1 exited with code -9; restarted as pid \d+", err.decode()), err.decode()
    assert "200 tokens through 3 nodes" in err.decode()


@pytest.mark.slow
def test_a_ring_that_fails_keeps_its_logs_and_says_where_but_not_its_keys(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """Every node fails after the preflight passed (--record names a file, not a directory): the log says why."""
    (tmp_path / "not-a-dir").write_text("")
    env = service_env(tmp_path, cache_dir)
    cmd = [sys.executable, "-m", "kvasir", "ring", "up", str(tiny_model("llama", "f32")), "--splits=0,3,6"]
    cmd += ["--threads=1", "--ctx=256", "--record", str(tmp_path / "not-a-dir")]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    (kept,) = run_dirs(tmp_path)
    assert f"ring up: the ring failed; the nodes' logs are kept in {kept}\n" in r.stderr
    assert re.search(r"kvasir ring: error: rank \d exited with code 2", r.stderr), r.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["rank0.log", "rank1.log", "ring.toml"]
    assert "File exists" in "".join(p.read_text() for p in kept.glob("*.log"))
    assert list((tmp_path / "xdg" / "kvasir").glob("*.sock")) == []


def _crashing_ring(tmp_path: Path, n: int, code: int) -> LocalRing:
    cmd = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    procs = [subprocess.Popen(cmd) for _ in range(n)]
    manifest = Manifest(model_sha256="0" * 64, n_layers=n, ranks=())
    return LocalRing(manifest, tmp_path, procs, [], None, commands=[(cmd, dict(os.environ))] * n)


def test_restart_delays_double_up_to_the_cap() -> None:
    assert [restart_delay(n, 0.5, 30) for n in range(1, 10)] == [0, 0.5, 1, 2, 4, 8, 16, 30, 30]
    assert [restart_delay(n, 1, 3) for n in range(0, 5)] == [0, 0, 1, 2, 3]


def test_supervisor_backs_off_a_crash_loop_and_never_gives_up(tmp_path: Path) -> None:
    """A process that keeps dying is restarted at once, then after growing delays (one line per change of state,
    the next restart's time in it); one that ran for stable_s before it died starts over at once."""
    ring = _crashing_ring(tmp_path, 2, 3)
    sup = Supervisor(ring, first_delay_s=0.5, max_delay_s=1.0, stable_s=10.0, wall=lambda: 0.0)

    def died(now: float) -> list[str]:
        for p in ring.processes:
            p.wait()
        return sup.check(now=now)

    def at(delay: float) -> str:
        return time.strftime("%H:%M:%S", time.localtime(delay))

    first = [p.pid for p in ring.processes]
    notes = died(0.0)
    assert [n.split(";")[0] for n in notes] == ["rank 0 exited with code 3", "rank 1 exited with code 3"]
    assert [p.pid for p in ring.processes] != first and sup.down() == []
    notes = died(1.0)
    down = f"its window is down; next restart in 0.5 s (at {at(0.5)})"
    assert notes == [f"rank {k} exited with code 3 (2 times in a row); {down}" for k in (0, 1)]
    assert sup.down() == [0, 1]
    assert sup.check(now=1.4) == []  # not due yet: nothing restarted, nothing said again
    notes = sup.check(now=1.5)
    assert notes == [f"rank {k} restarted as pid {ring.processes[k].pid} after 0.5 s down" for k in (0, 1)]
    assert sup.down() == []
    notes = died(2.0)
    assert (
        notes[0]
        == f"rank 0 exited with code 3 (3 times in a row); its window is down; next restart in 1.0 s (at {at(1)})"
    )
    assert sup.check(now=3.0)[0].startswith("rank 0 restarted as pid")
    notes = died(3.5)
    assert "(4 times in a row)" in notes[0] and "next restart in 1.0 s" in notes[0]  # capped
    assert sup.check(now=4.5)[0].startswith("rank 0 restarted as pid")
    # Up for stable_s since its last restart: a new streak, restarted at once.
    assert died(14.5)[0].startswith("rank 0 exited with code 3; restarted as pid")
    assert sup.deaths == 10
    ring.stop()


def test_supervisor_writes_each_process_state_for_the_nodes_status(tmp_path: Path) -> None:
    """The file every node of `ring up` reads into its status: each process up, starting (restarted, not answering
    yet) or down with its next restart (Unix time), rewritten when that changes."""
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(crash), subprocess.Popen(sleep)]
    manifest = Manifest(model_sha256="0" * 64, n_layers=2, ranks=())
    ring = LocalRing(manifest, tmp_path, procs, [], None, commands=[(crash, dict(os.environ)), (sleep, {})])
    ring.supervisor_file = tmp_path / launcher.SUPERVISOR_FILE
    answers = {0: False, 1: False}
    sup = Supervisor(ring, first_delay_s=0.5, max_delay_s=1.0, wall=lambda: 1000.0, probe=lambda k: answers[k])

    def view() -> list[tuple[str, str, int, int | None, float | None, float | None]]:
        state = read_supervisor_state(tmp_path / launcher.SUPERVISOR_FILE)
        assert state is not None and state.written_at == 1000.0
        return [(p.label, p.state, p.streak, p.exit_code, p.down_since, p.retry_at) for p in state.processes]

    ring.processes[0].wait()
    sup.check(now=0.0)  # rank 0 restarted at once: starting (loading), its exit code kept; rank 1 still loading
    assert view() == [("rank 0", "starting", 1, 3, 1000.0, None), ("rank 1", "starting", 0, None, None, None)]
    answers[1] = True
    ring.processes[0].wait()
    sup.check(now=2.0)  # rank 0 died again: down, its restart in 0.5 s (the wall's 1000 + 0.5)
    assert view() == [("rank 0", "down", 2, 3, 1000.0, 1000.5), ("rank 1", "up", 0, None, None, None)]
    lines = supervisor_lines(SupervisorStatus(1000.0, sup.view(2.0)), clock=lambda t: f"<{t:.1f}>")
    assert lines == ["rank 0 down since <1000.0> (exit 3, 2 times in a row); next restart at <1000.5>"]
    sup.check(now=2.5)
    assert view()[0][:2] == ("rank 0", "starting")
    ring.commands[0] = (sleep, {})  # it stays up this time
    ring.processes[0].wait()
    sup.check(now=3.0)
    answers[0] = True
    sup.check(now=4.5)
    assert [v[1] for v in view()] == ["up", "up"]
    assert supervisor_lines(SupervisorStatus(1000.0, sup.view(4.5))) == ["all 2 processes up"]
    ring.stop()


def test_a_relay_that_keeps_dying_is_restarted_with_backoff_too(tmp_path: Path) -> None:
    ring = _crashing_ring(tmp_path, 0, 3)
    cmd = [sys.executable, "-c", "import sys; sys.exit(4)"]
    ring.relay, ring.relay_command = subprocess.Popen(cmd), (cmd, dict(os.environ))
    sup = Supervisor(ring, first_delay_s=0.5, max_delay_s=30.0, wall=lambda: 0.0)
    ring.relay.wait()
    assert sup.check(now=0.0) == [f"the relay exited with code 4; restarted as pid {ring.relay.pid}"]
    ring.relay.wait()
    at = time.strftime("%H:%M:%S", time.localtime(0.5))
    down = f"every link through it is down; next restart in 0.5 s (at {at})"
    assert sup.check(now=1.0) == [f"the relay exited with code 4 (2 times in a row); {down}"]
    assert sup.down() == [launcher.RELAY]
    assert sup.check(now=1.5) == [f"the relay restarted as pid {ring.relay.pid} after 0.5 s down"]
    ring.stop()


def test_supervisor_leaves_running_ranks_alone(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(cmd)
    ring = LocalRing(Manifest(model_sha256="0" * 64, n_layers=1, ranks=()), tmp_path, [proc], [], None)
    try:
        assert Supervisor(ring).check() == []
        assert ring.processes[0] is proc
    finally:
        ring.stop()
    assert proc.returncode == -signal.SIGTERM


def test_supervisor_kills_a_node_that_stopped_answering_and_restarts_it(tmp_path: Path) -> None:
    """A node that answered once and then misses hang_strikes probes in a row (a SIGSTOP, a deadlock) is killed and,
    at the next check, restarted; one that never answered yet (still loading) is left alone."""
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(cmd), subprocess.Popen(cmd)]
    ring = LocalRing(
        Manifest(model_sha256="0" * 64, n_layers=2, ranks=()), tmp_path, list(procs), [], None, commands=[(cmd, {})] * 2
    )
    answers = {0: [True, False, False, False], 1: [False] * 4}  # rank 1 never answered: loading, not hung
    sup = Supervisor(ring, hang_strikes=3, hang_s=2.5, probe_interval_s=1.0, probe=lambda rank: answers[rank].pop(0))
    try:
        assert sup.check(now=0.0) == []
        assert sup.check(now=1.0) == [] and sup.check(now=2.0) == []
        assert sup.check(now=2.5) == []  # between probes: nothing asked
        notes = sup.check(now=3.0)
        assert notes == ["rank 0 stopped answering (3 probes, 3.0 s); killed it"]
        assert procs[0].returncode == -signal.SIGKILL and procs[1].poll() is None
        sup.probe = lambda rank: True
        notes = sup.check(now=3.5)
        assert notes[0].startswith("rank 0 exited with code -9; restarted as pid")
        assert ring.processes[0] is not procs[0] and ring.processes[1] is procs[1]
        assert sup.check(now=4.5) == ["rank 0 answers again, 1.0 s after it went down"]
        assert sup.check(now=5.5) == []
    finally:
        ring.stop()


@pytest.mark.skipif(not launcher.has_pdeathsig(), reason="reads the process state from /proc (Linux)")
def test_supervisor_kills_a_node_stopped_before_it_ever_answered(tmp_path: Path) -> None:
    """A node SIGSTOPped while it loads (no control socket yet, so no probe to miss) is killed once it has been
    stopped hang_s, and restarted: left alone it stayed stopped for good, its window down (the chaos benchmark's
    stall at 360 s: both holders of a window stopped during their loads). A node stopped for less is left alone."""
    cmd = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(cmd), subprocess.Popen(cmd)]
    ring = LocalRing(
        Manifest(model_sha256="0" * 64, n_layers=2, ranks=()), tmp_path, list(procs), [], None, commands=[(cmd, {})] * 2
    )
    sup = Supervisor(ring, hang_s=2.5, probe_interval_s=1.0, probe=lambda rank: False)  # never answers: loading
    try:
        assert not launcher.process_stopped(procs[0].pid)
        procs[0].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not launcher.process_stopped(procs[0].pid):
            assert time.monotonic() < deadline, "the process never showed as stopped"
            time.sleep(0.01)
        assert sup.check(now=0.0) == [] and sup.check(now=1.0) == [] and sup.check(now=2.0) == []
        notes = sup.check(now=3.0)
        assert notes == ["rank 0 was stopped for 3.0 s; killed it"]
        assert procs[0].returncode == -signal.SIGKILL and procs[1].poll() is None
        notes = sup.check(now=3.5)
        assert notes[0].startswith("rank 0 exited with code -9; restarted as pid")
        assert ring.processes[0] is not procs[0] and ring.processes[1] is procs[1]
        # SIGCONT within hang_s: never killed.
        procs[1].send_signal(signal.SIGSTOP)
        while not launcher.process_stopped(procs[1].pid):
            time.sleep(0.01)
        assert sup.check(now=4.5) == []
        procs[1].send_signal(signal.SIGCONT)
        while launcher.process_stopped(procs[1].pid):
            time.sleep(0.01)
        assert sup.check(now=8.0) == [] and procs[1].poll() is None and 1 not in sup.stopped_since
    finally:
        ring.stop()
    assert not launcher.process_stopped(procs[0].pid)  # gone: not known, so not stopped


def test_default_threads_share_the_cores() -> None:
    cores = len(os.sched_getaffinity(0))
    for n in (1, 2, 3, 8, 64):
        t = default_threads(n)
        assert t >= 1 and (t * n <= cores or t == 1)
    assert default_threads(1) == cores


def test_a_stop_signal_during_startup_is_delivered_once_the_ring_exists() -> None:
    with ring_command._stop_signals() as stopper:
        os.kill(os.getpid(), signal.SIGTERM)  # while processes would be starting: only remembered
        os.kill(os.getpid(), signal.SIGHUP)
        with pytest.raises(ring_command._Stopped) as stopped:
            stopper.arm()
        assert stopped.value.name == "SIGTERM"
        stopper.arm()  # armed again (the ring is serving): a signal raises at once
        with pytest.raises(ring_command._Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)  # the handler runs in the main thread at the next bytecode boundary
        assert stopped.value.name == "SIGHUP"
        stopper.disarm()
        os.kill(os.getpid(), signal.SIGINT)  # during cleanup: ignored, also by a later arm
        stopper.arm()
    assert signal.getsignal(signal.SIGTERM) is not stopper.handle


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_bare_tui_finds_the_ring_and_killing_the_tmux_session_stops_it(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path
) -> None:
    """As a user runs it: `kvasir ring up` in one tmux window, a bare `kvasir tui` in another, then kill-session."""
    model = tiny_model("llama", "f32")
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), KVASIR_CACHE=str(cache_dir), PYTHONPATH=str(REPO))
    env["TERM"] = "xterm-256color"
    out = tmp_path / "ring-up.out"
    up = shlex.join([sys.executable, "-m", "kvasir", "ring", "up", str(model), "--stages=2", "--threads=1"])
    tmux = ["tmux", "-L", f"kvasir-service-test-{os.getpid()}"]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", "ring", "-x", "120", "-y", "30", f"{up} > {shlex.quote(str(out))}"],
        check=True,
        env=env,
    )
    pids: dict[str, int] = {}
    try:
        wait_for(lambda: out.exists() and "stops the ring" in out.read_text(), 120, "the ring")
        pids = banner_pids(out.read_text())
        assert len(pids) == 2
        assert "watch it:   kvasir tui\n" in out.read_text()
        tui = shlex.join([sys.executable, "-m", "kvasir", "tui"])
        subprocess.run([*tmux, "new-window", "-t", "ring", "-n", "tui", tui], check=True, env=env)

        def screen() -> str:
            r = subprocess.run([*tmux, "capture-pane", "-p", "-t", "ring:tui"], capture_output=True, text=True)
            return r.stdout

        wait_for(lambda: "connected" in screen() and "rank 0/2" in screen(), 60, "the TUI on rank 0")
        subprocess.run([*tmux, "kill-session", "-t", "ring"], check=True)
        wait_for(lambda: not any(alive(pid) for pid in pids.values()), 30, "every node to stop")
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_nodes_die_with_a_killed_ring_up(tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path) -> None:
    """SIGKILL gives `kvasir ring up` no chance to clean up: the kernel stops its nodes instead."""
    with ring_up(tiny_model("llama", "f32"), tmp_path, cache_dir, "--stages=2", "--relay") as up:
        pids = up.pids()
        assert len(pids) == 3
        up.proc.kill()
        up.proc.wait()
        wait_for(lambda: not any(alive(pid) for pid in pids.values()), 30, "the orphaned nodes to stop")


def test_a_launch_that_fails_half_way_leaves_no_process(
    tiny_model: Callable[..., Path], cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[subprocess.Popen[bytes]] = []

    def spawn_once(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        if started:
            raise OSError("no more processes")
        started.append(real_spawn(*args, **kwargs))
        return started[0]

    real_spawn = launcher.spawn
    monkeypatch.setattr(launcher, "spawn", spawn_once)
    with pytest.raises(OSError, match="no more processes"):
        launcher.start_ring(tiny_model("llama", "f32"), [(0, 3), (3, 6)], cache_dir, run_dir=tmp_path, threads=1)
    assert started and started[0].returncode is not None


def test_nodes_import_what_a_wrapped_ring_up_imports(tmp_path: Path) -> None:
    """nixpkgs' wrapper adds Kvasir's dependencies to sys.path inside the `kvasir` script, not the environment: a
    node started as `sys.executable -m kvasir` must still import them (ring up passes its import path on)."""
    extra = tmp_path / "wrapped-site"
    extra.mkdir()
    (extra / "only_in_the_wrapper.py").write_text("WHERE = 'wrapper'\n")
    parent = (
        "import subprocess, sys\n"
        f"sys.path.insert(0, {str(extra)!r})  # what the wrapper's site.addsitedir does\n"
        "from kvasir.local.launcher import importable_env\n"
        "child = 'import only_in_the_wrapper as m; print(m.WHERE)'\n"
        "for env in ({}, importable_env({})):\n"
        "    r = subprocess.run([sys.executable, '-c', child], env=env, capture_output=True, text=True)\n"
        "    print(r.stdout.strip() or 'ImportError' if 'ModuleNotFoundError' in r.stderr else r.stdout.strip())\n"
    )
    r = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ImportError", "wrapper"]
