"""``kvasir ring up [MODEL.gguf] [--stages N [--split balanced|even] | --splits ...] [--prompt TEXT ...]``: a whole
ring on this machine."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import attrs

from kvasir.api.server import ApiAccess
from kvasir.commands.common import (
    add_batch_arg,
    add_model_arg,
    add_speculate_arg,
    add_text_args,
    model_windows,
    print_json,
    sampling_from_args,
)
from kvasir.commands.config import fill_from_config
from kvasir.control.client import ControlClient
from kvasir.control.paths import find_socket
from kvasir.core.errors import InputError, RingError
from kvasir.core.sampling import SamplingParams
from kvasir.local.front import Front, FrontThread
from kvasir.local.launcher import LocalRing, Supervisor, default_threads, remove_run_dir, start_ring
from kvasir.local.preflight import check_api_key_file, check_port_free
from kvasir.shard.cache import default_cache_dir, even_splits, model_sha256, stage_files

#: Where the API front listens (loopback, as `kvasir node --api-host`'s default).
API_HOST = "127.0.0.1"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ring", help="run a ring of node processes on this machine")
    ring_sub = p.add_subparsers(dest="ring_command", required=True, metavar="ACTION")
    up = ring_sub.add_parser("up", help="start N nodes, wait for the ring, answer a prompt or keep serving")
    add_model_arg(up, optional=True)
    g = up.add_mutually_exclusive_group()
    g.add_argument("--stages", type=int, default=3, help="number of nodes (default 3)")
    g.add_argument("--splits", help="layer cuts, e.g. 0,6,12,18")
    up.add_argument(
        "--split",
        choices=("balanced", "even"),
        default="balanced",
        help="how --stages cuts the layers: balanced by measured stage cost, head and embedding included (default), "
        "or even layer counts",
    )
    up.add_argument(
        "--no-calibrate",
        dest="calibrate",
        action="store_false",
        help="balance by the byte estimate instead of timing the model's stages on this machine (cached per model)",
    )
    up.add_argument(
        "--recalibrate",
        action="store_true",
        help="time the stages again instead of reading the cached costs (after a hardware change or a noisy first run)",
    )
    add_text_args(
        up,
        prompt_required=False,
        prompt_help="answer this prompt, print the result and stop the ring",
        json_help="print one JSON object (like `kvasir generate --json`)",
    )
    up.add_argument(
        "--api-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible API here; every node is an entry behind it (a node that dies costs only "
        "the streams that entered there)",
    )
    up.add_argument(
        "--api-key-file", type=Path, default=None, metavar="FILE", help="bearer keys the API requires (mode 0600)"
    )
    up.add_argument("--relay", action="store_true", help="start a local relay and send every link through it")
    up.add_argument(
        "--standby",
        action="store_true",
        help="also run one standby node per rank (loaded, idle): a window that dies comes back from it at once",
    )
    up.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="every node writes signed receipts of its requests (and spools their inputs for audits) into DIR",
    )
    up.add_argument("--seqs", type=int, default=8, help="concurrent requests per node")
    add_speculate_arg(up, "every request (the nodes' default)")
    add_batch_arg(up)
    up.add_argument("--gpu-layers", type=int, default=None, help="layers on the GPU per node (-1 all; default 0)")
    up.add_argument(
        "--max-restart-delay",
        type=seconds,
        default=30.0,
        metavar="S",
        help="a node that keeps dying is restarted at once, then after 0.5 s, doubling up to S seconds between tries "
        "(default 30); it is never given up on, and the other nodes keep serving",
    )
    up.set_defaults(run=run_up)


def seconds(text: str) -> float:
    """``--max-restart-delay``'s value (argparse names the function in its "invalid seconds value" error)."""
    value = float(text)
    if not 0.5 <= value <= 3600:
        raise argparse.ArgumentTypeError("must be in [0.5, 3600] seconds")
    return value


def run_up(args: argparse.Namespace) -> int:
    fill_from_config(args, ["threads", "gpu_layers", "api_key_file"])  # unset flags: environment, config.toml
    params = sampling_from_args(args)
    # A serving ring is for the TUI's chat pane and the API: an instruction-tuned model by default.
    chat = args.chat or args.prompt is None
    model, windows = model_windows(args, lambda n_main: even_splits(n_main, args.stages), chat=chat)
    if len(windows) < 2:
        raise InputError("a ring needs at least 2 stages (for one stage use `kvasir generate`)")
    # Before the split cuts anything and before any node starts: what a node would refuse, each as one line.
    if args.api_port is not None:
        check_port_free(API_HOST, args.api_port, "--api-port")
        if args.api_key_file is not None:
            check_api_key_file(args.api_key_file)
    threads = args.threads or default_threads(len(windows))
    cache = default_cache_dir()
    with _stop_signals() as stopper:
        try:
            stopper.arm()
            # The slow part, before any process exists: a signal stops it at once (all cached, written atomically).
            if args.splits is None and args.split == "balanced":
                from kvasir.local.balance import split_windows  # lazy: loads llama.cpp to calibrate

                windows = split_windows(
                    model,
                    cache,
                    args.stages,
                    calibrate=args.calibrate,
                    recalibrate=args.recalibrate,
                    threads=threads,
                    gpu_layers=args.gpu_layers or 0,
                )
                print("balanced split: layers " + " ".join(f"{a}:{b}" for a, b in windows), file=sys.stderr)
            stage_files(model, windows, cache)
            model_sha256(model, cache)
            stopper.defer()  # processes start next: a signal now waits until the ring exists to stop it
        except _Stopped as stop:
            return 128 + stop.signum
        # Its own directory for this run (the nodes' keys, manifest and logs), removed when it ends: with the logs
        # kept only if something failed, to read why.
        run_dir = Path(tempfile.mkdtemp(prefix="kvasir-ring-"))
        outcome = _Outcome()
        try:
            return _start_and_run(args, model, windows, cache, threads, params, run_dir, stopper, outcome)
        finally:
            remove_run_dir(run_dir, keep_logs=outcome.keep_logs)
            if outcome.keep_logs:
                with contextlib.suppress(OSError):
                    print(f"ring up: {outcome.why}; the nodes' logs are kept in {run_dir}", file=sys.stderr)


@attrs.define
class _Outcome:
    """How a ``ring up`` run ended, for what is left of its run directory."""

    clean: bool = False
    supervisor: Supervisor | None = None
    front: FrontThread | None = None

    @property
    def keep_logs(self) -> bool:
        return not self.clean or (self.supervisor is not None and self.supervisor.deaths > 0)

    @property
    def why(self) -> str:
        if not self.clean:
            return "the ring failed"
        return "a node died during the run"


def _start_and_run(
    args: argparse.Namespace,
    model: Path,
    windows: list[tuple[int, int]],
    cache: Path,
    threads: int,
    params: SamplingParams,
    run_dir: Path,
    stopper: _Stopper,
    outcome: _Outcome,
) -> int:
    ring = start_ring(
        model,
        windows,
        cache,
        run_dir=run_dir,
        entries=args.api_port is not None and args.prompt is None,
        threads=threads,
        ctx=args.ctx,
        seqs=args.seqs,
        relay=args.relay,
        standby=args.standby,
        default_control=args.prompt is None,
        supervised=args.prompt is None,
        tied=True,
        extra_args=(
            *(("--gpu-layers", str(args.gpu_layers)) if args.gpu_layers else ()),
            *(("--record", str(args.record.resolve())) if args.record is not None else ()),
            *(("--speculate", str(args.speculate)) if args.speculate else ()),
            *(("--draft-policy", args.draft_policy) if args.draft_policy != "auto" else ()),
            *(("--draft-model", str(args.draft_model.resolve())) if args.draft_model is not None else ()),
            *(("--draft-oracle", str(args.draft_oracle.resolve())) if args.draft_oracle is not None else ()),
            *(("--draft-mtp",) if args.draft_mtp else ()),
            *(("--batch", str(args.batch)) if args.batch > 1 else ()),
        ),
    )
    try:
        stopper.arm()
        code = _run(ring, args, windows, params, outcome)
        outcome.clean = True
        return code
    except _Stopped as stop:
        outcome.clean = True
        with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
            print(f"{stop.name}: stopping the ring", file=sys.stderr)
        # Stopping a serving ring is its normal end (systemd, tmux); an interrupted prompt is not.
        return 0 if args.prompt is None else 128 + stop.signum
    finally:
        stopper.disarm()  # a second signal must not cut the cleanup short
        if outcome.front is not None:
            outcome.front.front.closing = True  # the nodes' last error replies go out as they are, not retried
        ring.stop()
        if outcome.front is not None:
            outcome.front.stop()


class _Stopped(BaseException):
    """A stop signal arrived (BaseException, like KeyboardInterrupt: no ``except Exception`` may swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


class _Stopper:
    """Turns SIGTERM/SIGHUP/SIGINT into :class:`_Stopped` while armed. Deferred, it only remembers the first one and
    raises it at :meth:`arm`: a signal that arrives while processes are being started cannot orphan any of them."""

    def __init__(self) -> None:
        self.armed = False
        self.closed = False
        self.pending: int | None = None

    def handle(self, signum: int, _frame: object) -> None:
        if self.armed:
            self.armed = False
            raise _Stopped(signum)
        if self.pending is None and not self.closed:
            self.pending = signum

    def arm(self) -> None:
        self.armed = not self.closed
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.handle(pending, None)

    def defer(self) -> None:
        self.armed = False

    def disarm(self) -> None:
        """For good: the ring is being stopped, further signals change nothing."""
        self.armed = False
        self.closed = True
        self.pending = None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def _stop_signals() -> Iterator[_Stopper]:
    stopper = _Stopper()
    previous = {s: signal.signal(s, stopper.handle) for s in STOP_SIGNALS}
    try:
        yield stopper
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _run(
    ring: LocalRing, args: argparse.Namespace, windows: list[tuple[int, int]], params: SamplingParams, outcome: _Outcome
) -> int:
    ring.wait_ready()
    if args.prompt is None:
        if args.api_port is not None:
            outcome.front = start_front(ring, args.api_port, args.api_key_file)
        outcome.supervisor = Supervisor(ring, max_delay_s=args.max_restart_delay)
        return _serve_forever(ring, args, outcome.supervisor)
    # The prompt's answer streams from a worker thread while this one supervises the ring, as `ring up` serving
    # does: a node that dies mid-answer is restarted and the ring replays the request into it (same text). Nodes
    # are started from the main thread only (PR_SET_PDEATHSIG is per thread).
    outcome.supervisor = supervisor = Supervisor(ring, max_delay_s=args.max_restart_delay)
    answer: list[_Answer] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            answer.append(_ask(ring, args, params))
        except BaseException as exc:  # handed to the main thread, which raises it
            failed.append(exc)

    worker = threading.Thread(target=work, name="kvasir-ring-prompt", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.2)
        for note in supervisor.check():
            with contextlib.suppress(OSError):
                print(note, file=sys.stderr, flush=True)
    if failed:
        raise failed[0]
    tokens, text, end, t0, t_first, t_last = answer[0]
    if end.get("reason") == "error":
        raise RingError(f"request failed: {end.get('error')}")
    steps = max(len(tokens) - 1, 0)
    result = {
        "tokens": tokens,
        "text": end.get("text", text),
        "prompt_tokens": end.get("prompt_tokens"),
        "stop_reason": end.get("reason"),
        "prefill_ms": round((t_first - t0) * 1e3, 3),
        "decode_ms_per_token": round((t_last - t_first) * 1e3 / steps, 3) if steps else 0.0,
        "stages": len(windows),
    }
    if args.json:
        print_json(result)
    else:
        sys.stdout.write("\n")
        print(
            f"[{len(tokens)} tokens through {len(windows)} nodes, decode {result['decode_ms_per_token']} ms/token]",
            file=sys.stderr,
        )
    return 0


#: What the prompt's answer was: its tokens, its text, the end message, and when it was sent, its first and last token.
_Answer = tuple[list[int], str, dict[str, Any], float, float, float]


def _ask(ring: LocalRing, args: argparse.Namespace, params: SamplingParams) -> _Answer:
    """The prompt through rank 0's control socket, its text streamed to stdout (unless ``--json``)."""
    with ControlClient(ring.sockets[0], timeout=600) as client:
        tokens: list[int] = []
        text = ""
        t0 = time.perf_counter()
        t_first = t_last = t0
        end: dict[str, Any] = {}
        for msg in client.generate(
            prompt=args.prompt,
            chat=args.chat,
            max_tokens=args.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            repeat_penalty=params.repeat_penalty,
            seed=params.seed,
            stop=args.stop,
        ):
            if msg["type"] == "token":
                if msg["token"] >= 0:
                    tokens.append(msg["token"])
                    t_last = time.perf_counter()
                    if len(tokens) == 1:
                        t_first = t_last
                text += msg["text"]
                if not args.json:
                    sys.stdout.write(msg["text"])
                    sys.stdout.flush()
            elif msg["type"] == "end":
                end = msg
    return tokens, text, end, t0, t_first, t_last


def start_front(ring: LocalRing, port: int, key_file: Path | None) -> FrontThread:
    """The API front on ``port``, every node of ``ring`` an entry behind it (kvasir.local.front)."""
    assert ring.entry_key is not None
    access = ApiAccess() if key_file is None else ApiAccess.from_key_file(key_file)
    thread = FrontThread(Front(ring.entries(), ring.entry_key, access, host=API_HOST), port)
    try:
        thread.start()
    except OSError as exc:  # taken since the preflight check
        raise InputError(f"--api-port: {exc.strerror or exc}") from None
    return thread


def _serve_forever(ring: LocalRing, args: argparse.Namespace, supervisor: Supervisor) -> NoReturn:
    """Serve until a stop signal (raised as :class:`_Stopped` in here); a node that dies is restarted, however often
    (:class:`Supervisor`): one flapping window must not take the healthy ones down."""
    print(f"ring up: {len(ring.processes)} nodes, manifest {ring.run_dir / 'ring.toml'}")
    for k, sock in enumerate(ring.sockets):
        first = ring.standby_start
        w = ring.manifest.ranks[k if first is None or k < first else k - first]
        at = w.address if first is None or k < first else f"{w.standby[0].address} (standby, dormant until needed)"
        print(f"  {ring.label(k)}: layers {w.start}:{w.end} at {at}, pid {ring.processes[k].pid}, control {sock}")
    if ring.relay is not None:
        print(f"  relay: {ring.relay_url}, pid {ring.relay.pid} (every link goes through it)")
    if args.api_port is not None:
        print(f"OpenAI API: http://{API_HOST}:{args.api_port}/v1 (every node an entry)")
    try:
        found = find_socket()
    except InputError:
        found = None
    # Another node in the runtime directory may sort first; then the bare command would watch that one.
    print("watch it:   kvasir tui" + ("" if found == ring.sockets[0] else f" --socket {ring.sockets[0]}"))
    standby = "; its standby takes over meanwhile" if ring.standby_start is not None else ""
    print(f"Ctrl-C (or SIGTERM/SIGHUP) stops the ring; a node that dies is restarted{standby}.", flush=True)
    while True:
        time.sleep(0.2)
        for note in supervisor.check():
            with contextlib.suppress(OSError):  # a closed terminal must not stop the ring
                print(note, file=sys.stderr, flush=True)
