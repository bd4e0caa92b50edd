"""The planner: DP optimality by brute force, memory limits, the Qwen3.5-122B plan, GGUF profiles, the CLI."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvasir.cli
from kvasir.core.errors import InputError, UnsupportedArchitecture, WindowError
from kvasir.planner import (
    Device,
    LayerProfile,
    ModelProfile,
    RankManifest,
    allowed_boundaries,
    estimate,
    load_devices,
    padding_layers,
    plan,
    profile_from_gguf,
    profile_from_mapping,
    window_cost,
)
from kvasir.planner.profile import profile_to_mapping
from kvasir.profiles import load_profile, resolve_model, shipped_profiles

ROOT = Path(__file__).resolve().parent.parent
FLEET = ROOT / "examples" / "devices-mixed.toml"
GB = 1e9


# ---------------------------------------------------------------------------------------------------- helpers


def make_profile(sizes: list[int], *, arch: str = "llama", kinds: list[str] | None = None) -> ModelProfile:
    kinds = kinds or ["attention"] * len(sizes)
    return ModelProfile(
        name="toy",
        arch=arch,
        n_embd=64,
        vocab_size=1000,
        layers=tuple(
            LayerProfile(
                bytes=s,
                active_bytes=s // 2,
                kind=k,  # type: ignore[arg-type]
                kv_bytes_per_token=1000 if k == "attention" else 0,
                state_bytes=0 if k == "attention" else 10_000_000,
            )
            for s, k in zip(sizes, kinds, strict=True)
        ),
        embd_bytes=200_000_000,
        head_bytes=300_000_000,
        other_bytes=1000,
    )


def dev(name: str, memory_gb: float, bw: float = 100.0, lat: float = 1.0, link: float = 1000.0) -> Device:
    return Device(
        name=name,
        kind="cpu",
        memory_gb=memory_gb,
        mem_bandwidth_gbs=bw,
        link_latency_ms=lat,
        link_bandwidth_mbps=link,
    )


def compositions(n: int, k: int) -> list[tuple[int, ...]]:
    """Cut points of ``n`` layers into ``k`` non-empty contiguous windows."""
    return [(0, *cuts, n) for cuts in itertools.combinations(range(1, n), k - 1)]


def brute_force(profile: ModelProfile, ring: list[Device]) -> float | None:
    """Least ms/token over every rotation of ``ring``, every order-keeping subset and every split."""
    best: float | None = None
    n = profile.n_layers
    for shift in range(len(ring)):
        rotated = ring[shift:] + ring[:shift]
        for k in range(1, len(ring) + 1):
            for rest in itertools.combinations(rotated[1:], k - 1):
                used = [rotated[0], *rest]
                for cuts in compositions(n, k):
                    manifest = estimate(profile, [(d, cuts[i], cuts[i + 1]) for i, d in enumerate(used)])
                    if manifest.fits and (best is None or manifest.ms_per_token < best):
                        best = manifest.ms_per_token
    return best


def check_manifest(manifest: RankManifest, profile: ModelProfile) -> None:
    expected = 0
    for rank, w in enumerate(manifest.windows):
        assert w.rank == rank
        assert w.start == expected and w.stop > w.start
        assert w.memory_bytes <= w.device.memory_bytes
        expected = w.stop
    assert expected == profile.n_layers
    assert len({w.device.name for w in manifest.windows}) == len(manifest.windows)


layer_sizes = st.lists(st.integers(50_000_000, 1_000_000_000), min_size=1, max_size=5)
# Budgets of a few layers and latencies comparable to compute times, so plans use one, two or three devices.
fleets = st.lists(
    st.tuples(
        st.floats(0.7, 3.0),  # memory_gb
        st.floats(5.0, 500.0),  # GB/s
        st.floats(0.0, 2.0),  # latency ms
        st.floats(1.0, 10_000.0),  # Mbit/s
    ),
    min_size=1,
    max_size=3,
)


def build_fleet(specs: list[tuple[float, float, float, float]]) -> list[Device]:
    return [dev(f"d{i}", m, bw, lat, link) for i, (m, bw, lat, link) in enumerate(specs)]


# ------------------------------------------------------------------------------------------------- optimality


@settings(max_examples=60, deadline=None)
@given(sizes=layer_sizes, specs=fleets, hybrid=st.booleans(), data=st.data())
def test_dp_matches_brute_force_for_a_fixed_order(
    sizes: list[int], specs: list[tuple[float, float, float, float]], hybrid: bool, data: st.DataObject
) -> None:
    kinds = data.draw(st.lists(st.sampled_from(["attention", "recurrent"]), min_size=len(sizes), max_size=len(sizes)))
    profile = make_profile(sizes, arch="qwen35" if hybrid else "llama", kinds=kinds if hybrid else None)
    devices = build_fleet(specs)
    order = data.draw(st.permutations([d.name for d in devices]))
    ring = [next(d for d in devices if d.name == name) for name in order]
    expected = brute_force(profile, ring)
    event("no plan fits" if expected is None else "fits")
    if expected is None:
        with pytest.raises(InputError, match="no plan fits"):
            plan(profile, devices, order=order)
        return
    manifest = plan(profile, devices, order=order)
    event(f"{len(manifest.windows)} of {len(devices)} devices used")
    check_manifest(manifest, profile)
    assert math.isclose(manifest.ms_per_token, expected, rel_tol=1e-9, abs_tol=1e-9)
    # The ring follows the requested cyclic order.
    names = [w.device.name for w in manifest.windows]
    start = order.index(names[0])
    rotated = list(order[start:]) + list(order[:start])
    assert names == [n for n in rotated if n in names]


@settings(max_examples=30, deadline=None)
@given(sizes=layer_sizes, specs=fleets)
def test_free_order_is_optimal_over_all_orders(
    sizes: list[int], specs: list[tuple[float, float, float, float]]
) -> None:
    profile = make_profile(sizes)
    devices = build_fleet(specs)
    results = [brute_force(profile, list(p)) for p in itertools.permutations(devices)]
    feasible = [r for r in results if r is not None]
    if not feasible:
        with pytest.raises(InputError):
            plan(profile, devices)
        return
    manifest = plan(profile, devices)
    check_manifest(manifest, profile)
    assert math.isclose(manifest.ms_per_token, min(feasible), rel_tol=1e-9, abs_tol=1e-9)
    used = {w.device.name for w in manifest.windows}
    assert {u.device.name for u in manifest.unused} == {d.name for d in devices} - used


def test_memory_forces_a_split() -> None:
    profile = make_profile([1_000_000_000] * 6)
    fast_small = dev("fast", 3.0, bw=1000)
    slow_big = dev("slow", 10.0, bw=10)
    manifest = plan(profile, [fast_small, slow_big])
    check_manifest(manifest, profile)
    assert {w.device.name for w in manifest.windows} == {"fast", "slow"}
    # The fast device takes as many layers as its budget allows.
    fast = next(w for w in manifest.windows if w.device.name == "fast")
    assert window_cost(profile, 0, fast.n_layers + 1, n_ctx=4096).memory_bytes > fast_small.memory_bytes


def test_slow_link_device_is_left_out_with_a_reason() -> None:
    profile = make_profile([1_000_000_000] * 4)
    manifest = plan(profile, [dev("box", 10.0, bw=100), dev("phone", 8.0, bw=100, lat=50, link=10)])
    assert [w.device.name for w in manifest.windows] == ["box"]
    assert manifest.windows[0].hop_ms == 0.0  # a ring of one
    (unused,) = manifest.unused
    assert unused.device.name == "phone" and "not needed" in unused.reason
    # Equally fast memory is not called slower (the link is what keeps it out).
    assert "memory no faster (100 GB/s) than box (100 GB/s" in unused.reason


def test_each_hop_pays_the_receiving_nodes_overhead() -> None:
    """A hop costs the links and what the node it reaches adds to each frame (waking, hand-off, sending on): a ring
    of N devices pays it N times, a ring of one never; enough of it keeps a device that would save compute out."""
    profile = make_profile([1_000_000_000] * 4)
    a, b = dev("a", 10.0, bw=100, lat=0.5), dev("b", 10.0, bw=100, lat=0.5)
    quiet_b = attrs.evolve(b, hop_overhead_ms=0.0)
    two = estimate(profile, [(a, 0, 2), (b, 2, 4)])
    assert [w.hop_ms for w in two.windows] == pytest.approx(
        [0.5 + 0.5 + two.windows[0].transfer_ms + 1.0, 1.0 + 1.0 + two.windows[1].transfer_ms]
    )
    assert estimate(profile, [(a, 0, 2), (quiet_b, 2, 4)]).link_ms == pytest.approx(two.link_ms - 1.0)
    assert estimate(profile, [(a, 0, 4)]).link_ms == 0.0  # a ring of one
    # Memory forces no split here: a second device only adds hops, and each hop its node's overhead.
    assert len(plan(profile, [a, b]).windows) == 1
    # A split that saves compute is worth it while two hops cost less than the compute it saves.
    fast = dev("fast", 2.5, bw=1000, lat=0.0)  # room for two layers
    slow = dev("slow", 10.0, bw=10, lat=0.0)
    cheap = plan(profile, [attrs.evolve(fast, hop_overhead_ms=0.1), attrs.evolve(slow, hop_overhead_ms=0.1)])
    assert len(cheap.windows) == 2
    costly = plan(profile, [attrs.evolve(fast, hop_overhead_ms=500.0), attrs.evolve(slow, hop_overhead_ms=500.0)])
    assert [w.device.name for w in costly.windows] == ["slow"]


def test_tiny_device_is_reported_as_too_small() -> None:
    profile = make_profile([1_000_000_000] * 4)
    manifest = plan(profile, [dev("box", 10.0), dev("watch", 0.5)])
    (unused,) = manifest.unused
    assert "too little memory" in unused.reason


def test_no_fit_names_the_shortfall() -> None:
    profile = make_profile([1_000_000_000] * 4)
    with pytest.raises(InputError, match=r"total memory short by \d+\.\d GB") as info:
        plan(profile, [dev("a", 1.0), dev("b", 1.0)])
    assert "\n" not in str(info.value)


def test_no_fit_when_memory_suffices_but_no_split_does() -> None:
    profile = make_profile([1_000_000_000] * 2)
    with pytest.raises(InputError, match="no contiguous split fits") as info:
        plan(profile, [dev("a", 1.6), dev("b", 2.4)])
    assert "\n" not in str(info.value)


def test_order_must_name_every_device() -> None:
    profile = make_profile([1_000_000_000] * 2)
    with pytest.raises(InputError, match="order"):
        plan(profile, [dev("a", 9.0), dev("b", 9.0)], order=["a"])


# ------------------------------------------------------------------------------------------- boundary rules


def test_every_boundary_is_allowed_for_supported_archs() -> None:
    for arch in ("llama", "gemma3", "qwen35", "qwen35moe"):
        assert allowed_boundaries(make_profile([1] * 5, arch=arch)) == frozenset({1, 2, 3, 4})


def test_unknown_arch_is_refused() -> None:
    with pytest.raises(UnsupportedArchitecture):
        allowed_boundaries(make_profile([1] * 3, arch="bert"))


def test_hybrid_windows_pay_for_identity_padding() -> None:
    kinds = ["recurrent", "recurrent", "recurrent", "attention"] * 2
    sizes = [100, 100, 100, 300, 100, 100, 100, 400]
    profile = make_profile(sizes, arch="qwen35moe", kinds=kinds)
    assert padding_layers(profile, 0, 3) == (7,)  # the largest attention layer
    assert padding_layers(profile, 3, 4) == (0,)  # a recurrent one
    assert padding_layers(profile, 2, 4) == ()
    plain = make_profile(sizes)
    assert padding_layers(plain, 0, 3) == ()
    padded = window_cost(profile, 1, 3, n_ctx=10)
    bare = window_cost(plain, 1, 3, n_ctx=10)
    assert padded.weight_bytes == bare.weight_bytes + 400
    assert padded.active_bytes == bare.active_bytes + 200


def test_estimate_rejects_bad_windows() -> None:
    profile = make_profile([1] * 4)
    a, b = dev("a", 9.0), dev("b", 9.0)
    with pytest.raises(WindowError):
        estimate(profile, [(a, 0, 2), (b, 3, 4)])
    with pytest.raises(WindowError):
        estimate(profile, [(a, 0, 2)])
    with pytest.raises(WindowError):
        estimate(profile, [(a, 0, 2), (a, 2, 4)])


# --------------------------------------------------------------------------------------- Qwen3.5-122B-A10B


def test_shipped_qwen_profile() -> None:
    assert "qwen3.5-122b-a10b" in shipped_profiles()
    profile = load_profile("qwen3.5-122b-a10b")
    assert profile.arch == "qwen35moe"
    assert profile.n_layers == 49
    assert profile.n_embd == 3072
    assert 77.0 * GB < profile.total_bytes < 78.2 * GB
    assert all(1.3 * GB < layer.bytes < 1.7 * GB for layer in profile.layers)
    assert sum(layer.kind == "attention" for layer in profile.layers) == 13  # every 4th + the MTP block
    assert profile_from_mapping(profile_to_mapping(profile), source="roundtrip") == profile


def test_qwen_plan_on_the_example_fleet() -> None:
    profile = resolve_model("qwen3.5-122b-a10b")
    devices = load_devices(FLEET)
    assert {d.kind for d in devices} == {"gpu", "cpu", "npu", "phone"}
    manifest = plan(profile, devices)
    check_manifest(manifest, profile)
    assert manifest.est_tokens_per_s > 0
    assert len(manifest.windows) + len(manifest.unused) == len(devices)
    assert all(u.reason for u in manifest.unused)


# -------------------------------------------------------------------------------------------- GGUF profile


def write_gguf(path: Path, arch: str = "qwen35moe", *, tied: bool = False) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_expert_count(4)
    writer.add_expert_used_count(2)
    writer.add_uint32(f"{arch}.ssm.inner_size", 16)
    writer.add_uint32(f"{arch}.ssm.state_size", 4)
    writer.add_uint32(f"{arch}.ssm.group_count", 2)
    writer.add_uint32(f"{arch}.ssm.conv_kernel", 4)
    f32 = np.float32
    writer.add_tensor("token_embd.weight", np.zeros((32, 8), f32))
    writer.add_tensor("output_norm.weight", np.zeros(8, f32))
    if not tied:
        writer.add_tensor("output.weight", np.zeros((32, 8), f32))
    writer.add_tensor("blk.0.ssm_out.weight", np.zeros((8, 16), f32))
    writer.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 8, 8), f32))
    writer.add_tensor("blk.1.attn_q.weight", np.zeros((8, 8), f32))
    writer.add_tensor("blk.1.ffn_up_exps.weight", np.zeros((4, 8, 8), f32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_profile_from_gguf(tmp_path: Path) -> None:
    path = tmp_path / "toy.gguf"
    write_gguf(path)
    profile = profile_from_gguf(path)
    assert profile.arch == "qwen35moe" and profile.n_layers == 2 and profile.n_embd == 8
    assert profile.embd_bytes == profile.head_bytes == 32 * 8 * 4
    assert profile.other_bytes == 8 * 4
    assert not profile.tied_head
    ssm, attn = profile.layers
    assert ssm.kind == "recurrent" and attn.kind == "attention"
    assert ssm.bytes == (8 * 16 + 4 * 8 * 8) * 4
    assert ssm.active_bytes == (8 * 16 + 2 * 8 * 8) * 4  # 2 of 4 experts
    assert attn.kv_bytes_per_token == 1 * (4 + 4) * 2  # 1 KV head, head dim 8/2, f16 K and V
    assert ssm.state_bytes == (16 * 4 + 3 * (16 + 2 * 2 * 4)) * 4
    gguf = pytest.importorskip("gguf")
    reader: Any = gguf.GGUFReader(str(path))
    assert profile.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)


def test_tied_head_is_held_by_both_ends(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    write_gguf(path, "llama", tied=True)
    profile = profile_from_gguf(path)
    assert profile.tied_head and profile.head_bytes == profile.embd_bytes
    assert profile.total_bytes == path.stat().st_size - _data_offset(path)
    whole = window_cost(profile, 0, 2, n_ctx=1)
    first = window_cost(profile, 0, 1, n_ctx=1)
    last = window_cost(profile, 1, 2, n_ctx=1)
    assert whole.weight_bytes == profile.total_bytes  # one copy on a single rank
    assert first.weight_bytes + last.weight_bytes == profile.total_bytes + profile.embd_bytes + profile.other_bytes


def _data_offset(path: Path) -> int:
    gguf = pytest.importorskip("gguf")
    reader: Any = gguf.GGUFReader(str(path))
    return int(reader.data_offset)


def test_bad_gguf_is_a_model_file_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(InputError):
        profile_from_gguf(path)


# ------------------------------------------------------------------------------------------------------ CLI


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Any:
    # Only this module's command: the others may not exist in every checkout.
    monkeypatch.setattr(kvasir.cli, "_COMMAND_MODULES", ("kvasir.commands.plan",))
    return kvasir.cli.main


def test_cli_json(cli: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(FLEET), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["est_tokens_per_s"] > 0
    layers = [w["layers"] for w in doc["windows"]]
    assert layers[0][0] == 0 and layers[-1][1] == 49
    assert all(a[1] == b[0] for a, b in itertools.pairwise(layers))
    assert all({"rank", "device", "layers", "bytes"} <= set(w) for w in doc["windows"])
    assert all(w["key"] is None for w in doc["windows"])  # the slot for each device's `kvasir id` key


def test_device_keys_reach_the_plan(cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvasir.core.identity import Identity

    keys = [Identity.generate().public.to_text() for _ in range(2)]
    devices = tmp_path / "d.toml"
    devices.write_text(
        "".join(
            f'[[device]]\nname = "d{i}"\nkind = "gpu"\nmemory_gb = 80\nmem_bandwidth_gbs = 900\n'
            f'link_latency_ms = 1\nlink_bandwidth_mbps = 1000\nkey = "{k}"\n'
            for i, k in enumerate(keys)
        )
    )
    assert cli(["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(devices), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {w["key"] for w in doc["windows"]} <= set(keys) and doc["windows"][0]["key"] in keys
    devices.write_text(devices.read_text().replace(keys[0], "ed25519:nope"))
    assert cli(["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(devices), "--json"]) == 2


def test_cli_table(cli: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(FLEET)]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "gpu-box" in out


def test_cli_gguf_model(cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "toy.gguf"
    write_gguf(model)
    devices = tmp_path / "d.toml"
    devices.write_text(
        '[[device]]\nname = "a"\nkind = "cpu"\nmemory_gb = 2\nmem_bandwidth_gbs = 50\n'
        "link_latency_ms = 0.5\nlink_bandwidth_mbps = 1000\n"
    )
    assert cli(["plan", "--model", str(model), "--devices", str(devices), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["windows"][0]["layers"] == [0, 2]


GOOD_DEVICE = {
    "name": '"a"',
    "kind": '"gpu"',
    "memory_gb": "8",
    "mem_bandwidth_gbs": "100",
    "link_latency_ms": "1",
    "link_bandwidth_mbps": "10",
}


def device_toml(**fields: str | None) -> str:
    """One [[device]] table: GOOD_DEVICE with fields replaced (None drops the field)."""
    merged = {**GOOD_DEVICE, **fields}
    return "[[device]]\n" + "".join(f"{k} = {v}\n" for k, v in merged.items() if v is not None)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (device_toml(link_bandwidth_mbps=None), "link_bandwidth_mbps"),
        (device_toml(kind='"toaster"'), "kind"),
        (device_toml(memory_gb="-8"), "memory_gb"),
        (device_toml(memory_gb='"lots"'), "memory_gb"),
        (device_toml(hop_overhead_ms="-1"), "hop_overhead_ms"),
        (device_toml(colour='"red"'), "colour"),
        (device_toml() + device_toml(), "twice"),
        ("[[device]\n", "TOML"),
        ("", "no [[device]]"),
    ],
)
def test_cli_bad_devices_file(
    cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, needle: str
) -> None:
    devices = tmp_path / "devices.toml"
    devices.write_text(body)
    assert cli(["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(devices)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


def test_cli_unknown_model_and_no_fit(cli: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["plan", "--model", "no-such-model", "--devices", str(FLEET)]) == 2
    assert "no-such-model" in capsys.readouterr().err
    devices = tmp_path / "small.toml"
    devices.write_text(
        '[[device]]\nname = "p"\nkind = "phone"\nmemory_gb = 8\nmem_bandwidth_gbs = 40\n'
        "link_latency_ms = 5\nlink_bandwidth_mbps = 300\n"
    )
    assert cli(["plan", "--model", "qwen3.5-122b-a10b", "--devices", str(devices)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "short by" in err
