"""Admission by reproduction through the market: a node loads its window, runs the probe the signed record holds for
its kernel class, and serves only when it reproduces it (real market, seeder and node processes on loopback)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from kvasir.core.identity import load_or_create_identity
from kvasir.market.agent.client import MarketClient
from kvasir.market.agent.publish import manifest_record, model_record, parse_windows, publish_signed
from kvasir.market.records import Probe
from kvasir.shard.cache import default_cache_dir
from kvasir.stage.engine import Stage, StageConfig
from kvasir.verify.kernel import stage_kernel_class
from tests.marketutil import Proc, procs, wait_for


def test_a_window_that_does_not_reproduce_its_probe_is_refused(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    model = tiny_model("llama", "q8_0")
    # 0:3 pays more, so the node tries it first; its recorded probe is not what the window computes.
    windows = parse_windows("0:3,3:6", "3,1")
    with procs() as ps:
        operator_path = tmp_path / "operator.pem"
        market = Proc("market", "--listen", "127.0.0.1:0", "--db", str(tmp_path / "m.sqlite"),
                      "--identity", str(operator_path), "--create-identity")  # fmt: skip
        ps.append(market)
        url = market.wait_line(r"listening on (http://\S+)").group(1)
        key = market.wait_line(r"operator (ed25519:\S+)").group(1)
        seeder = Proc("serve-model", str(model), "--listen", "127.0.0.1:0")
        ps.append(seeder)
        source = seeder.wait_line(r"serving (http://\S+)").group(1)

        operator = load_or_create_identity(operator_path)
        record = model_record(model, windows, [source], default_cache_dir(), probes=True)
        first, second = record.stages
        assert len(first.probes) == 1 and first.probes[0].kernel_class.startswith("CPU-")
        with Stage.load(StageConfig(_stage_path(model, 3, 6), n_ctx=256, n_seq_max=1)) as s:
            assert second.probe_map() == {stage_kernel_class(s): second.probes[0].sha256}
        wrong = attrs.evolve(first, probes=(Probe(first.probes[0].kernel_class, "0" * 64),))
        record = attrs.evolve(record, stages=(wrong, second)).signed(operator)

        async def publish() -> None:
            async with MarketClient(url, identity=operator) as client:
                await publish_signed(client, operator, record, manifest_record(record, windows, "explicit"))

        trio.run(publish)
        node = Proc("node", "--market", url, "--market-key", key, "--memory-budget", "1MB", "--lease", "2",
                    "--poll", "0.3", "--seed", "1", "--threads", "1", "--ctx", "256", "--seqs", "1",
                    "--control", str(tmp_path / "n.sock"), "--stage-dir", str(tmp_path / "stages"))  # fmt: skip
        ps.append(node)
        st = node.wait_line(r"^kvasir node: enrolled (.*)$", timeout=120)
        assert '"window": [3, 6]' in st.group(1), st.group(1)
        refused = wait_for(
            lambda: next((line for line in node.err if "does not reproduce the publisher's probe" in line), None),
            10,
            "the refusal in the node's log",
        )
        assert "window 0:3" in refused


def _stage_path(model: Path, a: int, b: int) -> Path:
    from kvasir.shard.cache import stage_files

    return stage_files(model, [(a, b)], default_cache_dir())[0]
