"""Float32 linears through oneDNN with pre-packed weights, for the few-row products of batched sampling.

Torch multiplies float32 on the CPU through MKL's sgemm. On an AMD EPYC (Zen 3, AVX2, 2 threads) oneDNN with its
weights packed once (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``, the pair torch's own
compiler uses) took up to 2.3x less time at the 24-row products of sampling 24 windows at once (all but SmolLM2's
small k/v projections, 0.97x, gained 1.1x or more): SmolLM2's gate/up
0.595 -> 0.439 ms, its LM head 27.1 -> 13.0 ms, Gemma-3-270M's head 187 -> 82 ms (about the same at 512 rows,
slower for SmolLM2's small projections at 1 row; ``bench/packed_dense.py``, ``bench/results/packed_dense_zen3.txt``).
In the "2.5 bits" preset on SmolLM2 the self-written calibration (24 windows of 512 tokens) took 69 s instead of
100 (``bench/sampling.py`` times the paths side by side). ``packed_linears`` swaps such modules in for the
length of a ``with`` block; the model itself is restored after, and everything falls back to the model as it is
where the ops are missing or disagree with ``F.linear``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

PACK_ROWS = 24  # the row count oneDNN packs the weights for (any count works; sampling's batch)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether packed oneDNN linears run here and agree with ``F.linear`` (checked once, on a small product)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w, b, x = (torch.randn(*s, generator=gen) for s in ((48, 40), (48,), (5, 40)))
        got = ops._linear_pointwise(x, ops._reorder_linear_weight(w, 5), b, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except Exception:  # noqa: BLE001 - an op missing or failing in this build: torch's own path
        return False


class PackedLinear(nn.Module):
    """``linear`` (a float32 CPU nn.Linear) with its weight packed once for oneDNN; same outputs to float32
    rounding. Inference only: the packed copy does not follow later changes of the weight and has no gradient."""

    def __init__(self, linear: nn.Linear, rows: int = PACK_ROWS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packable(module: nn.Module) -> bool:
    """A plain float32 nn.Linear on the CPU without hooks (a subclass, e.g. a quantized layer, or a module an
    offloading hook feeds is left as it is)."""
    hooked = module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None)
    return (type(module) is nn.Linear and not hooked and module.weight.dtype == torch.float32
            and module.weight.device.type == "cpu")


@contextlib.contextmanager
def packed_linears(model: nn.Module, enabled: bool = True, rows: int = PACK_ROWS) -> Iterator[int]:
    """Within the block, every ``packable`` linear of ``model`` (the LM head too) runs as a ``PackedLinear``;
    yields how many were swapped (0 when ``enabled`` is false or the ops are unavailable). For inference under
    ``torch.no_grad``: the packed copies take as much memory again as the swapped weights, for the block only."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    if enabled and not torch.is_grad_enabled() and available():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if packable(child):
                    swapped.append((parent, name, child))
    try:
        packed: dict[int, PackedLinear] = {}  # one packed copy of a module found under two parents
        for parent, name, child in swapped:
            if id(child) not in packed:
                packed[id(child)] = PackedLinear(child, rows)
            setattr(parent, name, packed[id(child)])
        yield len(packed)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
