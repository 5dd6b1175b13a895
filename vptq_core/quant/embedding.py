"""Quantizing the LM head and the input embedding (an option; by default both stay in the model dtype).

The LM head is a linear like the block linears: its Hessian ``H = 2XᵀX/n`` comes from its own inputs, the
final-norm outputs of the (already quantized) model on the calibration windows, and the method's
``quantize_linear`` quantizes it (VPTQ codebooks, GPTQ / RTN integer grids). The input embedding
``E [vocab, hidden]`` has the head's orientation (one row per token) but no input distribution to weigh its
columns by: it is quantized with ``H = I`` (plain weighted k-means and nearest-centroid assignment for VPTQ,
round-to-nearest for the scalar grids). With tied weights (SmolLM2) one quantized matrix serves both: the
head's, and the embedding reads its rows.

Which parts: ``EmbeddingParts(head, embedding)``; ``quantize_embeddings`` returns the states, the
dequantized weights (for a fake-quantized model) and their errors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from .hessian import HessianAccumulator
from .methods import Method, QuantResult

TIED = "tied"  # the embedding's entry when it reads the head's quantized rows


@dataclass(frozen=True)
class EmbeddingParts:
    """What to quantize besides the decoder blocks."""

    head: bool = False
    embedding: bool = False

    def __post_init__(self) -> None:
        for name in ("head", "embedding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def any(self) -> bool:
        return self.head or self.embedding

    def to_dict(self) -> dict:
        return {"head": self.head, "embedding": self.embedding}


def module_name(model: nn.Module, module: nn.Module | None) -> str | None:
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def head_and_embedding_names(model: nn.Module) -> tuple[str, str, bool]:
    """(LM head module name, input embedding module name, tied?) of a transformers causal LM."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head_name, embed_name = module_name(model, head), module_name(model, embed)
    if not isinstance(head, nn.Linear) or head_name is None:
        raise ValueError(f"{type(model).__name__} has no linear LM head (get_output_embeddings); cannot quantize it")
    if not isinstance(embed, nn.Embedding) or embed_name is None:
        raise ValueError(f"{type(model).__name__} has no nn.Embedding input embedding; cannot quantize it")
    tied = head.weight is embed.weight or f"{head_name}.weight" in set(getattr(model, "all_tied_weights_keys", None)
                                                                       or {})
    return head_name, embed_name, tied


def final_norm(model: nn.Module, blocks_prefix: str) -> nn.Module | None:
    """The norm between the last block and the head (``<parent of the blocks>.norm``), or None."""
    parent = blocks_prefix.rpartition(".")[0]
    owner = model.get_submodule(parent) if parent else model
    norm = getattr(owner, "norm", None)
    return norm if isinstance(norm, nn.Module) else None


def head_hessian(head_inputs: torch.Tensor, device: torch.device | str, batch: int = 4) -> torch.Tensor:
    """``H = 2XᵀX/n`` of the head's inputs [n, seq, hidden] (float32, on ``device``)."""
    acc = HessianAccumulator(head_inputs.shape[-1], device=device)
    for i in range(0, head_inputs.shape[0], batch):
        acc.add_batch(head_inputs[i : i + batch].to(device, torch.float32))
    return acc.hessian


def normed_block_outputs(model: nn.Module, blocks_prefix: str, outputs: torch.Tensor, device,
                         batch: int = 4) -> torch.Tensor:
    """The head's inputs from the last block's outputs [n, seq, hidden]: the final norm applied (float32)."""
    norm = final_norm(model, blocks_prefix)
    if norm is None:
        return outputs.float()
    norm = copy.deepcopy(norm).to(device)  # a copy: the model's own final norm stays where it is
    parts = []
    with torch.no_grad():
        for i in range(0, outputs.shape[0], batch):
            x = outputs[i : i + batch].to(device)
            param = next(norm.parameters(), None)
            y = norm(x.to(param.dtype) if param is not None else x)
            parts.append(y.float().cpu())
    return torch.cat(parts)


@dataclass
class EmbeddingResult:
    """Full module name -> ``QuantResult`` (the embedding maps to ``TIED`` when it shares the head's)."""

    results: dict[str, QuantResult | str] = field(default_factory=dict)
    seconds: float = 0.0

    def states(self) -> dict:
        return {name: r.state for name, r in self.results.items() if isinstance(r, QuantResult)}


def quantize_embeddings(model: nn.Module, head_inputs: torch.Tensor | None, method: Method, config,
                        parts: EmbeddingParts, device: torch.device | str = "cpu") -> EmbeddingResult:
    """Quantize the LM head (Hessian from ``head_inputs`` [n, seq, hidden], the head's calibration inputs)
    and/or the input embedding (``H = I``) of ``model`` with ``method``'s ``quantize_linear``. The model is
    not changed (``apply_fake`` does that). Tied weights: asking for either quantizes the shared matrix once,
    as the head (with its Hessian), and the embedding maps to ``TIED``."""
    import time

    if method.quantize_linear is None:
        raise ValueError(f"method {method.name!r} quantizes whole blocks (no per-linear quantizer); quantize the "
                         "LM head and embedding with vptq, gptq or rtn")
    t0 = time.perf_counter()
    head_name, embed_name, tied = head_and_embedding_names(model)
    out = EmbeddingResult()
    device = torch.device(device)
    want_head = parts.head or (parts.embedding and tied)
    if want_head:
        if head_inputs is None:
            raise ValueError("quantizing the LM head needs its calibration inputs (head_inputs)")
        head = model.get_submodule(head_name)
        W = head.weight.detach().to(device, torch.float32)
        H = head_hessian(head_inputs, device)
        bias = None if head.bias is None else head.bias.detach().to(device, torch.float32)
        out.results[head_name] = method.quantize_linear(W, H, config, bias, {})
        del W, H
        if parts.embedding and tied:
            out.results[embed_name] = TIED
    if parts.embedding and not tied:
        E = model.get_submodule(embed_name).weight.detach().to(device, torch.float32)
        eye = torch.eye(E.shape[1], dtype=torch.float32, device=device)
        out.results[embed_name] = method.quantize_linear(E, eye, config, None, {})
        del E
    out.seconds = time.perf_counter() - t0
    return out


def untie_head(model: nn.Module, weight: torch.Tensor) -> None:
    """Give a tied model's LM head a weight of its own (``weight``), and tell the config and transformers (which
    would tie it again, and checkpoint writers, which would leave it out) that it is no longer tied."""
    head = model.get_output_embeddings()
    head.weight = nn.Parameter(weight, requires_grad=False)
    model.config.tie_word_embeddings = False
    if hasattr(model, "all_tied_weights_keys"):
        model.all_tied_weights_keys = {}


def apply_fake(model: nn.Module, result: EmbeddingResult) -> None:
    """Put the dequantized head / embedding weights into ``model`` (a fake-quantized model). A tied model
    whose head alone was quantized is untied first: its embedding keeps the original rows."""
    head_name, embed_name, tied = head_and_embedding_names(model)
    head, embed = model.get_submodule(head_name), model.get_submodule(embed_name)
    if tied and head_name in result.results and embed_name not in result.results:
        untie_head(model, head.weight.detach().clone())
    for name, module in ((head_name, head), (embed_name, embed)):
        r = result.results.get(name)
        if isinstance(r, QuantResult):
            with torch.no_grad():
                module.weight.data = r.weight.to(module.weight.device, module.weight.dtype).contiguous()
    if result.results.get(embed_name) == TIED:
        embed.weight = head.weight
