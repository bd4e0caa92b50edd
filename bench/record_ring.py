"""What recording costs a real ring: tokens/s of 3-process rings with and without ``--record`` (receipts and the
input spool), alternating within one run, then the audit key revealed at a fraction f over what was recorded.

Each repeat starts a ring without recording and one with it (in alternating order), warms each with one request,
then times ``--requests`` greedy requests of a ~150-token prompt and ``--tokens`` decode steps through rank 0's
control socket: decode tokens/s (first to last token) and end-to-end tokens/s (generated tokens over the request's
wall time, prefill included). Then ``reveal`` runs with a fresh key at ``--fraction`` over the record directory, and
every selected window is re-executed on a separately loaded copy of its window (CPU seconds, 1 thread).

    python3 bench/record_ring.py [--model PATH] [--repeats 3] [--requests 4] [--tokens 32] [--fraction 0.02]

``--part micro`` times only the recorder itself (process CPU seconds per request, no ring): the calls a node makes
for a request of 150 prompt tokens (64-token chunks) and ``--tokens`` decode steps on Gemma 3 270M's shapes (640-wide
boundaries, a 262,144-entry logits row), then signing and writing the receipt and log.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvasir.control.client import ControlClient
from kvasir.demo import demo_model_path
from kvasir.local.launcher import start_ring
from kvasir.shard.cache import default_cache_dir, even_splits, stage_files
from kvasir.shard.gguf_file import describe
from kvasir.verify.audit import WindowLog, audit_window, read_json
from kvasir.verify.select import new_key, reveal

PROMPT = (
    "A ring of devices runs one language model: each node holds a contiguous window of layers, takes the hidden "
    "state from its predecessor, runs its layers and passes the boundary on; the last node samples a token and "
    "sends it back to the first. Every node signs what it received and what it sent, so that an auditor holding "
    "the same window can re-run one request and compare bytes. Write a short story about such a ring, in which "
    "one node is tempted to skip a layer to earn more, and what happens when the auditor comes."
)


def one_request(sock: Path, tokens: int) -> tuple[float, float]:
    """(decode tokens/s, end-to-end tokens/s) of one greedy request."""
    t0 = time.perf_counter()
    first = last = 0.0
    n = 0
    with ControlClient(sock, timeout=600) as c:
        for msg in c.generate(prompt=PROMPT, max_tokens=tokens, temperature=0.0):
            if msg["type"] == "token" and msg["token"] >= 0:
                n += 1
                last = time.perf_counter()
                if n == 1:
                    first = last
    return (n - 1) / (last - first), n / (last - t0)


def run_ring(
    model: Path, windows: list[tuple[int, int]], record: Path | None, n: int, tokens: int
) -> list[tuple[float, float]]:
    extra = ("--record", str(record)) if record is not None else ()
    ring = start_ring(model, windows, default_cache_dir(), threads=1, ctx=1024, seqs=2, extra_args=extra)
    try:
        ring.wait_ready(timeout=300)
        one_request(ring.sockets[0], 4)  # warm-up
        return [one_request(ring.sockets[0], tokens) for _ in range(n)]
    finally:
        ring.stop()


def micro(tokens: int, repeats: int, n_embd: int = 640, n_vocab: int = 262_144) -> None:
    import numpy as np

    from kvasir.core.identity import Identity
    from kvasir.core.sampling import SamplingParams
    from kvasir.ring.record import NodeRecorder
    from kvasir.verify.commit import TOKENS

    rng = np.random.default_rng(0)
    steps = [(0, 64), (64, 64), (128, 22)] + [(150 + i, 1) for i in range(tokens)]
    logits = rng.standard_normal(n_vocab, dtype=np.float32).tobytes()
    identity = Identity.generate()
    for kind in ("first", "middle", "last"):
        hot, total = [], []
        with tempfile.TemporaryDirectory() as tmp:
            rec = NodeRecorder(Path(tmp), identity, "ab" * 32, (0, 6), "CPU-0")
            for r in range(repeats):
                frames = [rng.standard_normal((n, n_embd), dtype=np.float32).tobytes() for _, n in steps]
                t0 = time.process_time()
                rec.begin(r, last=kind == "last", sampling=SamplingParams.GREEDY, history=())
                for (pos, n), payload in zip(steps, frames, strict=True):
                    if kind == "first":
                        rec.on_input(r, pos, n, TOKENS, bytes(4 * n))
                    else:
                        rec.on_input(r, pos, n, 0, payload)
                    if kind == "last":
                        rec.on_sample(r, pos, n, logits, 7 if pos >= 128 else None)
                    else:
                        rec.on_output(r, pos, n, 0, payload)
                t1 = time.process_time()
                done = rec.end(r)
                assert done is not None
                rec.write(done)
                hot.append((t1 - t0) * 1e3)
                total.append((time.process_time() - t0) * 1e3)
        print(f"{kind} window: hashing {spread(hot)} ms/request, with signing and writing {spread(total)} ms/request")


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fraction", type=float, default=0.02)
    ap.add_argument("--part", choices=("ring", "micro"), default="ring")
    args = ap.parse_args()
    if args.part == "micro":
        micro(args.tokens, max(args.repeats, 5))
        return
    model = args.model or demo_model_path(default_cache_dir())
    windows = even_splits(describe(model).n_layer, 3)
    record = Path(tempfile.mkdtemp(prefix="kvasir-record-"))
    results: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
    medians: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.repeats):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            got = run_ring(model, windows, record if mode == "on" else None, args.requests, args.tokens)
            results[mode] += got
            medians[mode].append(statistics.median(e for _, e in got))
            print(f"repeat {r} {mode}: decode tok/s {spread([d for d, _ in got])}, "
                  f"end-to-end tok/s {spread([e for _, e in got])}", flush=True)  # fmt: skip
    for mode in ("off", "on"):
        d = [x for x, _ in results[mode]]
        e = [x for _, x in results[mode]]
        print(f"recording {mode}: decode tok/s {spread(d)}, end-to-end tok/s {spread(e)} over {len(d)} requests")
    ratios = [on / off for on, off in zip(medians["on"], medians["off"], strict=True)]
    print(f"end-to-end on/off per repeat: {', '.join(f'{x:.3f}' for x in ratios)}")
    pending = sorted((record / "pending").glob("*.log.json"))
    receipts = sorted((record / "receipts").glob("*.json"))
    sizes = {w: [p.stat().st_size for p in pending if p.name.endswith(f"-{w[0]}-{w[1]}.log.json")] for w in windows}
    print(f"{len(receipts)} receipts (median {statistics.median(p.stat().st_size for p in receipts) / 1024:.1f} KiB);"
          " spooled inputs per request: " + ", ".join(f"{a}:{b} {statistics.median(s) / 1024:.0f} KiB"
                                                      for (a, b), s in sizes.items()))  # fmt: skip
    t0 = time.perf_counter()
    done = reveal(record, new_key(), args.fraction)
    print(f"reveal at f = {args.fraction}: {len(done.selected)} selected, {done.dropped} dropped, "
          f"{len(done.broken_links)} broken links, in {time.perf_counter() - t0:.3f} s")  # fmt: skip
    files = stage_files(model, windows, default_cache_dir())
    for path in done.selected:
        log = WindowLog.from_wire(read_json(path))
        t0 = time.process_time()
        result = audit_window(files[windows.index((log.receipt.start, log.receipt.end))], log.inputs, log.receipt)
        print(f"audit {path.name}: {'ok' if result.ok else 'MISMATCH'} in {time.process_time() - t0:.2f} CPU s")
    print(f"record directory: {record}")


if __name__ == "__main__":
    main()
