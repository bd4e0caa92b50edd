"""``kvasir audit``: check a window's work by re-executing it (docs/verification.md).

* ``kvasir audit run LOG.json --stage STAGE.gguf [--proof-out PROOF.json]``: re-execute one logged request on one
  window (its signed receipt and input boundaries) and compare every output hash; exit 0 when they are equal, 1 when
  they differ (the fraud proof is written to ``--proof-out``).
* ``kvasir audit verify-proof PROOF.json --stage STAGE.gguf``: check a fraud proof from scratch on this machine
  (signatures, inputs, re-execution); exit 0 when the proof holds, 1 when it does not.

* ``kvasir audit select DIR --new-key KEYFILE``: make an audit key (file mode 0600) and print its commitment, to
  publish before the epoch; ``kvasir audit select DIR --key KEYFILE --fraction F [--commitment HEX]``: reveal it over
  a record directory (``kvasir node --record DIR``): the selected logs move to ``DIR/selected/`` (with the
  predecessor's receipt and the successor check), the others are deleted.
* ``kvasir audit submit PROOF.json --market URL``: hand a fraud proof to the market (``POST /v1/fraud``).

A machine of another kernel class, or a stage file of another window or model, cannot judge: exit 2 with one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvasir.commands.common import print_json
from kvasir.commands.id import add_identity_argument, identity_from_args


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="re-execute a window's logged work; check fraud proofs")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_p = actions.add_parser("run", help="audit one logged request on one window")
    run_p.add_argument("log", type=Path, metavar="LOG.json", help="the window's receipt and input boundaries")
    run_p.add_argument("--stage", required=True, type=Path, metavar="STAGE.gguf", help="the same window's stage file")
    run_p.add_argument("--proof-out", type=Path, metavar="PROOF.json", help="where to write a fraud proof")
    run_p.add_argument("--json", action="store_true")
    run_p.set_defaults(run=run_audit)
    vp = actions.add_parser("verify-proof", help="check a fraud proof by re-executing its window")
    vp.add_argument("proof", type=Path, metavar="PROOF.json")
    vp.add_argument("--stage", required=True, type=Path, metavar="STAGE.gguf", help="the suspect window's stage file")
    vp.add_argument("--json", action="store_true")
    vp.set_defaults(run=run_verify_proof)
    sub = actions.add_parser("submit", help="hand a fraud proof to the market, which withdraws the cheater's credit")
    sub.add_argument("proof", type=Path, metavar="PROOF.json")
    sub.add_argument("--market", required=True, metavar="URL", help="the market (http:// or https://)")
    sub.add_argument("--market-ca", type=Path, default=None, metavar="PEM", help="CA bundle for an https:// market")
    add_identity_argument(sub)
    sub.add_argument("--json", action="store_true")
    sub.set_defaults(run=run_submit)
    sel = actions.add_parser("select", help="reveal an audit key over a record directory (or make one)")
    sel.add_argument("directory", type=Path, metavar="DIR", help="a record directory (kvasir node --record DIR)")
    key = sel.add_mutually_exclusive_group(required=True)
    key.add_argument("--key", type=Path, metavar="KEYFILE", help="the audit key to reveal")
    key.add_argument("--new-key", type=Path, metavar="KEYFILE", help="make a key and print its commitment")
    sel.add_argument("--fraction", type=float, default=0.02, help="share of (request, window) audited (default 0.02)")
    sel.add_argument("--commitment", default=None, metavar="HEX", help="refuse a key that is not this commitment's")
    sel.add_argument("--json", action="store_true")
    sel.set_defaults(run=run_select)


def run_audit(args: argparse.Namespace) -> int:
    import attrs

    from kvasir.verify.audit import WindowLog, audit_window, make_proof, read_json, write_json

    log = WindowLog.from_wire(read_json(args.log), str(args.log))
    result = audit_window(args.stage, log.inputs, log.receipt)
    if not result.ok and args.proof_out is not None:
        write_json(args.proof_out, make_proof(log.receipt, log.inputs, result, log.predecessor).to_wire())
    r = log.receipt
    if args.json:
        print_json({**attrs.asdict(result), "node": r.key.fingerprint, "request": r.request})
    elif result.ok:
        skipped = (
            f" ({result.skipped} of them verify rows the next step rolled back, not computed)" if result.skipped else ""
        )
        print(
            f"ok: node {r.key.fingerprint}, layers {r.start}:{r.end}, request {r.request}: {result.steps} steps equal"
            f"{skipped}"
        )
    else:
        where = f" (proof: {args.proof_out})" if args.proof_out is not None else ""
        print(
            f"MISMATCH: node {r.key.fingerprint}, layers {r.start}:{r.end}, request {r.request}: step {result.step} "
            f"signed {result.signed_hash}, recomputed {result.recomputed_hash}{where}"
        )
    return 0 if result.ok else 1


def run_verify_proof(args: argparse.Namespace) -> int:
    import attrs

    from kvasir.verify.audit import FraudProof, proof_summary, read_json, verify_proof

    proof = FraudProof.from_wire(read_json(args.proof), str(args.proof))
    result = verify_proof(proof, args.stage)
    if args.json:
        print_json({**attrs.asdict(result), "holds": not result.ok, "node": proof.suspect.key.fingerprint})
    else:
        print(proof_summary(proof, result))
    return 1 if result.ok else 0


def run_select(args: argparse.Namespace) -> int:
    import os

    from kvasir.core.errors import InputError
    from kvasir.verify.select import KEY_BYTES, key_commitment, new_key, reveal

    if args.new_key is not None:
        key = new_key()
        try:
            fd = os.open(args.new_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise InputError(f"cannot create {args.new_key}: {exc.strerror}") from None
        with os.fdopen(fd, "w") as fh:
            fh.write(key.hex() + "\n")
        print(f"audit key written to {args.new_key}; publish its commitment: {key_commitment(key)}")
        return 0
    try:
        key = bytes.fromhex(args.key.read_text().strip())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read an audit key from {args.key}: {exc}") from None
    if len(key) != KEY_BYTES:
        raise InputError(f"{args.key}: an audit key is {KEY_BYTES} bytes in hex")
    if not (args.directory / "pending").is_dir():
        raise InputError(f"{args.directory} is not a record directory (no pending/)")
    done = reveal(args.directory, key, args.fraction, commitment=args.commitment)
    broken = [{"log": str(p), "step": step} for p, step in done.broken_links]
    if args.json:
        print_json(
            {
                "selected": len(done.selected),
                "dropped": done.dropped,
                "linked": done.linked,
                "broken_links": broken,
                "skipped": [str(p) for p in done.skipped],
                "logs": [str(p) for p in done.selected],
            }
        )
    else:
        print(f"{len(done.selected)} selected (in {args.directory / 'selected'}), {done.dropped} dropped")
        for b in broken:
            print(f"BROKEN LINK: {b['log']}: step {b['step']} is not what the predecessor signed it sent")
        for p in done.skipped:
            print(f"skipped {p}: not a log of the request and window its name says")
    return 1 if broken else 0


def run_submit(args: argparse.Namespace) -> int:
    """Sign and POST the proof; the market checks it (and may re-execute it) before it withdraws anything."""
    import trio

    from kvasir.market.agent.client import MarketClient
    from kvasir.util.tls import client_context
    from kvasir.verify.audit import FraudProof, read_json

    proof = FraudProof.from_wire(read_json(args.proof), str(args.proof))  # a malformed file fails here, not there
    identity = identity_from_args(args)

    async def submit() -> dict[str, Any]:
        async with MarketClient(args.market, identity=identity, tls=client_context(args.market_ca)) as market:
            return await market.fraud(proof.to_wire())

    result = trio.run(submit)
    if args.json:
        print_json(result)
    else:
        again = " (already recorded)" if result.get("duplicate") else ""
        print(
            f"market withdrew {result['withdrawn']:g} credit from node {result['node_id']} (layers "
            f"{result['start']}:{result['end']}); lease revoked: {result['lease_revoked']}; proof {result['proof_id']}"
            f"{again}"
        )
    return 0
