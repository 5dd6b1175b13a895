"""Where a causal LM keeps its decoder blocks, and which ``nn.Linear`` projections each block holds.

Families checked end to end (tests/test_families.py): llama, qwen2 (q/k/v biases, untied head), mistral
(sliding window), gemma3 (QK-norm, four norms per block, sliding-window and full-attention layers with
their own masks and rotary embeddings), phi3 (fused ``qkv_proj`` / ``gate_up_proj``). Any model whose blocks
are an ``nn.ModuleList`` at one of ``BLOCK_PATHS`` and whose projections are ``nn.Linear`` goes through the
same code.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

# Where causal LMs keep their decoder blocks (llama, qwen2, mistral, gemma, phi3, ...: model.layers).
BLOCK_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
               "model.language_model.layers")


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The list of transformer blocks of a causal LM (llama, qwen2, mistral, phi3, gemma, ... families)."""
    for path in BLOCK_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return obj
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    kind = f" (model_type {model_type!r})" if model_type else ""
    raise ValueError(
        f"cannot find the decoder blocks of {type(model).__name__}{kind}: the pipeline quantizes models whose "
        f"blocks are an nn.ModuleList at {', '.join(BLOCK_PATHS)} (llama, qwen2, mistral, gemma3, phi3, ...)"
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


def check_linear_shapes(
    model: nn.Module, layer_check: Callable[[int, int], object], what: str,
    skip: Callable[[str], bool] | None = None,
) -> None:
    """Refuse, before any work, a linear whose shape ``layer_check(out_features, in_features)`` rejects.

    ``layer_check`` raises ``ValueError`` for a shape the method cannot quantize (the pipeline passes the
    method's ``bits``, which lays out the layer exactly as the quantizer will); the error names the layer,
    its size, ``what`` (the method and settings) and the reason. Sizes a method handles (VPTQ: out_features
    not a multiple of the vector length is zero-padded, in_features not a multiple of the group count moves
    the remainder to the outlier columns; scalar: a last, shorter group) pass.
    """
    prefix = blocks_prefix(model)
    seen: dict[tuple[int, int], str | None] = {}
    for b, block in enumerate(decoder_blocks(model)):
        for name, linear in block_linears(block).items():
            full = f"{prefix}.{b}.{name}"
            if skip and skip(full):
                continue
            shape = (linear.out_features, linear.in_features)
            if shape not in seen:
                try:
                    layer_check(*shape)
                    seen[shape] = None
                except ValueError as exc:
                    seen[shape] = str(exc)
            if seen[shape] is not None:
                raise ValueError(f"cannot quantize {full} (out_features={shape[0]}, in_features={shape[1]}) with "
                                 f"{what}: {seen[shape]}")


def lookup_params(model: nn.Module) -> int:
    """The parameters of ``model``'s input embedding when its LM head is another tensor (a forward pass looks rows
    up in it, never multiplies by it; ``cost.RunSize.lookup_params``); 0 when the head is tied to it."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if embedding is None or getattr(embedding, "weight", None) is None:
        return 0
    if head is not None and getattr(head, "weight", None) is embedding.weight:
        return 0
    return embedding.weight.numel()


def total_linear_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """(out, in) of every block linear: what the app uses to show bits and size before a run."""
    shapes = []
    for block in decoder_blocks(model):
        shapes.extend((m.out_features, m.in_features) for m in block_linears(block).values())
    return shapes
