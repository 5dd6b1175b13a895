"""The models of runs, for chat and evaluation: a run's quantized checkpoint and the original it was made from,
loaded once into the shared model cache on the app's device and dropped when the run is deleted; and the chat's two
sides, each the original or any finished run (``side_models``), checked to fit in memory together first."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from ..models import load_model
from ..storage.checkpoint import checkpoint_size, load_quantized
from . import views
from .estimate import model_info
from .services import Shared
from .sources import loadable_source

ORIGINAL = "original"  # a chat side's pick: the original model (else a run id)
FREE_MEMORY_SHARE = 0.8  # of the memory free now, what the models a chat loads may take together


@dataclass(frozen=True)
class Side:
    """One side of the chat: what was picked (``ORIGINAL`` or a run id), its (model, tokenizer) or None with
    ``why`` (an original that cannot be loaded), and its name as the page shows it."""

    pick: str
    pair: tuple | None
    why: str
    label: str
    source: str | None


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

        return self.shared.cache.get(self._quant_key(ckpt), load)

    def load_original(self, source: str):
        device, dtype = self.shared.settings.device, self.shared.dtype
        return self.shared.cache.get(self._original_key(source), lambda: load_model(source, dtype=dtype, device=device))

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

    def trusted_source(self, run_id: str, owner: str) -> tuple[str | None, str]:
        """(the original model of ``run_id`` that may be loaded, else None; why not). An uploaded run's recorded
        source is the uploader's words: loaded only when trusted (``sources``)."""
        snap = self.shared.manager.get(run_id, owner, reports=False)
        source = (snap.result or {}).get("source_model")
        if snap.kind == "import":
            return self._uploaded_source(source, owner)
        return source, ""

    def side_models(self, run_id: str, picks: tuple[str, ...], owner: str) -> list[Side]:
        """The chat's sides: each pick is ``ORIGINAL`` (the original of ``run_id``, else of the first run picked),
        a run id, or empty (``run_id`` itself). ValueError when no run is picked, or when the models not loaded yet
        do not fit in memory together."""
        runs = [p if p and p != ORIGINAL else run_id for p in picks]
        base = run_id or next((r for r, p in zip(runs, picks, strict=True) if p != ORIGINAL and r), "")
        if not base and not any(runs):
            raise ValueError("pick a finished run (or upload a packed checkpoint) first")
        manager = self.shared.manager
        source, untrusted = self.trusted_source(base, owner) if base else (None, "")
        wanted: dict[tuple, tuple[str, int | None]] = {}  # cache key -> (what, bytes it will take)
        for pick, run in zip(picks, runs, strict=True):
            if pick == ORIGINAL:
                if source:
                    wanted[self._original_key(source)] = (f"the original {source}", _dense_bytes(source))
            else:
                snap = manager.get(run, owner, reports=False)
                ckpt = manager.checkpoint_dir(run, owner)
                bytes_ = (snap.result or {}).get("checkpoint_bytes") or checkpoint_size(ckpt)
                wanted[self._quant_key(ckpt)] = (f"run {run}", bytes_)
        self.check_fits(wanted)
        sides = []
        for pick, run in zip(picks, runs, strict=True):
            if pick != ORIGINAL:
                sides.append(Side(run, self.load_quantized(manager.checkpoint_dir(run, owner)), "", f"run {run}",
                                  (manager.get(run, owner, reports=False).result or {}).get("source_model")))
                continue
            pair, why = None, untrusted or "the checkpoint does not say which model it was made from"
            if source:
                try:
                    pair, why = self.load_original(source), ""
                except ValueError as exc:
                    why = self.shared.public(exc)
            sides.append(Side(ORIGINAL, pair, why, "original", source))
        return sides

    def check_fits(self, wanted: dict) -> None:
        """ValueError naming the models when those of ``wanted`` (cache key -> (name, bytes or None)) that are not
        loaded yet need more than ``FREE_MEMORY_SHARE`` of the memory free now, or more models than the cache
        holds."""
        cache = self.shared.cache
        if len(wanted) > cache.max_items:
            raise ValueError(f"the two sides need {len(wanted)} models and the app keeps at most {cache.max_items} "
                             "loaded: pick the same run on both sides")
        missing = {key: v for key, v in wanted.items() if key not in cache}
        need = sum(b or 0 for _, b in missing.values())
        free = self.free_bytes()
        if missing and need > FREE_MEMORY_SHARE * free:
            names = " and ".join(f"{name} (about {views.mb(b)})" for name, b in missing.values())
            raise ValueError(f"{names} do not fit in memory together: {views.mb(free)} is free on "
                             f"{self.shared.settings.device}; pick smaller runs, or the same run on both sides")

    def free_bytes(self) -> int:
        """Memory free now on the app's device (the GPU's for cuda, else the machine's)."""
        if self.shared.settings.device.startswith("cuda") and torch.cuda.is_available():
            return int(torch.cuda.mem_get_info()[0])
        return int(psutil.virtual_memory().available)

    def _quant_key(self, ckpt: Path) -> tuple:
        return ("quant", str(ckpt), self.shared.settings.device)

    def _original_key(self, source: str) -> tuple:
        return ("orig", source, self.shared.dtype, self.shared.settings.device)
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


def _dense_bytes(source: str) -> int | None:
    """Bytes the original ``source`` takes loaded at 16 bits (None when its shapes cannot be read)."""
    try:
        info = model_info(source)
    except ValueError:
        return None
    return 2 * (info.linear_weights + info.other_params)
