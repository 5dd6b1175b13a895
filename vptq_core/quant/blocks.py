"""Where a causal LM keeps its decoder blocks, and which ``nn.Linear`` projections each block holds."""

from __future__ import annotations

from torch import nn


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of a causal LM (llama, qwen2, mistral, phi3, gemma, ... families)."""
    candidates = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
                  "model.language_model.layers")
    for path in candidates:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    raise ValueError(
        f"cannot find the decoder blocks of {type(model).__name__}; supported: models whose blocks live at "
        "model.layers (llama, qwen2, mistral, ...)"
    )


def blocks_prefix(model: nn.Module) -> str:
    blocks = decoder_blocks(model)
    for name, module in model.named_modules():
        if module is blocks:
            return name
    raise AssertionError("decoder blocks not found among named modules")


def block_linears(block: nn.Module) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` projections of one block, by name relative to the block, in definition order."""
    linears = {name: m for name, m in block.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise ValueError(f"block {type(block).__name__} holds no nn.Linear projections; cannot quantize it")
    return linears
