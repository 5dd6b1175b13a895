"""What a run hands out: a report per quantized linear, the run's result, a finished block, a resume point.

Plain data, imported by the methods (which publish reports) and the pipeline (which collects them) alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from .bits import BitsInfo
from .timing import Timings

OnLayer = Callable[["LayerReport"], None]
OnStep = Callable[[str, int, int, float], None]  # (phase, step, steps, loss) of an after-model hook
ShouldStop = Callable[[], bool]


@dataclass
class LayerReport:
    """Metrics for one quantized linear, published through ``on_layer`` as soon as it is quantized.

    ``rel_output_error`` (``||Y_q - Y||² / ||Y||²`` of the whole block on calibration data) is known only
    once every linear of the block is quantized: it is filled in on the same object when the block ends.
    """

    block: int
    name: str  # full module name, e.g. "model.layers.3.mlp.down_proj"
    module: str  # name inside the block, e.g. "mlp.down_proj"
    out_features: int
    in_features: int
    method: str
    rel_proxy_loss: float
    rel_weight_error: float
    index_bits: float
    total_bits: float
    seconds: float
    rel_output_error: float | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class QuantizeResult:
    method: str
    config: dict
    states: dict  # full module name -> VQLayerState | ScalarLayerState
    reports: list[LayerReport]
    bits: BitsInfo
    seconds: float
    cancelled: bool = False
    blocks_done: int = 0
    # wall seconds per phase: capture_inputs, hessians_targets (original block forwards with Hessian hooks),
    # the method's phases (VPTQ: kmeans, inverse_hessian, sweep; scalar: quantize; lrq: lrq_train), its
    # after-block hooks (finetune, act_calibration), block_outputs (quantized block forwards)
    timings: Timings = field(default_factory=Timings)
    # after-model hook phase -> its metrics (distillation); "calibration": why no window was self-written
    model_metrics: dict = field(default_factory=dict)
    # full tensor name -> float32 CPU copy of each finished block's 1-D float tensors outside the packed linears
    # (norm weights, other biases) as training left them, kept like ``states`` (not with keep_states=False):
    # the checkpoint stores these, not the original's
    dense: dict = field(default_factory=dict)

    def timed(self, phase: str):
        """``with result.timed(phase): ...`` adds the wall time to ``timings[phase]``."""
        return self.timings.timed(phase)

    def summary(self) -> dict:
        return {
            "method": self.method, "config": self.config, "layers": len(self.reports),
            "blocks_done": self.blocks_done, "cancelled": self.cancelled, "seconds": round(self.seconds, 2),
            "timings": {k: round(v, 2) for k, v in self.timings.items()},
            "index_bits_per_weight": self.bits.index_bits_per_weight if self.bits.weights else None,
            "total_bits_per_weight": self.bits.total_bits_per_weight if self.bits.weights else None,
            **({"model_metrics": self.model_metrics} if self.model_metrics else {}),
        }


@dataclass
class BlockDone:
    """What ``on_block`` receives when block ``index`` is finished: its layer states and reports (full module
    names), the calibration activations entering the next block (``outputs``, float32), the run so far
    (``result``: timings, bits, seconds until now in ``seconds``) and the CPU random state after the block."""

    index: int
    states: dict
    reports: list[LayerReport]
    outputs: torch.Tensor
    result: QuantizeResult
    seconds: float
    rng_state: torch.Tensor
    fp_outputs: torch.Tensor | None = None  # target_chain "fp": the original model's activations there
    dense: dict = field(default_factory=dict)  # the block's entries of ``QuantizeResult.dense``


@dataclass
class ResumePoint:
    """Where an interrupted run stopped: ``blocks_done`` finished blocks, the activations entering block
    ``blocks_done`` (float32 [n, seq, hidden]), the finished blocks' reports and trained 1-D tensors, and the
    run's timings, bits and seconds so far. ``quantize_model(..., resume=point)`` continues from there; the
    states of the finished blocks are not needed (they were handed to ``on_block`` by the interrupted run)."""

    blocks_done: int
    inputs: torch.Tensor
    reports: list[LayerReport] = field(default_factory=list)
    timings: dict = field(default_factory=dict)
    seconds: float = 0.0
    bits: BitsInfo = field(default_factory=lambda: BitsInfo(0, 0, 0))
    rng_state: torch.Tensor | None = None
    fp_inputs: torch.Tensor | None = None  # target_chain "fp": the original model's activations entering the block
    dense: dict = field(default_factory=dict)  # the finished blocks' ``QuantizeResult.dense`` entries
