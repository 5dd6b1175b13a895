"""What one ``quantize_model`` call holds while it goes through its stages (quant/pipeline.py lists them):
the model and its calibration windows, the method and its config, what the run needs, where it works, the
caller's callbacks, and the result each stage adds to."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .methods import Method, RunNeeds
from .progress import Progress
from .results import BlockDone, OnLayer, OnStep, QuantizeResult, ResumePoint, ShouldStop
from .source import BlockWeights


@dataclass
class Run:
    """The state of one run. Stages read it and leave what the next stage needs (``calib_ids`` after the
    self-written calibration, ``config`` after the plan, ``earlier_seconds`` once a resume is applied)."""

    model: nn.Module
    calib_ids: torch.Tensor  # [n, seq]
    method: Method
    config: Any
    needs: RunNeeds
    device: torch.device
    result: QuantizeResult
    on_layer: OnLayer
    should_stop: ShouldStop
    on_step: OnStep | None = None
    on_metrics: Callable[[str, dict], None] | None = None  # a plan's metrics as soon as it is made
    on_block: Callable[[BlockDone], None] | None = None
    skip: Callable[[str], bool] | None = None
    weights: BlockWeights | None = None  # streamed blocks (``models.open_streaming``)
    capture_dtype: torch.dtype | None = None
    resume: ResumePoint | None = None
    keep_states: bool = True
    reference: nn.Module | None = None  # the original, for the after-model hooks
    # or what loads it as they start: then no caller holds the original through the run (a call with many
    # arguments keeps them in a dict on the caller's stack until it returns, whatever the callee drops)
    load_reference: Callable[[], nn.Module] | None = None
    teacher: dict | None = None  # the original's top-k on the windows it wrote itself (``sampled_calibration``)
    start: float = field(default_factory=time.perf_counter)
    earlier_seconds: float = 0.0  # seconds the interrupted run had spent before this one resumed it
    plan_windows: int = 0  # windows the plan hooks measure on (0: their own default; a time budget's plan)
    progress: Progress | None = None  # the stage the run is in, for stages that count their own steps

    @property
    def resumed(self) -> bool:
        """The run continues an interrupted one from saved activations (at least one finished block)."""
        return self.resume is not None and self.resume.blocks_done > 0

    def seconds(self) -> float:
        """Seconds of the whole run so far, the interrupted run's included."""
        return self.earlier_seconds + time.perf_counter() - self.start
