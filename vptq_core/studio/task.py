"""The app's quantization job: load, calibrate, quantize, save the packed checkpoint, pack the archive."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable

from ..api import quantize_to_dir
from ..storage.archive import pack_checkpoint
from ..storage.checkpoint import checkpoint_size
from . import zerogpu
from .card import write_model_card
from .job import JobCancelled, JobContext
from .report_paths import public_report


def quantization_task(model_name: str, method: str, config, calib, device: str = "cpu",
                      calib_text: str | None = None, archive_name: str | None = None,
                      resume: bool = False) -> Callable[[JobContext], dict]:
    """A task that quantizes ``model_name`` into ``<job dir>/checkpoint`` (``api.quantize_to_dir``), writes its
    model card (``card.write_model_card``) and packs it into ``<job dir>/<archive_name>.zip`` (default:
    ``<model>-<method>-<bits>bit-<UTC date-time>.zip``: no job or session id, no server path). ``calib_text``: text
    to calibrate on instead of ``calib.text`` (written into the job directory first, so an uploaded file may
    disappear meanwhile). ``resume``: continue the unfinished run in ``<job dir>/checkpoint/.partial`` from its last
    finished block (a run cut off by a restart; ``api.quantize_to_dir(resume=True)``: the same checkpoint as an
    uninterrupted run, ValueError when the settings differ); on ZeroGPU the run starts over.

    Result: ``summary`` (the pipeline's), ``checkpoint_dir``, ``archive``, ``checkpoint_bytes``,
    ``archive_bytes``, ``source_model``, ``method``, ``config``, ``calib``.
    """
    def task(ctx: JobContext) -> dict:
        ctx.set_phase("loading the model and the calibration text")
        used_calib = calib
        if calib_text is not None:
            path = ctx.out_dir / "calibration.txt"
            path.write_text(calib_text, encoding="utf-8")
            used_calib = dataclasses.replace(calib, text=str(path))
        spaces = zerogpu.zero_gpu()
        if spaces is not None:  # ZeroGPU: the GPU exists only inside a spaces.GPU call; the job runs as one
            out, summary = zerogpu.quantize_job(spaces, ctx, model_name, method, config, used_calib,
                                                ctx.out_dir / "checkpoint", resume=resume)
        else:
            out, summary = quantize_to_dir(
                model_name, method, config, used_calib, ctx.out_dir / "checkpoint", device=device,
                on_layer=ctx.on_layer, should_stop=ctx.should_stop, on_start=ctx.on_start, resume=resume,
                on_metrics=ctx.on_metrics, on_progress=ctx.on_progress, on_plan=ctx.on_plan,
            )
        if summary.get("cancelled") or ctx.should_stop():  # a cancel that came in as the last stage finished
            raise JobCancelled
        ctx.set_phase("packing the archive")
        public_report(out)
        write_model_card(out, model_name)
        bits = summary.get("total_bits_per_weight")
        stamp = time.strftime("%Y%m%d-%H%M", time.gmtime())
        name = archive_name or "-".join([_slug(model_name), method, *([f"{bits:.2f}bit"] if bits else []), stamp])
        archive = pack_checkpoint(out, ctx.out_dir / f"{name}.zip")
        return {
            "summary": summary, "checkpoint_dir": str(out), "archive": str(archive),
            "checkpoint_bytes": checkpoint_size(out), "archive_bytes": archive.stat().st_size,
            "source_model": model_name, "method": method, "config": config.to_dict(),
            "calib": {**calib.to_dict(), "text": "uploaded file" if calib_text is not None else calib.text},
        }

    return task


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", os.path.basename(text.rstrip("/\\")) or "model").strip("-")[:40] or "model"
