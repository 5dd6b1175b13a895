"""The two models of a run, for chat and evaluation: its quantized checkpoint and the original it was made
from, loaded once into the shared model cache on the app's device and dropped when the run is deleted."""

from __future__ import annotations

import os
from pathlib import Path

from ..models import load_model
from ..storage.checkpoint import load_quantized
from .services import Shared
from .sources import loadable_source


class RunModels:
    def __init__(self, shared: Shared) -> None:
        self.shared = shared

    def load_quantized(self, ckpt: Path):
        """(model, tokenizer) of a packed checkpoint (ValueError when it holds no tokenizer)."""
        device, dtype = self.shared.settings.device, self.shared.dtype

        def load():
            model, tok = load_quantized(ckpt, device=device, dtype=dtype)
            if tok is None:
                raise ValueError(f"checkpoint {ckpt.name} holds no tokenizer; cannot chat with it or evaluate it")
            return model, tok

        return self.shared.cache.get(("quant", str(ckpt), device), load)

    def load_original(self, source: str):
        device, dtype = self.shared.settings.device, self.shared.dtype
        return self.shared.cache.get(("orig", source, dtype, device),
                                     lambda: load_model(source, dtype=dtype, device=device))

    def run_models(self, run_id: str, owner: str):
        """(quantized (model, tok), original (model, tok) or None, why the original is missing, source name)."""
        if not run_id:
            raise ValueError("pick a finished run (or upload a packed checkpoint) first")
        manager = self.shared.manager
        ckpt = manager.checkpoint_dir(run_id, owner)
        snap = manager.get(run_id, owner, reports=False)
        source = (snap.result or {}).get("source_model")
        quant = self.load_quantized(ckpt)
        original, why = None, ""
        if snap.kind == "import":  # the uploader's words: loaded only when trusted (``sources``)
            source, why = self._uploaded_source(source, owner)
        if source:
            try:
                original = self.load_original(source)
            except ValueError as exc:
                why = self.shared.public(exc)
        elif not why:
            why = "the checkpoint does not say which model it was made from"
        return quant, original, why, source

    def _uploaded_source(self, source: str | None, owner: str) -> tuple[str | None, str]:
        """(the recorded source of an uploaded run when it may be loaded, else None; why not)."""
        s = self.shared.settings
        own = {(snap.result or {}).get("source_model") for snap in self.shared.manager.jobs(owner, statuses=("done",))
               if snap.kind != "import"} - {None}
        return loadable_source(source, own, s.allowed_hub_models, s.max_hub_model_bytes)

    def drop_checkpoint(self, ckpt: Path) -> None:
        """Forget the quantized model loaded from ``ckpt`` (e.g. an upload that was refused after loading)."""
        self.shared.cache.drop(lambda key: key[0] == "quant" and key[1] == str(ckpt))

    def run_deleted(self, job_id: str, owner: str) -> None:
        """A run was deleted: the quantized models loaded from its directory go (``JobManager.on_delete``)."""
        prefix = str(self.shared.manager.jobs_dir / job_id)

        def in_run(key) -> bool:
            return key[0] == "quant" and (key[1] == prefix or key[1].startswith(prefix + os.sep))

        self.shared.cache.drop(in_run)
