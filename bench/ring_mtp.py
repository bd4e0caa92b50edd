"""A ring drafting with the model's MTP block (``--draft-mtp``): the last rank's drafting cost against its window.

Four in-process nodes (real windows, links on memory streams, one process: no network cost) serve the synthetic
Qwen3.5-122B-A10B shape of ``bench/mtp_draft.py`` cut for a 4-node ring; the last rank drafts with the MTP block
through the drafter interface (``kvasir.stage.mtpsource``, ``--draft-policy fixed``: K drafts every step). Per K:
ring wall ms per token, the last rank's window ms per token and MTP ms per token and per drafted token (wall and
CPU of the computing thread), drafts and acceptance, and whether greedy and seeded answers equal plain ``generate``.
Random weights: acceptance says nothing about a real model; the costs and the exactness are the measurements.

    python3 bench/ring_mtp.py [--tokens 48] [--ks 1,2,4]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from rich.console import Console
from rich.table import Table

from kvasir.core.sampling import SamplingParams
from kvasir.ring.manifest import Manifest, RankEntry
from kvasir.ring.node import NodeConfig, open_node
from kvasir.ring.requests import EndEvent, TokenEvent
from kvasir.shard.cache import default_cache_dir, stage_files
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.mtpsource import MtpSources
from kvasir.stage.pipeline import LocalPipeline
from kvasir.testing.fakestage import MemoryNetwork
from kvasir.testing.tinymodels import tiny_model_cached

if TYPE_CHECKING:  # mypy reads bench/ as a package; run as a script, this file's folder is on sys.path
    from bench.mtp_draft import PROMPT, SHAPE, WINDOWS  # bench/mtp_draft.py's model, windows and prompt
else:
    from mtp_draft import PROMPT, SHAPE, WINDOWS


async def ring_run(
    paths: list[Path], k: int, prompt: list[int], params: list[SamplingParams], n: int
) -> dict[str, Any]:
    net = MemoryNetwork()
    async with contextlib.AsyncExitStack() as stack:
        stages = []
        for i, path in enumerate(paths):
            is_last = i == len(paths) - 1
            cfg = StageConfig(
                path, n_ctx=512, n_seq_max=2, n_threads=1, mtp=k > 0 and is_last, rollback=0 if is_last else k + 1
            )
            stage = await trio.to_thread.run_sync(Stage.load, cfg)
            stack.callback(stage.close)
            stages.append(stage)
        sha = stages[0].info.model_sha256
        assert sha is not None
        ranks = tuple(RankEntry(r, a, b, "mem", net.port()) for r, (a, b) in enumerate(WINDOWS))
        manifest = Manifest(sha, WINDOWS[-1][1], ranks, model_name="qwen35moe")
        mtp = MtpSources(stages[-1]) if k else None
        if mtp is not None:
            stack.callback(mtp.close)
        nodes = []
        for r in range(len(WINDOWS)):
            extra: dict[str, Any] = {}
            if r == len(WINDOWS) - 1 and mtp is not None:
                extra = {"draft_sources": mtp, "draft_policy": "fixed"}
            config = NodeConfig(manifest, r, node_id=f"node{r}", speculate=k, **extra)
            nodes.append(await stack.enter_async_context(open_node(config, stages[r], transport=net)))
        while not all(node.ready for node in nodes):  # noqa: ASYNC110 (node state has no event to wait on)
            await trio.sleep(0.05)
        last = stages[-1]
        busy0 = last.busy_s
        t0 = time.perf_counter()
        answers = []
        for sampling in params:
            tokens: list[int] = []
            async with (
                nodes[0].request(prompt, sampling, n) as handle,
                contextlib.aclosing(nodes[0].events(handle)) as events,
            ):
                async for ev in events:
                    if isinstance(ev, TokenEvent) and ev.token >= 0:
                        tokens.append(ev.token)
                    elif isinstance(ev, EndEvent):
                        assert ev.error is None, ev
                        break
            answers.append(tokens)
        wall = time.perf_counter() - t0
        spec = nodes[-1].status().requests
        return {
            "answers": answers,
            "wall_s": wall,
            "last_busy_s": last.busy_s - busy0,
            "mtp_s": mtp.head.busy_s if mtp else 0.0,
            "mtp_cpu_s": mtp.head.cpu_s if mtp else 0.0,
            "drafted": spec.drafted,
            "accepted": spec.accepted,
        }


def main() -> None:
    logging.getLogger("kvasir").setLevel(logging.ERROR)  # the links closing at each ring's end are no news
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--vocab", type=int, default=12288)
    args = ap.parse_args()
    cache = default_cache_dir()
    model = tiny_model_cached(cache / "tiny", "qwen35moe", n_vocab=args.vocab, **SHAPE)
    paths = stage_files(model, WINDOWS, cache)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5)]
    with Stage.load(StageConfig(model, n_ctx=512, n_seq_max=1, n_threads=1)) as whole:
        prompt = whole.vocab.tokenize(PROMPT, add_special=True)
        want = [LocalPipeline([whole]).generate(prompt, p, args.tokens).tokens for p in params]
    table = Table(title=f"A 4-node in-process ring drafting with MTP ({model.name}, windows {WINDOWS})")
    for col in (
        "K",
        "ring ms/token",
        "last rank ms/token (window + MTP)",
        "MTP ms/token",
        "MTP ms/drafted (CPU)",
        "drafted",
        "accepted",
        "greedy = plain",
        "seeded = plain",
    ):
        table.add_column(col, justify="right")
    for k in [0, *(int(x) for x in args.ks.split(","))]:
        r = trio.run(ring_run, paths, k, prompt, params, args.tokens)
        n = sum(len(a) for a in r["answers"])
        d = max(1, r["drafted"])
        table.add_row(
            str(k),
            f"{1e3 * r['wall_s'] / n:.2f}",
            f"{1e3 * r['last_busy_s'] / n:.2f}",
            f"{1e3 * r['mtp_s'] / n:.2f}",
            f"{1e3 * r['mtp_s'] / d:.2f} ({1e3 * r['mtp_cpu_s'] / d:.2f})" if k else "-",
            str(r["drafted"]),
            str(r["accepted"]),
            "yes" if r["answers"][0] == want[0] else "NO",
            "yes" if r["answers"][1] == want[1] else "NO",
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
