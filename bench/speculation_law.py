"""Speculation against the latency law on an emulated fleet: the oracle drafter (an instrument) at chosen acceptance
rates, then the real drafters (prompt lookup, a draft model) on text that repeats itself and text that does not.

Every node is a ``kvasir node`` process in its own network namespace behind an emulated access link
(tests/harness/fleet.py; ``wan``: 5 ms per access link, a hop 20 ms round trip). Needs root.

Part ``law``: a ring whose last rank drafts with the **oracle** (``--draft-oracle``, kvasir/core/oracle.py: the true
continuation, from this ring's own plain run, each token right with probability α, independently) and
``--draft-policy fixed`` (K drafts every trip: the law's assumption), then the same with ``--draft-policy auto`` (what
a user gets: it stops drafting where drafts fail). Per α, plain and speculative requests interleave, ``--repeats``
of each; the table gives measured tokens/s, tokens per ring trip g (the last rank's counters: emitted tokens over
trips), the law's g = (1-α^(K+1))/(1-α) and its tokens/s = g × plain tokens/s measured in the same run, the
planner's estimate with the verify rows counted (kvasir/planner/speculation.py, with each window's compute per
token measured in this ring as its busy time during the plain runs), and whether every answer equals the plain one.

Part ``drafters``: one ring drafting by prompt lookup, one with ``--draft-model`` (by default the model itself: the
only model with SmolLM2's or Gemma's vocabulary on this machine), ``--draft-policy auto``; plain vs speculative on a
chat answer and prose (text that does not repeat itself) and on code being copied and a paragraph quoted (text that
does). Then what one draft-model proposal of K tokens costs in one process.

    sudo python3 bench/speculation_law.py [--model smol] [--parts law,drafters] [--alphas 0.3,0.5,0.8,0.95]
        [--k 8] [--tokens 64] [--repeats 3] [--nodes 4] [--profile wan]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
if __name__ == "__main__" and sys.path[0] == str(REPO / "bench"):
    sys.path[0] = str(REPO)  # run as a script: tests.harness comes from the checkout

from kvasir.control.client import ControlClient  # noqa: E402
from kvasir.core.oracle import OracleRun, OracleSpec  # noqa: E402
from kvasir.demo import chat_model_path, demo_model_path  # noqa: E402
from kvasir.local.balance import SPLIT_MODES, split_windows  # noqa: E402
from kvasir.local.launcher import LocalRing  # noqa: E402
from kvasir.planner.speculation import accepted_per_trip, estimate_speculation  # noqa: E402
from kvasir.shard.cache import default_cache_dir  # noqa: E402
from kvasir.stage.draftmodel import DraftModel  # noqa: E402
from kvasir.stage.engine import Stage, StageConfig  # noqa: E402
from tests.harness.fleet import PROFILES, FleetNode, fleet, start_fleet_ring  # noqa: E402

#: The oracle's prompt: prose the model continues (no chat template, so its token ids are the plain tokenization).
ORACLE_PROMPT = "The old lighthouse keeper climbed the stairs at dusk and"
REPEATING = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n\n"
    "Copy the three functions above exactly:\n\ndef add(a, b):\n"
)
PARAGRAPH = (
    "The keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote the weather in the log: wind from "
    "the west, a long swell, three fishing boats home before dark and one still out beyond the point."
)
VERBATIM = f"{PARAGRAPH}\n\nThe same paragraph, repeated word for word:\n\n{PARAGRAPH}\n\nAnd once more:\n\nThe keeper"
#: (prompt, through the chat template) per text kind; all greedy.
TEXTS: dict[str, tuple[str, bool]] = {
    "chat answer": ("Explain in a few sentences why the sky is blue.", True),
    "prose": ("Write a short story about a lighthouse keeper who finds a strange map.", True),
    "code copied": (REPEATING, False),
    "verbatim": (VERBATIM, False),
}


def model_path(name: str, cache: Path) -> Path:
    if name == "smol":
        return chat_model_path()
    return demo_model_path(cache) if name == "gemma" else Path(name)


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})" if xs else "–"


@contextlib.contextmanager
def fleet_ring(model: Path, windows: list[tuple[int, int]], profile: str, extra: list[str]) -> Iterator[LocalRing]:
    run_dir = Path(tempfile.mkdtemp(prefix="kvasir-law-"))
    nodes = [FleetNode(f"n{k}", "cpu", PROFILES[profile]) for k in range(len(windows))]
    with fleet(nodes, run_dir) as f:
        ring = start_fleet_ring(f, model, windows, default_cache_dir(), run_dir, threads=1, ctx=1024, extra_args=extra)
        try:
            ring.wait_ready(timeout=300)
            yield ring
        finally:
            ring.stop()


def run_once(sock: Path, prompt: str, tokens: int, k: int, chat: bool) -> tuple[float, list[int]]:
    """Decode tokens/s of one greedy request (first token to last, prefill excluded) and its tokens."""
    out: list[int] = []
    t_first = t_last = 0.0
    with ControlClient(sock, timeout=600) as c:
        for msg in c.generate(prompt=prompt, max_tokens=tokens, speculate=k, temperature=0.0, chat=chat):
            if msg["type"] == "token" and msg["token"] >= 0:
                out.append(msg["token"])
                t_last = time.perf_counter()
                if len(out) == 1:
                    t_first = t_last
            elif msg["type"] == "end" and msg["reason"] == "error":
                raise RuntimeError(msg.get("error"))
    return (len(out) - 1) / (t_last - t_first) if len(out) > 1 else 0.0, out


def status(sock: Path) -> dict[str, Any]:
    with ControlClient(sock, timeout=60) as c:
        doc: dict[str, Any] = c.status()
        return doc


def drafts_between(before: dict[str, Any], after: dict[str, Any]) -> tuple[int, int]:
    """(accepted, drafted) between two last-rank statuses."""
    b, a = before["requests"], after["requests"]
    return a["accepted"] - b["accepted"], a["drafted"] - b["drafted"]


class Pair:
    """Plain and speculative runs of one configuration, interleaved."""

    def __init__(self) -> None:
        self.plain: list[float] = []
        self.spec: list[float] = []
        self.g: list[float] = []
        self.accepted = self.drafted = 0
        self.same = True
        #: Compute ms per token, per node (the stage's busy time): plain runs, speculative runs.
        self.busy: list[list[float]] = []
        self.busy_spec: list[list[float]] = []
        #: Σ over nodes of compute and worker-thread hand-offs, ms per token: plain, speculative.
        self.cpu: list[float] = []
        self.cpu_spec: list[float] = []

    @staticmethod
    def _timed(ring: LocalRing, prompt: str, tokens: int, k: int, chat: bool) -> tuple[float, list[int], Any]:
        before = [status(s) for s in ring.sockets]
        rate, out = run_once(ring.sockets[0], prompt, tokens, k, chat)
        after = [status(s) for s in ring.sockets]
        n = max(1, len(out))
        busy = [(a["busy_s"] - b["busy_s"]) * 1e3 / n for a, b in zip(after, before, strict=True)]
        cpu = sum(
            (a["busy_s"] + a["handoff_s"] - b["busy_s"] - b["handoff_s"]) * 1e3 / n
            for a, b in zip(after, before, strict=True)
        )
        return rate, out, (busy, cpu, before[-1], after[-1])

    def run(self, ring: LocalRing, prompt: str, tokens: int, k: int, chat: bool) -> None:
        p, plain_tokens, (busy, cpu, _, _) = self._timed(ring, prompt, tokens, 0, chat)
        self.busy.append(busy)
        self.cpu.append(cpu)
        s, spec_tokens, (busy, cpu, s0, s1) = self._timed(ring, prompt, tokens, k, chat)
        self.busy_spec.append(busy)
        self.cpu_spec.append(cpu)
        accepted, drafted = drafts_between(s0, s1)
        # Each decode trip emits its accepted drafts and one sampled token (the first token is the prefill's).
        decoded = len(spec_tokens) - 1
        self.plain.append(p)
        self.spec.append(s)
        self.g.append(decoded / (decoded - accepted) if decoded > accepted else 0.0)
        self.accepted += accepted
        self.drafted += drafted
        self.same = self.same and plain_tokens == spec_tokens

    def ratios(self) -> list[float]:
        return [s / p for s, p in zip(self.spec, self.plain, strict=True) if p > 0]

    def window_ms(self, spec: bool = False) -> list[float]:
        return [statistics.median(col) for col in zip(*(self.busy_spec if spec else self.busy), strict=True)]

    def cpu_cell(self) -> str:
        return f"{statistics.median(self.cpu):.1f} / {statistics.median(self.cpu_spec):.1f}"


def part_law(console: Console, model: Path, windows: list[tuple[int, int]], args: argparse.Namespace) -> None:
    alphas = [float(a) for a in args.alphas.split(",")]
    with Stage.load(StageConfig(model, n_ctx=256, n_seq_max=1, n_threads=1)) as stage:
        prompt_ids = tuple(stage.vocab.tokenize(ORACLE_PROMPT))
    oracle = Path(tempfile.mkdtemp(prefix="kvasir-oracle-")) / "oracle.json"
    for policy in args.policies.split(","):
        oracle.write_text(json.dumps(OracleSpec(0.0, args.seed, ()).to_wire()))
        extra = ["--draft-oracle", str(oracle), "--draft-policy", policy]
        table = Table(
            title=f"ORACLE drafter (an instrument), --draft-policy {policy}, K={args.k}, {len(windows)} nodes on "
            f"emulated {args.profile}, {args.tokens} tokens, {args.repeats} interleaved repeats: median (min–max)"
        )
        cols = ("α", "plain tok/s", "oracle tok/s", "ratio", "g measured", "g law", "law tok/s", "measured/law")
        for col in (*cols, "est. with rows", "measured/est.", "acceptance", "busy ms/token plain / spec", "same"):
            table.add_column(col, justify="right")
        with fleet_ring(model, windows, args.profile, extra) as ring:
            _, truth = run_once(ring.sockets[0], ORACLE_PROMPT, args.tokens, 0, False)  # warm-up and the truth
            for alpha in alphas:
                pair = Pair()
                for r in range(args.repeats):  # other coins each repeat: g's spread is the sampling's
                    spec = OracleSpec(alpha, args.seed + r, (OracleRun(prompt_ids, tuple(truth)),))
                    oracle.write_text(json.dumps(spec.to_wire()))
                    pair.run(ring, ORACLE_PROMPT, args.tokens, args.k, False)
                plain = statistics.median(pair.plain)
                measured = statistics.median(pair.spec)
                g_law = accepted_per_trip(alpha, args.k)
                law = g_law * plain
                # The planner's estimate with the rows: each window's measured compute per token, the rest of the
                # plain trip taken as the links (hops and per-frame costs).
                window_ms = pair.window_ms()
                link_ms = max(0.0, 1e3 / plain - sum(window_ms))
                est = estimate_speculation(alpha, window_ms, link_ms, args.k).tokens_per_s
                table.add_row(
                    f"{alpha:g}",
                    spread(pair.plain),
                    spread(pair.spec),
                    spread(pair.ratios(), "{:.2f}x"),
                    spread(pair.g, "{:.2f}"),
                    f"{g_law:.2f}",
                    f"{law:.1f}",
                    f"{measured / law:.0%}",
                    f"{est:.1f}",
                    f"{measured / est:.0%}",
                    f"{pair.accepted}/{pair.drafted}",
                    pair.cpu_cell(),
                    "yes" if pair.same else "NO",
                )
                console.print(
                    f"  {policy} α={alpha:g}: compute per token at each node (ms, median), plain: "
                    + ", ".join(f"{ms:.2f}" for ms in window_ms)
                    + "; speculative: "
                    + ", ".join(f"{ms:.2f}" for ms in pair.window_ms(spec=True))
                    + f"; the plain trip's links and per-frame costs {link_ms:.1f} ms"
                )
        console.print(table)


def part_drafters(console: Console, model: Path, windows: list[tuple[int, int]], args: argparse.Namespace) -> None:
    draft = Path(args.draft_model) if args.draft_model else model
    table = Table(
        title=f"drafters, --draft-policy auto, K={args.k}, {len(windows)} nodes on emulated {args.profile}, "
        f"{args.tokens} greedy tokens, {args.repeats} interleaved repeats: median (min–max)"
    )
    for col in ("drafter", "text", "plain tok/s", "spec tok/s", "ratio", "g", "acceptance", "busy ms/token", "same"):
        table.add_column(col, justify="right")
    rings: dict[str, list[str]] = {"prompt lookup": [], f"draft model ({draft.name})": ["--draft-model", str(draft)]}
    chosen = {"lookup": "prompt lookup", "model": f"draft model ({draft.name})"}
    for name, extra in ((chosen[d], rings[chosen[d]]) for d in args.drafters.split(",")):
        with fleet_ring(model, windows, args.profile, extra) as ring:
            run_once(ring.sockets[0], "Hello", 8, 0, False)  # warm-up
            for kind in args.texts.split(","):
                prompt, chat = TEXTS[kind]
                pair = Pair()
                for _ in range(args.repeats):
                    pair.run(ring, prompt, args.tokens, args.k, chat)
                table.add_row(
                    name,
                    kind,
                    spread(pair.plain),
                    spread(pair.spec),
                    spread(pair.ratios(), "{:.2f}x"),
                    spread(pair.g, "{:.2f}"),
                    f"{pair.accepted}/{pair.drafted} ({pair.accepted / pair.drafted:.0%})" if pair.drafted else "none",
                    pair.cpu_cell(),
                    "yes" if pair.same else "NO",
                )
    console.print(table)
    if "model" not in args.drafters.split(","):
        return
    with Stage.load(StageConfig(model, n_ctx=1024, n_seq_max=1, n_threads=1)) as stage:
        vocab = stage.vocab
        prose = vocab.tokenize(TEXTS["prose"][0])
        dm = DraftModel.load(draft, vocab, n_ctx=1024, n_threads=1)
        try:
            source = dm.source(prose, 0)
            source.propose(args.k)  # the prompt's prefill
            costs = []
            for _ in range(7):
                t0 = time.perf_counter()
                drafts = source.propose(args.k)
                costs.append((time.perf_counter() - t0) * 1e3)
                source.emitted(drafts[0])  # one more token of history each time, as after a step
        finally:
            dm.close()
    console.print(
        f"draft model {draft.name}: one proposal of {args.k} tokens (after one new token) "
        f"{spread(costs)} ms in one process, 1 thread"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smol", help="smol, gemma or a GGUF path")
    ap.add_argument("--parts", default="law,drafters")
    ap.add_argument("--alphas", default="0.3,0.5,0.8,0.95")
    ap.add_argument("--policies", default="fixed,auto", help="the oracle rings' --draft-policy, comma-separated")
    ap.add_argument("--texts", default=",".join(TEXTS), help=f"comma-separated: {', '.join(TEXTS)}")
    ap.add_argument("--draft-model", default=None, help="the draft model (default: the model itself)")
    ap.add_argument("--drafters", default="lookup,model", help="the drafters part's rings: lookup, model")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="wan")
    ap.add_argument("--split", choices=SPLIT_MODES, default="even")
    ap.add_argument("--seed", type=int, default=1, help="the oracle's coins (repeat r uses seed + r)")
    args = ap.parse_args()
    cache = default_cache_dir()
    model = model_path(args.model, cache)
    windows = [(a, b) for a, b in split_windows(model, cache, args.nodes, split=args.split, threads=1)]
    console = Console(width=200)
    console.print(f"{model.name}: layers {' '.join(f'{a}:{b}' for a, b in windows)}")
    parts = args.parts.split(",")
    if "law" in parts:
        part_law(console, model, windows, args)
    if "drafters" in parts:
        part_drafters(console, model, windows, args)


if __name__ == "__main__":
    main()
