"""An emulated fleet on one Linux machine: each node in its own network namespace, behind a shaped access link, with
its CPU and memory capped by cgroup v1 (bench/fleet.py, tests/test_fleet.py).

Topology: a star. A switch namespace routes between N node namespaces; node k reaches it over one emulated access
link, a pair of TUN devices (``kv0`` in the node, ``n<k>`` in the switch) joined by the forwarding process below.
A hop from node a to node b crosses a's link, then b's: its one-way latency is ``delay(a) + delay(b)``, the model
of ``kvasir plan`` (docs/planner.md: a device's link_latency_ms is to the shared network; a hop pays both ends).

This kernel has no netem, so the forwarder shapes in user space, per direction of each link:

* delay: every packet waits the profile's one-way delay plus a uniform jitter in [-jitter, +jitter];
* no reordering: a packet is never delivered before the one ahead of it (as on a real FIFO link; netem's jitter
  reorders, which real Wi-Fi and LTE mostly do not);
* rate: packets serialise at the link's rate (the queue drains at rate_mbps);
* loss: a packet is dropped with the profile's probability, so the kernel's TCP really retransmits it.

The TUN devices are not persistent: they vanish when the forwarder exits. Everything else (namespaces, cgroups,
node processes) is removed by :func:`fleet`'s cleanup, also on Ctrl-C; node processes and the forwarder also get
SIGTERM if the process that started them dies (PR_SET_PDEATHSIG).

Run as ``python -m tests.harness.fleet forward CONFIG.json`` (the forwarder; started by :func:`fleet`).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import fcntl
import json
import os
import random
import re
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import attrs

from kvasir.core.errors import KvasirError
from kvasir.local.launcher import LocalRing
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.shard.cache import model_sha256, stage_files

_CHECKOUT = Path(__file__).resolve().parents[2]

CLONE_NEWNET: Final = 0x40000000
TUNSETIFF: Final = 0x400454CA
IFF_TUN: Final = 0x0001
IFF_NO_PI: Final = 0x1000
PR_SET_PDEATHSIG: Final = 1
#: Bytes a TCP/IPv4 segment adds to its payload on the wire (20 IP + 20 TCP + 12 timestamp option).
SEGMENT_OVERHEAD: Final = 52
MSS: Final = 1448
#: cgroup v1 CFS quotas cannot be shorter than 1 ms; a fraction f of a core is 1 ms of every 1/f ms.
MIN_QUOTA_US: Final = 1000
NODE_PORT: Final = 7100


class FleetError(KvasirError):
    """The emulated fleet could not be built (not root, no ``ip netns``, no cgroup v1, a node failed)."""


@attrs.frozen
class LinkProfile:
    """One device's access link to the shared network, each direction."""

    name: str
    delay_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbps: float | None = None

    def transfer_ms(self, payload: int) -> float:
        """Serialisation time of one ``payload``-byte message (TCP segments and headers) on this link."""
        if self.rate_mbps is None:
            return 0.0
        segments = max(1, -(-payload // MSS))
        return (payload + segments * SEGMENT_OVERHEAD) * 8 / (self.rate_mbps * 1e3)


#: Access-link profiles. A hop joins two access links: two LAN devices are 0.4 ms apart one way, two WAN devices
#: 10 ms (the 20 ms round trip of a 2-stage split over the internet).
PROFILES: Final[dict[str, LinkProfile]] = {
    "none": LinkProfile("none", 0.0),
    "lan": LinkProfile("lan", 0.2, rate_mbps=1000.0),
    "wifi": LinkProfile("wifi", 3.0, 1.0, rate_mbps=300.0),
    "lte": LinkProfile("lte", 30.0, 10.0, 0.005, 10.0),
    "wan": LinkProfile("wan", 5.0, rate_mbps=100.0),
}


@attrs.frozen
class FleetNode:
    """One emulated device: its access link, its share of one core (1.0: uncapped) and its memory cap."""

    name: str
    kind: str
    link: LinkProfile
    cpu: float = 1.0
    memory_bytes: int | None = None


def unavailable() -> str | None:
    """Why a fleet cannot be built here, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, TUN devices, cgroups)"
    if shutil.which("ip") is None:
        return "needs the ip tool (apt-get install iproute2)"
    if not Path("/dev/net/tun").exists():
        return "needs /dev/net/tun"
    for ctl in ("cpu", "memory"):
        if not Path(f"/sys/fs/cgroup/{ctl}/cgroup.procs").exists():
            return f"needs the cgroup v1 {ctl} controller mounted at /sys/fs/cgroup/{ctl}"
    probe = f"kvf-probe-{uuid.uuid4().hex[:6]}"
    try:
        _run("ip", "netns", "add", probe)
    except FleetError as exc:
        return f"ip netns add failed: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FleetError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")


def _own_cgroup(controller: str) -> Path:
    """This process's cgroup directory for a v1 controller (new groups nest under it, so outer limits hold)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctls, path = line.split(":", 2)
        if controller in ctls.split(","):
            return Path(f"/sys/fs/cgroup/{controller}") / path.lstrip("/")
    raise FleetError(f"no cgroup v1 {controller} controller in /proc/self/cgroup")


@attrs.define
class Fleet:
    """A built fleet: node k lives in namespace ``namespaces[k]`` at ``address(k)``, in cgroups ``cgroups[k]``."""

    tag: str
    nodes: tuple[FleetNode, ...]
    switch: str
    namespaces: list[str]
    cgroups: list[list[Path]]
    forwarder: subprocess.Popen[bytes] | None = None
    processes: list[subprocess.Popen[bytes]] = attrs.field(factory=list)

    def address(self, k: int) -> str:
        return f"10.{_subnet(self.tag)}.{k + 1}.2"

    def command(self, k: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside node k's namespace."""
        return ["ip", "netns", "exec", self.namespaces[k], *argv]

    def spawn(
        self, k: int, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``argv`` in node k's namespace and cgroups (joined before exec, so every thread is capped)."""
        procs = [str(g / "cgroup.procs") for g in self.cgroups[k]]

        def enter() -> None:
            for p in procs:
                with open(p, "w") as fh:
                    fh.write(str(os.getpid()))
            _pdeathsig()

        with log.open("ab") as fh:
            proc = subprocess.Popen(
                self.command(k, argv), stdout=fh, stderr=subprocess.STDOUT, env=env, preexec_fn=enter
            )
        self.processes.append(proc)
        return proc

    def memory_cap_hits(self, k: int) -> int | None:
        """How often node k's memory use reached its cap (memory.failcnt; 0: it never needed more)."""
        for g in self.cgroups[k]:
            f = g / "memory.failcnt"
            if f.exists():
                return int(f.read_text())
        return None


def _subnet(tag: str) -> int:
    return 100 + int(tag, 16) % 100


def _pdeathsig() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@contextlib.contextmanager
def fleet(nodes: Sequence[FleetNode], run_dir: Path, *, seed: int = 0) -> Iterator[Fleet]:
    """Build the namespaces, links and cgroups for ``nodes``; tear everything down on exit, whatever happens."""
    why = unavailable()
    if why:
        raise FleetError(why)
    tag = uuid.uuid4().hex[:6]
    f = Fleet(tag, tuple(nodes), f"kvf-{tag}-sw", [f"kvf-{tag}-{k}" for k in range(len(nodes))], [])
    net = _subnet(tag)
    made_ns: list[str] = []
    made_cg: list[Path] = []
    try:
        for ns in (f.switch, *f.namespaces):
            _run("ip", "netns", "add", ns)
            made_ns.append(ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for ctl in ("cpu", "memory"):
            root = _own_cgroup(ctl) / f"kvfleet-{tag}"
            root.mkdir()
            made_cg.append(root)
        for k, node in enumerate(nodes):
            groups = []
            cpu = _own_cgroup("cpu") / f"kvfleet-{tag}" / f"n{k}"
            cpu.mkdir()
            made_cg.insert(0, cpu)
            if node.cpu < 1.0:
                period = round(MIN_QUOTA_US / node.cpu)
                (cpu / "cpu.cfs_period_us").write_text(str(period))
                (cpu / "cpu.cfs_quota_us").write_text(str(MIN_QUOTA_US))
            groups.append(cpu)
            mem = _own_cgroup("memory") / f"kvfleet-{tag}" / f"n{k}"
            mem.mkdir()
            made_cg.insert(0, mem)
            if node.memory_bytes is not None:
                (mem / "memory.limit_in_bytes").write_text(str(node.memory_bytes))
            groups.append(mem)
            f.cgroups.append(groups)
        config = {
            "links": [
                {
                    "node_ns": f.namespaces[k],
                    "switch_ns": f.switch,
                    "node_dev": "kv0",
                    "switch_dev": f"n{k}",
                    "delay_ms": n.link.delay_ms,
                    "jitter_ms": n.link.jitter_ms,
                    "loss": n.link.loss,
                    "rate_mbps": n.link.rate_mbps,
                }
                for k, n in enumerate(nodes)
            ],
            "seed": seed,
        }
        cfg = run_dir / f"fleet-{tag}.json"
        cfg.write_text(json.dumps(config))
        with (run_dir / f"forwarder-{tag}.log").open("wb") as log:
            # The harness is not installed (tests/ is not in the wheel): the forwarder finds it from the checkout.
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_CHECKOUT), os.environ.get("PYTHONPATH", "")])}
            f.forwarder = subprocess.Popen(
                [sys.executable, "-m", "tests.harness.fleet", "forward", str(cfg)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=_pdeathsig,
            )
        assert f.forwarder.stdout is not None
        ready, _, _ = select.select([f.forwarder.stdout], [], [], 30)
        if not ready or f.forwarder.stdout.readline().strip() != b"ready":
            raise FleetError(f"the link forwarder did not start: {(run_dir / f'forwarder-{tag}.log').read_text()}")
        _run("ip", "netns", "exec", f.switch, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        _run("ip", "netns", "exec", f.switch, "sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
        for k in range(len(nodes)):
            ns = f.namespaces[k]
            _run("ip", "-n", f.switch, "addr", "add", f"10.{net}.{k + 1}.1/24", "dev", f"n{k}")
            _run("ip", "-n", f.switch, "link", "set", f"n{k}", "up")
            _run("ip", "-n", ns, "addr", "add", f"{f.address(k)}/24", "dev", "kv0")
            _run("ip", "-n", ns, "link", "set", "kv0", "up")
            _run("ip", "-n", ns, "route", "add", f"10.{net}.0.0/16", "dev", "kv0")
        yield f
    finally:
        with _uninterrupted():
            _teardown(f, made_ns, made_cg)


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM while tearing down: a second Ctrl-C (a terminal sends one to every process of the
    group, `timeout` forwards another) must not cut the cleanup short and leave namespaces or cgroups behind."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _teardown(f: Fleet, made_ns: Sequence[str], made_cg: Sequence[Path]) -> None:
    for p in f.processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 10
    for p in f.processes:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if f.forwarder is not None:
        f.forwarder.terminate()
        try:
            f.forwarder.wait(5)
        except subprocess.TimeoutExpired:
            f.forwarder.kill()
            f.forwarder.wait()
        if f.forwarder.stdout is not None:
            f.forwarder.stdout.close()
    for ns in made_ns:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    for g in made_cg:  # children first
        for _ in range(50):  # a killed task leaves its cgroup a moment after wait() returns
            try:
                g.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def start_fleet_ring(
    f: Fleet,
    model: Path,
    windows: Sequence[tuple[int, int]],
    cache_dir: Path,
    run_dir: Path,
    *,
    threads: int = 1,
    ctx: int = 512,
    seqs: int = 1,
    extra_args: Sequence[str] = (),
) -> LocalRing:
    """One ``kvasir node`` per window, rank k on fleet node k, as :func:`kvasir.local.launcher.start_ring` does on
    loopback (same manifest, same command line, ``extra_args`` appended), each node listening on its own namespace's
    address."""
    if len(windows) != len(f.nodes):
        raise FleetError(f"{len(windows)} windows for {len(f.nodes)} fleet nodes")
    paths = stage_files(model, windows, cache_dir)
    manifest = Manifest(
        model_sha256=model_sha256(model, cache_dir),
        n_layers=windows[-1][1],
        ranks=tuple(RankEntry(k, a, b, f.address(k), NODE_PORT, str(paths[k])) for k, (a, b) in enumerate(windows)),
        model_name=model.stem,
        secret=secrets.token_hex(16),
    )
    manifest_path = run_dir / "ring.toml"
    manifest.write(manifest_path)
    env = dict(os.environ)
    env.setdefault("GOMP_SPINCOUNT", "30000")  # as the launcher does (kvasir/local/launcher.py)
    procs, socks = [], []
    for k in range(len(windows)):
        sock = run_dir / f"rank{k}.sock"
        cmd = [
            sys.executable, "-m", "kvasir", "node", "--manifest", str(manifest_path), "--rank", str(k),
            "--control", str(sock), "--ctx", str(ctx), "--seqs", str(seqs), "--threads", str(threads), *extra_args,
        ]  # fmt: skip
        procs.append(f.spawn(k, cmd, run_dir / f"rank{k}.log", env))
        socks.append(sock)
    return LocalRing(manifest, run_dir, procs, socks, None)


def link_stats(run_dir: Path) -> tuple[int, int]:
    """(packets, dropped) over every link direction of the fleets run in ``run_dir`` (the forwarders' last words)."""
    packets = dropped = 0
    for log in run_dir.glob("forwarder-*.log"):
        lines = log.read_text().strip().splitlines()
        with contextlib.suppress(ValueError, IndexError):
            for d in json.loads(lines[-1]).values():
                packets += d["packets"]
                dropped += d["dropped"]
    return packets, dropped


def memory_of(pid: int) -> tuple[int | None, int | None]:
    """(peak RSS, file-backed RSS now) of a process: VmHWM, the most resident memory it ever had, and RssFile, the
    mapped file pages it holds (its stage file's weights, which llama.cpp maps, plus shared libraries)."""
    out: list[int | None] = []
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{pid}/status").read_text()
        for key in ("VmHWM", "RssFile"):
            m = re.search(rf"{key}:\s+(\d+) kB", status)
            out.append(int(m.group(1)) * 1024 if m else None)
        return out[0], out[1]
    return None, None


def leftovers(tag: str | None = None) -> list[str]:
    """Namespaces and cgroups a fleet left behind (for tests: there must be none)."""
    prefix = f"kvf-{tag}" if tag else "kvf-"
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]
    for ctl in ("cpu", "memory"):
        with contextlib.suppress(FleetError):
            root = _own_cgroup(ctl)
            found += [str(p) for p in root.glob(f"kvfleet-{tag or ''}*")]
    return found


# ---------------------------------------------------------------------------------------------------- forwarder


def _setns(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def _open_tun(ns: str, name: str) -> int:
    _setns(f"/var/run/netns/{ns}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


@attrs.define
class _Direction:
    """One direction of one link: packets waiting for their delivery time, in order."""

    dst: int
    delay_s: float
    jitter_s: float
    loss: float
    rate_bps: float | None
    rng: random.Random
    queue: collections.deque[tuple[float, bytes]] = attrs.field(factory=collections.deque)
    wire_free: float = 0.0
    last_due: float = 0.0
    dropped: int = 0
    packets: int = 0

    def admit(self, now: float, pkt: bytes) -> None:
        self.packets += 1
        if self.loss and self.rng.random() < self.loss:
            self.dropped += 1
            return
        sent = now
        if self.rate_bps:
            self.wire_free = max(now, self.wire_free) + len(pkt) * 8 / self.rate_bps
            sent = self.wire_free
        jitter = self.rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        due = max(sent + max(0.0, self.delay_s + jitter), self.last_due)
        self.last_due = due
        self.queue.append((due, pkt))


def forward(config: dict[str, Any]) -> None:
    """Join each link's two TUN devices, shaping both directions, until SIGTERM."""
    home = "/proc/self/ns/net"
    home_fd = os.open(home, os.O_RDONLY)
    rng = random.Random(config.get("seed", 0))
    directions: dict[int, _Direction] = {}
    for link in config["links"]:
        a = _open_tun(link["node_ns"], link["node_dev"])
        b = _open_tun(link["switch_ns"], link["switch_dev"])
        rate = link["rate_mbps"] * 1e6 if link["rate_mbps"] else None
        for src, dst in ((a, b), (b, a)):
            directions[src] = _Direction(
                dst,
                link["delay_ms"] / 1e3,
                link["jitter_ms"] / 1e3,
                link["loss"],
                rate,
                random.Random(rng.random()),
            )
    libc = ctypes.CDLL(None, use_errno=True)
    libc.setns(home_fd, CLONE_NEWNET)
    os.close(home_fd)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    with contextlib.suppress(PermissionError):
        os.nice(-10)  # shaping accuracy matters more than the nodes' compute on a loaded machine
    print("ready", flush=True)
    fds = list(directions)
    while not stop:
        now = time.monotonic()
        due = min((d.queue[0][0] for d in directions.values() if d.queue), default=now + 1.0)
        try:
            readable, _, _ = select.select(fds, [], [], max(0.0, due - now))
        except InterruptedError:
            continue
        now = time.monotonic()
        for fd in readable:
            d = directions[fd]
            for _ in range(64):  # drain what is there, bounded so no link starves the others
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    break
                d.admit(now, pkt)
        now = time.monotonic()
        for d in directions.values():
            while d.queue and d.queue[0][0] <= now:
                with contextlib.suppress(OSError):  # a device going away at shutdown
                    os.write(d.dst, d.queue.popleft()[1])
    stats = {str(fd): {"packets": d.packets, "dropped": d.dropped} for fd, d in directions.items()}
    print(json.dumps(stats), file=sys.stderr, flush=True)


def main(argv: Sequence[str]) -> int:
    if len(argv) == 2 and argv[0] == "forward":
        forward(json.loads(Path(argv[1]).read_text()))
        return 0
    print("usage: python -m tests.harness.fleet forward CONFIG.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
