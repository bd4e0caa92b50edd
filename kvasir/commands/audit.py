"""``kvasir audit``: check a window's work by re-executing it (docs/verification.md).

* ``kvasir audit run LOG.json --stage STAGE.gguf [--proof-out PROOF.json]``: re-execute one logged request on one
  window (its signed receipt and input boundaries) and compare every output hash; exit 0 when they are equal, 1 when
  they differ (the fraud proof is written to ``--proof-out``).
* ``kvasir audit verify-proof PROOF.json --stage STAGE.gguf``: check a fraud proof from scratch on this machine
  (signatures, inputs, re-execution); exit 0 when the proof holds, 1 when it does not.

A machine of another kernel class, or a stage file of another window or model, cannot judge: exit 2 with one line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from kvasir.commands.common import print_json


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
        print(
            f"ok: node {r.key.fingerprint}, layers {r.start}:{r.end}, request {r.request}: {result.steps} steps equal"
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
