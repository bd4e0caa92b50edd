"""The market's catalog: published model records (immutable) and each model's rank manifest."""

from __future__ import annotations

import json

from kvasir.core.errors import InputError, MarketError
from kvasir.market.records import ManifestRecord, ModelRecord
from kvasir.market.server.sqlite import Database, StorePart

#: Models a market offers at most.
MAX_MODELS = 256
#: Windows one coverage or demand reply lists at most (a manifest has at most 4096); read at call time.
MAX_COVERAGE_WINDOWS = 16384


class Catalog(StorePart):
    def __init__(self, base: Database) -> None:
        super().__init__(base)
        self._models: dict[str, ModelRecord] = {}  # parsed once: a published record never changes

    def put_model(self, model: ModelRecord) -> bool:
        """Store a model record; True if it is new. A published record is immutable: the same record again is a
        no-op, different content under the same sha256 is refused (409)."""
        with self._write() as db:
            row = db.execute("SELECT body FROM models WHERE sha256 = ?", (model.sha256,)).fetchone()
            if row is not None:
                if not ModelRecord.from_wire(json.loads(row[0])).same_content(model):
                    raise MarketError(409, "model_immutable", f"model {model.sha256[:12]}… is published already")
                return False
            (count,) = db.execute("SELECT COUNT(*) FROM models").fetchone()
            if count >= MAX_MODELS:
                raise MarketError(409, "too_many_models", f"this market offers {MAX_MODELS} models at most")
            db.execute(
                "INSERT INTO models (sha256, body, added) VALUES (?, ?, ?)",
                (model.sha256, json.dumps(model.to_wire()), self.clock()),
            )
        return True

    def models(self) -> list[ModelRecord]:
        rows = self.db.execute("SELECT sha256 FROM models ORDER BY added LIMIT ?", (MAX_MODELS,)).fetchall()
        return [self.model(r[0]) for r in rows]

    def model(self, sha256: str) -> ModelRecord:
        cached = self._models.get(sha256)
        if cached is not None:
            return cached
        row = self.db.execute("SELECT body FROM models WHERE sha256 = ?", (sha256,)).fetchone()
        if row is None:
            raise MarketError(404, "unknown_model", f"no model {sha256[:12]}… on this market")
        record = self._models[sha256] = ModelRecord.from_wire(json.loads(row[0]))
        return record

    def put_manifest(self, manifest: ManifestRecord) -> None:
        """Set a model's rank manifest; leases on windows it no longer has are dropped."""
        model = self.model(manifest.model)
        expect = 0
        for w in manifest.windows:
            if w.start != expect:
                raise InputError(f"manifest: window [{w.start}, {w.end}) does not continue from layer {expect}")
            if model.stage(w.start, w.end) is None:
                raise InputError(f"manifest: the model lists no stage hash for window [{w.start}, {w.end})")
            expect = w.end
        if expect != model.n_layers:
            raise InputError(f"manifest: windows end at layer {expect}, the model has {model.n_layers}")
        keep = {(w.start, w.end) for w in manifest.windows}
        with self._write() as db:
            db.execute(
                "INSERT INTO manifests (model, body, updated) VALUES (?, ?, ?)"
                " ON CONFLICT (model) DO UPDATE SET body = excluded.body, updated = excluded.updated",
                (manifest.model, json.dumps(manifest.to_wire()), self.clock()),
            )
            held = db.execute('SELECT start, "end" FROM leases WHERE model = ?', (manifest.model,)).fetchall()
            for start, end in held:
                if (start, end) not in keep:
                    db.execute(
                        'DELETE FROM leases WHERE model = ? AND start = ? AND "end" = ?', (manifest.model, start, end)
                    )

    def manifest(self, model: str) -> ManifestRecord:
        row = self.db.execute("SELECT body FROM manifests WHERE model = ?", (model,)).fetchone()
        if row is None:
            raise MarketError(404, "no_manifest", f"model {model[:12]}… has no rank manifest yet")
        return ManifestRecord.from_wire(json.loads(row[0]), model)

    def window(self, model: str, start: int, end: int) -> tuple[ManifestRecord, int]:
        """The model's manifest and the rank of window [start, end) in it (404 if there is none)."""
        self.model(model)
        manifest = self.manifest(model)
        for rank, w in enumerate(manifest.windows):
            if (w.start, w.end) == (start, end):
                return manifest, rank
        raise MarketError(404, "unknown_window", f"model {model[:12]}… has no window [{start}, {end})")
