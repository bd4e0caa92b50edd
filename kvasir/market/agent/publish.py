"""Offer a local model on a market: its record (identity, sources, byte profile, stage hashes) and rank manifest."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvasir.core.errors import InputError
from kvasir.core.identity import Identity, PublicKey
from kvasir.market import auth
from kvasir.market.agent.client import MarketClient
from kvasir.market.records import ManifestRecord, ModelRecord, Probe, StageHash, WindowSpec
from kvasir.shard.cache import file_sha256, model_sha256, stage_files
from kvasir.shard.gguf_file import describe
from kvasir.shard.gguf_io import read_gguf


def parse_windows(text: str, weights: str | None) -> list[WindowSpec]:
    """``"0:2,2:4,4:6"`` and optional ``"1,1,3"`` → window specs (pure)."""
    try:
        wins = [tuple(int(x) for x in part.split(":")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"--windows {text!r}: expected A:B,B:C,…") from None
    if any(len(w) != 2 for w in wins):
        raise InputError(f"--windows {text!r}: expected A:B,B:C,…")
    ws = [1.0] * len(wins)
    if weights is not None:
        try:
            ws = [float(x) for x in weights.split(",")]
        except ValueError:
            raise InputError(f"--weights {weights!r}: expected numbers") from None
        if len(ws) != len(wins):
            raise InputError(f"--weights gives {len(ws)} weights for {len(wins)} windows")
    return [WindowSpec(a, b, w) for (a, b), w in zip(wins, ws, strict=True)]


def planner_windows(model: Path, devices: Path) -> list[WindowSpec]:
    """Windows from kvasir.planner for a fleet (devices.toml); each window's weight is its share of the weights."""
    from kvasir.planner import load_devices, plan, profile_from_gguf

    manifest = plan(profile_from_gguf(model), load_devices(devices))
    total = sum(w.weight_bytes for w in manifest.windows) or 1
    return [WindowSpec(w.start, w.stop, w.weight_bytes / total) for w in manifest.windows]


def window_probes(path: Path) -> tuple[Probe, ...]:
    """The probe hash of one stage file in this machine's kernel class (kvasir.verify.probe): runs llama.cpp."""
    from kvasir.stage.engine import Stage, StageConfig
    from kvasir.verify.kernel import stage_kernel_class
    from kvasir.verify.probe import probe_hash

    with Stage.load(StageConfig(path, n_ctx=256, n_seq_max=1)) as stage:
        return (Probe(stage_kernel_class(stage), probe_hash(stage)),)


def model_record(
    model: Path,
    windows: Sequence[WindowSpec],
    sources: Sequence[str],
    cache_dir: Path,
    name: str | None = None,
    *,
    probes: bool = False,
) -> ModelRecord:
    """The market's record of ``model``: cuts (or reuses) each window's stage file to hash it; with ``probes``,
    runs each window's probe too, so that nodes of this machine's kernel class are admitted by reproduction."""
    gg = read_gguf(model)
    info = describe(model, gg)
    n_main = info.n_main
    spans = [(w.start, w.end) for w in windows]
    paths = stage_files(model, spans, cache_dir)
    stages = tuple(
        StageHash(a, b, file_sha256(p), p.stat().st_size, window_probes(p) if probes else ())
        for (a, b), p in zip(spans, paths, strict=True)
    )
    return ModelRecord(
        sha256=model_sha256(model, cache_dir),
        name=name or model.stem,
        n_layers=n_main,
        file_bytes=info.file_bytes,
        header_bytes=gg.data_offset,
        sources=tuple(sources),
        layer_bytes=info.layer_bytes[:n_main],
        outside_bytes=info.outside_bytes + sum(info.layer_bytes[n_main:]),
        stages=stages,
    )


def manifest_record(model: ModelRecord, windows: Sequence[WindowSpec], origin: str) -> ManifestRecord:
    return ManifestRecord(model.sha256, tuple(windows), origin)


async def publish_signed(
    market: MarketClient, operator: Identity, record: ModelRecord, manifest: ManifestRecord
) -> None:
    """Put a signed model record and its manifest; if the market's own key is not the operator's, also delegate
    window tickets to it (the operator's signature of the market's key), so nodes can trust its tickets."""
    await market.put_model(record)
    await market.put_manifest(manifest)
    info = await market.operator()
    market_key = PublicKey.from_text(str(info.get("market", "")))
    if market_key != operator.public and not auth.signature_ok(
        operator.public, auth.delegation_message(market_key), info.get("delegation")
    ):
        await market.put_delegation(auth.sign_delegation(operator, market_key))
