"""``kvasir node --manifest ring.toml --rank K [--model MODEL.gguf | --stage STAGE.gguf]``: run one ring node.

``kvasir node --manifest ring.toml --rank K --standby I``: run standby I of rank K (loaded, dormant until needed).

``kvasir node --market URL [--memory-budget 4GiB] [--relay URL]``: start empty and self-enroll (docs/market.md).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import trio

from kvasir.api.server import ApiAccess
from kvasir.commands.common import add_batch_arg, add_speculate_arg
from kvasir.commands.config import fill_from_config
from kvasir.commands.id import add_identity_argument, default_identity_path, identity_from_args
from kvasir.control.paths import node_socket_path
from kvasir.control.server import serve_control
from kvasir.core.errors import InputError, StageError
from kvasir.core.identity import Identity, load_or_create_identity
from kvasir.core.oracle import OracleSpec, oracle_sources
from kvasir.core.schedule import PREFILL_CHUNK
from kvasir.core.speculate import DraftSources
from kvasir.relay.ringlink import relay_connector
from kvasir.ring.manifest import Manifest, load_manifest
from kvasir.ring.node import Node, NodeConfig, open_node
from kvasir.shard.cache import default_cache_dir, stage_files
from kvasir.stage.draftmodel import DraftModel
from kvasir.stage.engine import Stage, StageConfig
from kvasir.stage.mtpsource import MtpSources
from kvasir.util.addrgroup import is_loopback_host
from kvasir.wire import BoundaryDType

log = logging.getLogger("kvasir.node")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("node", help="run one ring node (its stage, both links, control socket, optional API)")
    p.add_argument("--manifest", type=Path, help="rank manifest (TOML)")
    p.add_argument("--rank", type=int)
    p.add_argument(
        "--standby",
        type=int,
        default=None,
        metavar="I",
        help="run the rank's standby I from the manifest (its address and key): idle until its predecessor needs it",
    )
    p.add_argument(
        "--supervisor-state",
        type=Path,
        default=None,
        metavar="FILE",
        help="a supervisor's view of the ring's processes, shown in this node's status (kvasir ring up sets it)",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, help="whole GGUF to cut this rank's window from")
    src.add_argument("--stage", type=Path, help="this rank's stage GGUF")
    p.add_argument("--api-port", type=int, default=None, help="serve the OpenAI-compatible API on this port")
    p.add_argument("--api-host", default="127.0.0.1", help="API bind address (default loopback)")
    p.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="require one of these bearer keys (one per line, file mode 0600) on the API",
    )
    p.add_argument(
        "--allow-open-api",
        action="store_true",
        help="serve the API off loopback without --api-key-file (anyone who reaches the port may use the ring)",
    )
    p.add_argument("--control", type=Path, default=None, help="control socket path (default: runtime dir)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ctx", type=int, default=2048, help="context length per request")
    p.add_argument("--seqs", type=int, default=8, help="requests in flight at once")
    p.add_argument("--gpu-layers", type=int, default=None, help="layers on the GPU (-1 all; default 0)")
    add_identity_argument(p)
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="prompt tokens per prefill boundary")
    add_speculate_arg(p, "requests entering here that do not ask their own")
    add_batch_arg(p)
    p.add_argument(
        "--relay",
        default=None,
        metavar="URL",
        help="send both links through this relay (ws://host:port or wss://host:port)",
    )
    p.add_argument(
        "--boundary-dtype",
        choices=["f32", "f16", "bf16"],
        default="f32",
        help="encoding of the boundaries this node sends (f32 is bit-exact; default)",
    )
    p.add_argument(
        "--failover-wait",
        type=float,
        default=15.0,
        metavar="S",
        help="how long requests wait for a lost neighbour's window to come back before failing (default 15 s)",
    )
    p.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="write a signed receipt of every request on this window (a market node: the window it holds) into DIR, "
        "and spool its inputs for audits; a market node always records (default: STAGE_DIR/record) "
        "(docs/verification.md; costs a hash of each frame, and of each logits row on the last rank)",
    )
    p.add_argument(
        "--record-keep",
        default="1GiB",
        metavar="SIZE",
        help="cap on the input spool under --record DIR/pending, oldest out first (default 1GiB)",
    )
    m = p.add_argument_group("self-enrollment (instead of --manifest/--rank)")
    m.add_argument("--market", metavar="URL", help="claim a window from this market and join its ring")
    m.add_argument(
        "--market-key",
        default=None,
        metavar="KEY",
        help="the market operator's key (ed25519:…): records it did not sign, and replies of a market key it did not "
        "delegate to, are refused (required off loopback; on loopback the default is trust on first use)",
    )
    m.add_argument(
        "--allow-plain-http",
        action="store_true",
        help="allow an http:// market off loopback (its replies are still signed and checked, but the path sees "
        "every exchange; default: refused, use https://)",
    )
    m.add_argument(
        "--market-ca",
        type=Path,
        default=None,
        metavar="PEM",
        help="CA certificates (PEM bundle) trusted besides the system's, for an https:// market and its sources",
    )
    m.add_argument(
        "--allow-private",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="dial neighbours and fetch sources at loopback/private addresses (default: only if the market is at one)",
    )
    m.add_argument("--memory-budget", default=None, metavar="SIZE", help="largest stage to hold (default 4GiB)")
    m.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="link listener (default any port)")
    m.add_argument("--advertise", default=None, metavar="HOST", help="host neighbours dial (default the listen host)")
    m.add_argument("--lease", type=float, default=30.0, metavar="S", help="lease time (default 30 s)")
    m.add_argument("--poll", type=float, default=2.0, metavar="S", help="coverage poll interval (default 2 s)")
    m.add_argument("--seed", type=int, default=None, help="seed of the tie-breaking draw")
    m.add_argument(
        "--ring-secret-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="file holding the relay's ring secret in hex (or set KVASIR_RING_SECRET; never on a command line)",
    )
    m.add_argument("--stage-dir", type=Path, default=None, help="where fetched stages go (default the cache)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(run=run)


def api_access(args: argparse.Namespace) -> ApiAccess:
    """Who may use the API: the keys of ``--api-key-file``, or anyone (a loopback API by default)."""
    return ApiAccess() if args.api_key_file is None else ApiAccess.from_key_file(args.api_key_file)


def read_ring_secret(path: Path | None) -> str | None:
    """The relay's ring secret (hex) from a file or ``KVASIR_RING_SECRET``: never argv, which other users can read."""
    if path is None:
        return os.environ.get("KVASIR_RING_SECRET") or None
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the ring secret file {path}: {exc}") from None
    try:
        bytes.fromhex(text)
    except ValueError:
        raise InputError(f"the ring secret file {path} does not hold hex") from None
    return text


def parse_size(text: str) -> int:
    """``4GiB``, ``512MB``, ``300k``, ``1000`` → bytes (pure)."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 1024**2}
    units |= {"g": 10**9, "gb": 10**9, "gib": 1024**3, "t": 10**12, "tb": 10**12, "tib": 1024**4}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = t[len(num) :].strip()
    try:
        value = float(num)
    except ValueError:
        raise InputError(f"bad size {text!r} (e.g. 4GiB, 512MB)") from None
    if unit not in units or value <= 0:
        raise InputError(f"bad size {text!r} (e.g. 4GiB, 512MB)")
    return int(value * units[unit])


def standby_view(manifest: Manifest, rank: int, index: int, relay: str | None) -> Manifest:
    """The manifest as standby ``index`` of ``rank`` runs it. Relayed links need the standby's own edge grants in a
    keyed ring (``[[rank.standby]] grants``; `kvasir ring up --relay --standby` signs them): its edge in is its own,
    ``{ring}-e{rank}-s{index}`` (docs/protocol.md § Relay edges)."""
    view = manifest.as_standby(rank, index)
    relayed = relay is not None or (
        manifest.relay is not None and "relay" in (view.rank(rank).link, view.successor(rank).link)
    )
    if relayed and manifest.secured and not manifest.secret and not view.rank(rank).grants:
        raise InputError(
            f"rank {rank}'s standby {index} has relayed links but no edge grants of its own in the manifest"
        )
    return view


def stage_path_for(manifest: Manifest, rank: int, model: Path | None, stage: Path | None, manifest_dir: Path) -> Path:
    if stage is not None:
        return stage
    entry = manifest.rank(rank)
    if entry.stage:
        p = Path(entry.stage)
        return p if p.is_absolute() else manifest_dir / p
    if model is None:
        raise InputError("pass --model or --stage (or give the rank a stage in the manifest)")
    return stage_files(model, [(entry.start, entry.end)], default_cache_dir())[0]


def run(args: argparse.Namespace) -> int:
    # Unset flags take their values from the environment and config.toml; the market only for a node given no window.
    keys = ["identity", "relay", "memory_budget", "threads", "gpu_layers", "api_key_file"]
    given_window = any(getattr(args, a) is not None for a in ("manifest", "rank", "model", "stage", "standby"))
    fill_from_config(args, keys if given_window else [*keys, "market", "market_ca"])
    if not 0 < args.failover_wait <= 3600:
        raise InputError(f"--failover-wait must be in (0, 3600] seconds, got {args.failover_wait}")
    if (
        args.api_port is not None
        and args.api_key_file is None
        and not is_loopback_host(args.api_host)
        and not args.allow_open_api
    ):
        raise InputError(
            f"--api-host {args.api_host} without --api-key-file would let anyone use the ring: "
            "give --api-key-file FILE, or --allow-open-api to mean it"
        )
    if sum((args.draft_model is not None, args.draft_oracle is not None, args.draft_mtp)) > 1:
        raise InputError("--draft-model, --draft-oracle and --draft-mtp are three drafters: pass one")
    if args.draft_mtp and not args.speculate:
        raise InputError("--draft-mtp drafts for --speculate K: pass both")
    if args.market is not None:
        if args.draft_model is not None or args.draft_oracle is not None or args.draft_mtp:
            raise InputError(
                "--draft-model, --draft-oracle and --draft-mtp are for nodes started from a manifest, not --market"
            )
        if given_window:
            raise InputError("--market starts an empty node: drop --manifest, --rank, --standby, --model and --stage")
        return run_enrolled(args)
    if args.manifest is None or args.rank is None:
        raise InputError("pass --manifest and --rank (or --market URL to self-enroll)")
    who = f"rank{args.rank}" if args.standby is None else f"rank{args.rank}-standby{args.standby}"
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format=f"%(asctime)s {who} %(levelname)s %(message)s"
    )
    manifest = load_manifest(args.manifest)
    manifest.rank(args.rank)
    if args.standby is not None:
        manifest = standby_view(manifest, args.rank, args.standby, args.relay)
    path = stage_path_for(manifest, args.rank, args.model, args.stage, args.manifest.parent)
    last = args.rank == manifest.size - 1
    config = StageConfig(
        path,
        n_ctx=args.ctx,
        n_seq_max=args.seqs,
        n_threads=args.threads,
        n_gpu_layers=args.gpu_layers,
        mtp=args.draft_mtp and last,  # other ranks ignore --draft-mtp (ring up passes it to every node)
        # A hybrid window before the last rolls rejected drafts back from snapshots (K drafts need K + 1; other
        # architectures ignore it); the last window never rolls back (it stops at the rejected row).
        rollback=args.speculate + 1 if args.speculate and not last else 0,
    )
    trio.run(functools.partial(serve_node, manifest, args.rank, config, args))
    return 0


def draft_sources(
    args: argparse.Namespace, stage: Stage, config: StageConfig, stack: contextlib.ExitStack
) -> DraftSources | None:
    """Worker thread: the last rank's drafter when one is named (None: prompt lookup; other ranks ignore it). A draft
    model is loaded here and checked against the model's vocabulary (InputError, one line)."""
    if not stage.info.last:
        return None
    if args.draft_oracle is not None:
        OracleSpec.read(args.draft_oracle)  # a bad file: refused at start, not at the first request
        return oracle_sources(args.draft_oracle, stage.info.n_vocab)
    if args.draft_model is not None:
        draft = DraftModel.load(
            args.draft_model, stage.vocab, n_ctx=config.n_ctx, n_seq_max=config.n_seq_max, n_threads=config.n_threads
        )
        stack.callback(draft.close)
        return draft.source
    if args.draft_mtp:
        mtp = MtpSources(stage)
        stack.callback(mtp.close)
        return mtp
    return None


async def serve_node(manifest: Manifest, rank: int, config: StageConfig, args: argparse.Namespace) -> None:
    try:
        stage = await trio.to_thread.run_sync(Stage.load, config)
    except StageError as exc:
        if config.mtp:  # the model (or this stage file) has no MTP block
            raise InputError(f"--draft-mtp: {exc}") from None
        raise
    drafters = contextlib.ExitStack()
    try:
        await trio.to_thread.run_sync(lambda: stage.vocab)  # load the tokenizer before serving
        sources = await trio.to_thread.run_sync(draft_sources, args, stage, config, drafters)
        # A keyed ring needs the node's identity; a keyless one uses it only if one was named.
        identity = identity_from_args(args) if manifest.secured or args.identity is not None else None
        node_config = NodeConfig(
            manifest,
            rank,
            prefill_chunk=args.prefill_chunk,
            relay=args.relay,
            # v2 tokens from this node's key and grants (keyed ring), else the keyless ring's v1 secret.
            relay_connect=relay_connector(manifest, rank, identity),
            identity=identity,
            boundary_dtype=BoundaryDType[args.boundary_dtype.upper()],
            failover_wait=args.failover_wait,
            link_wait=max(30.0, args.failover_wait + 5.0),
            standby=args.standby is not None,
            speculate=args.speculate,
            draft_policy=args.draft_policy,
            draft_sources=sources,
            batch=args.batch,
            supervisor_state=args.supervisor_state,
        )
        recorder = None
        if args.record is not None:
            recorder = await trio.to_thread.run_sync(node_recorder, args, manifest, stage, identity)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with open_node(node_config, stage, recorder=recorder) as node, trio.open_nursery() as nursery:
                control = args.control or node_socket_path(rank, manifest.rank(rank).port)
                await nursery.start(serve_control, node, control)
                if args.api_port is not None:
                    from kvasir.api import serve_api

                    await nursery.start(
                        functools.partial(serve_api, access=api_access(args)), node, args.api_host, args.api_port
                    )
                log.warning(
                    "rank %d%s ready to link: layers %d:%d on %s, control %s",
                    rank,
                    "" if args.standby is None else f" (standby {args.standby}, dormant until needed)",
                    stage.info.start,
                    stage.info.end,
                    stage.info.backend,
                    control,
                )
                async for signum in signals:
                    log.warning("rank %d: %s, shutting down", rank, signal.Signals(signum).name)
                    await node.shutdown()  # error replies to in-flight requests while their clients still listen
                    nursery.cancel_scope.cancel()
                    break
    finally:
        drafters.close()
        stage.close()


def node_recorder(args: argparse.Namespace, manifest: Manifest, stage: Stage, identity: Identity | None) -> Any:
    """The receipts writer of ``--record DIR``: signed with the node's identity (the default one if none is named)."""
    from kvasir.ring.record import NodeRecorder
    from kvasir.verify.kernel import stage_kernel_class

    identity = identity or load_or_create_identity(default_identity_path())
    args.record.mkdir(parents=True, exist_ok=True)
    window = (stage.info.start, stage.info.end)
    cls, keep = stage_kernel_class(stage), parse_size(args.record_keep)
    return NodeRecorder(args.record, identity, manifest.model_sha256, window, cls, keep_bytes=keep)


def run_enrolled(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    trio.run(serve_enrolled, enroll_config(args), args)
    return 0


def enroll_config(args: argparse.Namespace) -> Any:
    """The EnrollConfig of ``kvasir node --market …``."""
    from kvasir.commands.market import parse_hostport
    from kvasir.market.agent.config import market_trust_problem
    from kvasir.market.agent.enroll import EnrollConfig

    host, port = parse_hostport(args.listen, "--listen")
    keys = enroll_keys(args)
    problem = market_trust_problem(args.market, keys["market_key"], allow_plain_http=args.allow_plain_http)
    if problem is not None:
        raise InputError(problem)
    ring_secret = read_ring_secret(args.ring_secret_file)  # only for a relay that takes v1 tokens
    return EnrollConfig(
        market_url=args.market,
        budget_bytes=parse_size(args.memory_budget),
        stage_dir=args.stage_dir or default_cache_dir() / "market",
        listen_host=host,
        listen_port=port,
        advertise_host=args.advertise,
        lease_s=args.lease,
        poll_s=args.poll,
        seed=args.seed,
        relay=args.relay,
        ring_secret=ring_secret,
        allow_private=args.allow_private,
        market_ca=args.market_ca,
        record_dir=args.record,
        record_keep=parse_size(args.record_keep),
        **keys,
        stage_config=functools.partial(
            StageConfig,
            n_ctx=args.ctx,
            n_seq_max=args.seqs,
            n_threads=args.threads,
            n_gpu_layers=args.gpu_layers,
            # Hybrid windows roll rejected drafts back from snapshots (any window: which one it gets is the market's).
            rollback=args.speculate + 1 if args.speculate else 0,
        ),
        node_options={
            "prefill_chunk": args.prefill_chunk,
            "speculate": args.speculate,
            "draft_policy": args.draft_policy,
            "batch": args.batch,
            "boundary_dtype": BoundaryDType[args.boundary_dtype.upper()],
            "failover_wait": args.failover_wait,
            "link_wait": max(30.0, args.failover_wait + 5.0),
        },
    )


def enroll_keys(args: argparse.Namespace) -> dict[str, Any]:
    """The pinned operator key, and this node's identity when one is named (default: a fresh key per run)."""
    from kvasir.core.identity import PublicKey

    keys: dict[str, Any] = {"market_key": PublicKey.from_text(args.market_key) if args.market_key else None}
    if getattr(args, "identity", None) is not None:
        keys["identity"] = identity_from_args(args)
    return keys


async def serve_enrolled(config: Any, args: argparse.Namespace) -> None:
    """Run an enrolling node until SIGINT/SIGTERM; then credit, release the lease and stop."""
    from kvasir.market.agent.enroll import Enrollment

    async def on_node(node: Node) -> None:
        """Beside each node served, until its window's session ends: the control socket (and the API)."""
        async with trio.open_nursery() as nursery:
            control = args.control or node_socket_path(node.rank, node.manifest.rank(node.rank).port)
            await nursery.start(serve_control, node, control)
            if args.api_port is not None:
                from kvasir.api import serve_api

                await nursery.start(
                    functools.partial(serve_api, access=api_access(args)), node, args.api_host, args.api_port
                )
            print(f"kvasir node: enrolled {json.dumps(enrollment.status())}", flush=True)

    enrollment = Enrollment(config, on_node=on_node)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(enrollment.run)
            log.warning(
                "node %s enrolling at %s (budget %d bytes)", config.node_id, config.market_url, config.budget_bytes
            )
            async for signum in signals:
                log.warning("node %s: %s, shutting down", config.node_id, signal.Signals(signum).name)
                await enrollment.close()
                nursery.cancel_scope.cancel()
                break
