"""The ring over an emulated fleet: every node in its own network namespace behind a shaped link, CPU and memory capped.

For each scenario (a model, a fleet of devices with link profiles and CPU shares) it starts one `kvasir node` per
device (tests/harness/fleet.py builds the namespaces, links and cgroups), decodes greedily through rank 0, and
prints:

- measured decode ms/token (median and min-max over the repeats);
- the floor: Σ window compute + Σ over hops (one-way latency + transfer), with each window's compute measured in the
  ring itself (the node's busy time per decoded token, inside its cgroup) and the links' injected delays;
- `kvasir plan`'s estimate for the same ring (kvasir.planner.estimate over a devices list for the fleet: the
  bandwidth calibrated on this machine's whole-model decode, scaled by each node's CPU share; link latency and
  bandwidth from its profile), and the ratios;
- whether the ring's tokens equal the whole model's in one process (greedy, bit-exact);
- per node: peak RSS and the file pages it maps (its stage file, shared libraries) against the bytes of its window
  and of the whole model; each node runs under a memory cap of its window + 256 MB.

    sudo python3 bench/fleet.py [--quick] [--scenarios gemma-lan,qwen122b-mixed12] [--tokens 32] [--repeats 3]

--quick runs only the Qwen3.5-122B-shaped 12-node scenario, 16 tokens, 2 repeats (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)  # run as a script: tests.harness comes from the checkout

from kvasir.control.client import ControlClient  # noqa: E402
from kvasir.demo import demo_model_path  # noqa: E402
from kvasir.local.launcher import LocalRing, start_ring  # noqa: E402
from kvasir.planner.devices import Device  # noqa: E402
from kvasir.planner.estimate import TOKEN_FRAME_BYTES, boundary_bytes, estimate  # noqa: E402
from kvasir.planner.profile import profile_from_gguf  # noqa: E402
from kvasir.shard.cache import default_cache_dir, even_splits, stage_files  # noqa: E402
from kvasir.stage.engine import Stage, StageConfig  # noqa: E402
from kvasir.stage.pipeline import LocalPipeline  # noqa: E402
from kvasir.testing.tinymodels import tiny_model_cached  # noqa: E402
from kvasir.wire import SamplingParams  # noqa: E402
from tests.harness.fleet import PROFILES, Fleet, FleetNode, fleet, link_stats, memory_of, start_fleet_ring  # noqa: E402

PROMPT = "Write a short story about a ring of devices that pass hidden states to each other:"
#: Runtime memory a node needs besides its window (Python, llama.cpp, buffers): the cgroup cap is window + this.
RUNTIME_ALLOWANCE = 256 << 20

#: The Qwen3.5-122B-A10B shape: the real qwen35moe architecture, all 49 blocks (full attention every 4th, Gated
#: DeltaNet otherwise, routed MoE plus a shared expert in every block), tiny width and random weights.
QWEN122B_SHAPE: dict[str, Any] = {
    "n_layer": 49,
    "n_embd": 256,
    "n_head": 4,
    "n_head_kv": 2,
    "full_attention_interval": 4,
    "n_expert": 16,
    "n_expert_used": 2,
}

#: The seed's mixed fleet, 12 devices (examples/devices-mixed.toml extended): desktop GPUs, a Mac, CPU servers and an
#: NPU board on the LAN, five phones on Wi-Fi, one on LTE. CPU share stands for the device's speed.
MIXED12: tuple[tuple[str, str, str, float], ...] = (
    ("gpu-box", "gpu", "lan", 1.0),
    ("gpu-2", "gpu", "lan", 1.0),
    ("mac-32", "gpu", "lan", 0.6),
    ("cpu-server", "cpu", "lan", 0.5),
    ("cpu-2", "cpu", "lan", 0.5),
    ("npu-box", "npu", "lan", 0.25),
    ("phone-s24", "phone", "wifi", 0.3),
    ("phone-op12", "phone", "wifi", 0.3),
    ("phone-pixel8", "phone", "wifi", 0.25),
    ("phone-a54", "phone", "wifi", 0.25),
    ("phone-tab", "phone", "wifi", 0.25),
    ("phone-travel", "phone", "lte", 0.25),
)


@attrs.frozen
class Scenario:
    name: str
    model: str  # "gemma" | "qwen122b"
    devices: tuple[tuple[str, str, str, float], ...]  # name, kind, profile, cpu share


def uniform(name: str, model: str, n: int, profile: str) -> Scenario:
    return Scenario(name, model, tuple((f"node{k}", "cpu", profile, 1.0) for k in range(n)))


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        *(uniform(f"gemma-3x-{p}", "gemma", 3, p) for p in ("loopback", "none", "lan", "wifi", "lte", "wan")),
        uniform("qwen122b-12x-loopback", "qwen122b", 12, "loopback"),
        uniform("qwen122b-12x-none", "qwen122b", 12, "none"),
        Scenario("qwen122b-mixed12", "qwen122b", MIXED12),
        # The same links, no CPU caps: what the caps cost.
        Scenario("qwen122b-mixed12-fullcpu", "qwen122b", tuple((n, k, p, 1.0) for n, k, p, _ in MIXED12)),
    )
}
QUICK = ("qwen122b-mixed12",)


@attrs.frozen
class Reference:
    tokens: list[int]
    decode_ms: float


def reference(model: Path, tokens: int) -> Reference:
    """The whole model greedy in one process, one thread: the bit-exact reference and the planner's calibration."""
    with Stage.load(StageConfig(model, n_ctx=512, n_seq_max=1, n_threads=1)) as stage:
        pipe = LocalPipeline([stage])
        prompt = stage.vocab.tokenize(PROMPT)
        runs = [pipe.generate(prompt, SamplingParams(temperature=0.0), tokens) for _ in range(3)]
    return Reference(runs[0].tokens, statistics.median(r.decode_ms_per_token for r in runs[1:]))


def busy(socks: Sequence[Path]) -> list[float]:
    out = []
    for s in socks:
        with ControlClient(s, timeout=30) as c:
            out.append(float(c.status()["busy_s"]))
    return out


def timed_request(sock: Path, tokens: int) -> tuple[list[int], float]:
    """Token ids and decode ms/token (first to last streamed token) of one greedy request."""
    ids: list[int] = []
    t_first = t_last = 0.0
    with ControlClient(sock, timeout=300) as c:
        for msg in c.generate(prompt=PROMPT, max_tokens=tokens, temperature=0.0):
            if msg["type"] == "token" and msg["token"] >= 0:
                ids.append(msg["token"])
                t_last = time.perf_counter()
                if len(ids) == 1:
                    t_first = t_last
    return ids, (t_last - t_first) * 1e3 / max(1, len(ids) - 1)


def measure(
    ring: LocalRing, ref: Reference, tokens: int, repeats: int, window_bytes: Sequence[int]
) -> tuple[list[float], list[float], bool, list[tuple[int | None, int | None, int]]]:
    """Decode ms/token per run, each rank's compute ms per decoded token (median), whether every run's tokens equal
    the reference's, and each rank's memory."""
    ring.wait_ready(timeout=300)
    socks = ring.sockets
    timed_request(socks[0], 4)  # warm up: page-ins, TCP windows
    b0 = busy(socks)
    timed_request(socks[0], 1)  # prefill and one token: subtracted from each run's busy time
    prefill = [b - a for a, b in zip(b0, busy(socks), strict=True)]
    runs: list[float] = []
    per_token: list[list[float]] = []
    exact = True
    for _ in range(repeats):
        before = busy(socks)
        ids, ms = timed_request(socks[0], tokens)
        after = busy(socks)
        exact &= ids == ref.tokens[: len(ids)] and len(ids) == min(tokens, len(ref.tokens))
        runs.append(ms)
        steps = max(1, len(ids) - 1)
        per_token.append([(b - a - p) * 1e3 / steps for a, b, p in zip(before, after, prefill, strict=True)])
    memory = [(*memory_of(p.pid), window_bytes[k]) for k, p in enumerate(ring.processes)]
    return runs, [statistics.median(col) for col in zip(*per_token, strict=True)], exact, memory


@attrs.frozen
class Result:
    scenario: Scenario
    runs: list[float]
    floor_ms: float
    compute_ms: list[float]
    link_ms: float
    planner_ms: float
    exact: bool
    memory: list[tuple[int | None, int | None, int]]  # peak RSS, file-backed RSS, window bytes
    cap_hits: list[int | None]  # memory.failcnt per node
    model_bytes: int
    packets: tuple[int, int]  # forwarded, dropped by the loss emulation
    windows: list[tuple[int, int]]


def run_scenario(sc: Scenario, model: Path, ref: Reference, cache: Path, tokens: int, repeats: int) -> Result:
    prof = profile_from_gguf(model)
    windows = even_splits(prof.n_layers, len(sc.devices))
    paths = stage_files(model, windows, cache)
    window_bytes = [p.stat().st_size for p in paths]
    nodes = [
        FleetNode(name, kind, PROFILES.get(p, PROFILES["none"]), cpu, window_bytes[k] + RUNTIME_ALLOWANCE)
        for k, (name, kind, p, cpu) in enumerate(sc.devices)
    ]
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvasir-fleet-{sc.name}-"))
    f: Fleet | None = None
    with contextlib.ExitStack() as stack:
        if all(p == "loopback" for _, _, p, _ in sc.devices):
            # The baseline: the same ring on 127.0.0.1 with no namespaces, shaping or caps (kvasir's own launcher).
            ring = start_ring(model, windows, cache, run_dir=run_dir, threads=1, ctx=512, seqs=1)
        else:
            f = stack.enter_context(fleet(nodes, run_dir))
            ring = start_fleet_ring(f, model, windows, cache, run_dir)
        stack.callback(ring.stop)
        runs, compute, exact, memory = measure(ring, ref, tokens, repeats, window_bytes)
        cap_hits: list[int | None] = [f.memory_cap_hits(k) if f else None for k in range(len(nodes))]
    packets, dropped = link_stats(run_dir)
    n = len(nodes)
    payload = boundary_bytes(prof)
    link = 0.0
    for k in range(n):
        a, b = nodes[k].link, nodes[(k + 1) % n].link
        size = TOKEN_FRAME_BYTES if k == n - 1 else payload
        link += a.delay_ms + b.delay_ms + a.transfer_ms(size) + b.transfer_ms(size)
    # The planner's devices for this fleet: bandwidth calibrated so that the whole model on one uncapped device takes
    # the measured reference time, scaled by each node's CPU share.
    unit = estimate(prof, [(Device("cal", "cpu", 1e3, 1.0, 0.0, 1e6), 0, prof.n_layers)]).ms_per_token
    bandwidth = unit / ref.decode_ms
    devices = [
        Device(nd.name, nd.kind, 1e3, bandwidth * nd.cpu, nd.link.delay_ms, nd.link.rate_mbps or 1e5)  # type: ignore[arg-type]
        for nd in nodes
    ]
    planner = estimate(prof, [(d, a, b) for d, (a, b) in zip(devices, windows, strict=True)]).ms_per_token
    # The same devices as a file, for `kvasir plan --model MODEL --devices FILE` (which may choose other windows).
    (run_dir / "devices.toml").write_text(
        "".join(
            f'[[device]]\nname = "{d.name}"\nkind = "{d.kind}"\nmemory_gb = {d.memory_gb}\n'
            f"mem_bandwidth_gbs = {d.mem_bandwidth_gbs:.4f}\nlink_latency_ms = {d.link_latency_ms}\n"
            f"link_bandwidth_mbps = {d.link_bandwidth_mbps}\n\n"
            for d in devices
        )
    )
    return Result(
        sc,
        runs,
        sum(compute) + link,
        compute,
        link,
        planner,
        exact,
        memory,
        cap_hits,
        model.stat().st_size,
        (packets, dropped),
        windows,
    )


def mb(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e6:.1f}"


def report(console: Console, results: Sequence[Result], refs: dict[str, Reference], args: argparse.Namespace) -> None:
    t = Table(
        title=f"ring over an emulated fleet: decode ms/token, {args.tokens} tokens, {args.repeats} repeats "
        "(median, min-max); floor = Σ window compute + Σ hops (one-way latency + transfer)"
    )
    for col in (
        "scenario",
        "nodes",
        "measured",
        "spread",
        "floor",
        "(compute + links)",
        "planner",
        "measured/floor",
        "measured/planner",
        "tokens = whole model",
        "packets lost",
    ):
        t.add_column(col, justify="right")
    for r in results:
        m = statistics.median(r.runs)
        t.add_row(
            r.scenario.name,
            str(len(r.scenario.devices)),
            f"{m:.2f}",
            f"{min(r.runs):.2f}–{max(r.runs):.2f}",
            f"{r.floor_ms:.2f}",
            f"{sum(r.compute_ms):.2f} + {r.link_ms:.2f}",
            f"{r.planner_ms:.2f}",
            f"{m / r.floor_ms:.2f}x",
            f"{m / r.planner_ms:.2f}x",
            "yes" if r.exact else "NO",
            f"{r.packets[1]} / {r.packets[0]}" if r.packets[0] else "–",
        )
    console.print(t)
    for name, ref in refs.items():
        console.print(f"whole model {name}, one process, 1 thread: {ref.decode_ms:.2f} ms/token")
    for r in results:
        mt = Table(title=f"{r.scenario.name}: per node (whole model file {mb(r.model_bytes)} MB)")
        for col in ("rank", "device", "link", "cpu share", "layers", "compute ms/token", "window MB", "peak RSS MB",
                    "mapped file MB", "cap MB", "cap hits"):  # fmt: skip
            mt.add_column(col, justify="right")
        for k, ((name, _kind, prof, cpu), (rss, cg, wb), (a, b)) in enumerate(
            zip(r.scenario.devices, r.memory, r.windows, strict=True)
        ):
            hits = r.cap_hits[k]
            mt.add_row(str(k), name, prof, f"{cpu:.2f}", f"{a}:{b}", f"{r.compute_ms[k]:.2f}", mb(wb), mb(rss), mb(cg),
                       mb(wb + RUNTIME_ALLOWANCE), "–" if hits is None else str(hits))  # fmt: skip
        console.print(mt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated: {', '.join(SCENARIOS)}")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="the 12-node Qwen3.5-122B-shaped scenario, 16 tokens, 2 runs")
    args = ap.parse_args()
    if args.quick:
        args.scenarios, args.tokens, args.repeats = ",".join(QUICK), 16, 2
    names = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        sys.exit(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    # SIGTERM unwinds like Ctrl-C, so every fleet's cleanup (namespaces, cgroups, processes) runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cache = default_cache_dir()
    models: dict[str, Callable[[], Path]] = {
        "gemma": lambda: demo_model_path(cache),
        "qwen122b": lambda: tiny_model_cached(cache / "tiny", "qwen35moe", **QWEN122B_SHAPE),
    }
    console = Console(width=170)
    refs: dict[str, Reference] = {}
    paths: dict[str, Path] = {}
    results = []
    with contextlib.suppress(KeyboardInterrupt):
        for name in names:
            sc = SCENARIOS[name]
            if sc.model not in refs:
                paths[sc.model] = models[sc.model]()
                refs[sc.model] = reference(paths[sc.model], args.tokens)
            t0 = time.monotonic()
            results.append(run_scenario(sc, paths[sc.model], refs[sc.model], cache, args.tokens, args.repeats))
            console.print(f"[dim]{name}: {time.monotonic() - t0:.0f} s[/dim]")
    report(console, results, refs, args)


if __name__ == "__main__":
    main()
