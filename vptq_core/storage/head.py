"""The LM head of a loaded quantized model at 8 (or 4) bits: a run-time choice, the checkpoint unchanged.

A checkpoint keeps its LM head in the model dtype unless it was quantized with ``--quantize-head`` (the
public VPTQ layout stores it that way too). In a decode step on a CPU the head is then a large part of the
time: SmolLM2's 49152 x 576 head is ~21% of the model's linear weights, a 0.5B-class model's 151936 x 896 head
~28%, and it reads bf16 on both sides of the side-by-side chat. The head is also the most sensitive matrix:
quantized alone with the blocks' own recipes, SmolLM2's wiki / pydocs perplexity went to 1.67x / 2.68x bf16
(VPTQ v6 k4096), 1.30x / 1.65x (v4 k4096) and 1.08x / 1.13x (GPTQ 4-bit g128), while this module's 8-bit
head gave 1.001x / 1.001x (bench/head_quality.py: 16 windows of 512 tokens per text).

So at load time the head can be replaced by a ``ScalarQLinear`` holding its round-to-nearest codes (asymmetric
grids, groups of ``GROUP_SIZE``), run by the same fused scalar kernels as GPTQ / RTN checkpoints:

- ``head_bits="auto"`` (what ``load_quantized`` does by default): 8 bits when the model runs on the CPU with
  the native kernels available and the head is a plain linear of at least ``AUTO_MIN_WEIGHTS`` weights;
  otherwise the head stays as it is (GPUs multiply the model dtype fast; small heads do not matter);
- ``8`` or ``4``: that many bits wherever the model runs; ``0``: never.

A tied input embedding keeps reading the original matrix (only the head's copy is quantized).
"""

from __future__ import annotations

import torch
from torch import nn

from ..quant.states import ScalarLayerState

HEAD_BITS = ("auto", 0, 4, 8)
GROUP_SIZE = 128
AUTO_MIN_WEIGHTS = 8_000_000  # SmolLM2's head has 28.3 M


def check_head_bits(value: object) -> int | str:
    """``value`` as one of ``HEAD_BITS`` ("auto", 0, 4, 8; digits in a string accepted) or ValueError."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, (int, str)) or value not in HEAD_BITS:
        raise ValueError(f"head_bits must be one of auto, 0, 4, 8 (bits of the LM head at run time), got {value!r}")
    return value


def dense_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head when it is a plain ``nn.Linear`` (not already quantized), else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if type(head) is nn.Linear else None


def resolve_head_bits(model: nn.Module, head_bits: object) -> int:
    """The bits ``quantize_head`` will use for ``model`` (0: the head stays as it is)."""
    head_bits = check_head_bits(head_bits)
    head = dense_head(model)
    if head is None or head_bits == 0:
        return 0
    if head_bits != "auto":
        return int(head_bits)
    from vptq_core.kernels import native

    if head.weight.device.type != "cpu" or head.weight.numel() < AUTO_MIN_WEIGHTS or not native.expected():
        return 0
    return 8


def quantize_head(model: nn.Module, head_bits: object = "auto") -> int:
    """Replace ``model``'s dense LM head by its round-to-nearest ``ScalarQLinear`` (see the module docstring).

    Returns the bits used (0 when the head was left as it is). The replacement has the head's dtype and
    device; ``model.vptq_head_bits`` records the choice."""
    from ..quant.embedding import module_name
    from .modules import module_from_state, set_submodule

    bits = resolve_head_bits(model, head_bits)
    if bits == 0:
        return 0
    head = dense_head(model)
    name = module_name(model, head)
    weight = head.weight.detach()
    with torch.no_grad():
        state = rtn_state(weight, bits, None if head.bias is None else head.bias.float())
        module = module_from_state(state, weight.dtype, device=weight.device)
    set_submodule(model, name, module.eval())
    model.vptq_head_bits = bits
    return bits



def rtn_state(weight: torch.Tensor, bits: int, bias: torch.Tensor | None = None) -> ScalarLayerState:
    """Round-to-nearest of ``weight`` [out, in] in groups of ``GROUP_SIZE``, its scales exact in ``weight``'s dtype
    (the dtype the module holds them in; ``rtn.grid_params``)."""
    from ..quant.rtn import rtn_quantize

    return rtn_quantize(weight.float(), bits, GROUP_SIZE, bias=bias, scale_dtype=weight.dtype)
