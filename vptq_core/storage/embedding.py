"""A quantized input embedding: the rows of a quantized ``[vocab, hidden]`` matrix, looked up by token id.

The matrix is held by a ``VQLinear`` / ``ScalarQLinear`` (the checkpoint's layer kind, same tensors and
packing as any quantized linear): either the embedding's own (``linear``, stored under
``<embedding>.linear.*``) or, for tied weights, the quantized LM head's (``source``, nothing stored twice).
The lookup dequantizes the matrix through the kernels' dequantize op once per device and dtype and keeps
it (``F.embedding`` on it): the checkpoint is small, the run-time copy is the model dtype's size, as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .modules import ScalarQLinear, VQLinear

QUANTIZED = (VQLinear, ScalarQLinear)


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding``-compatible lookup of the rows of a quantized matrix (see the module docstring).

    ``embed_scale`` (Gemma's scaled embeddings) multiplies the rows, as the replaced module did."""

    def __init__(self, linear: nn.Module | None = None, source: nn.Module | None = None,
                 padding_idx: int | None = None, embed_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        if (linear is None) == (source is None):
            raise ValueError("QuantizedEmbedding takes exactly one of linear (its own matrix) or source (the head's)")
        matrix = linear if linear is not None else source
        if not isinstance(matrix, QUANTIZED):
            raise TypeError(f"the quantized matrix must be a VQLinear or ScalarQLinear, got {type(matrix).__name__}")
        self.linear = linear
        self._source = (source,) if source is not None else ()  # a reference, not a submodule: stored once
        self.num_embeddings, self.embedding_dim = matrix.out_features, matrix.in_features
        self.padding_idx = padding_idx
        if embed_scale is not None:
            self.register_buffer("embed_scale", embed_scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = None
        self._cache: tuple | None = None

    @property
    def matrix(self) -> nn.Module:
        return self.linear if self.linear is not None else self._source[0]

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized rows [vocab, hidden] (read-only use: e.g. ``model.get_input_embeddings().weight``)."""
        return self._rows()

    def _rows(self) -> torch.Tensor:
        matrix = self.matrix
        index = matrix._buffers[matrix._INDEX]  # a new index tensor (or a move) means new rows
        if self._cache is None or self._cache[0] is not index:
            with torch.no_grad():
                self._cache = (index, matrix.dequantize())
        return self._cache[1]

    def _apply(self, fn, recurse=True):
        self._cache = None
        return super()._apply(fn, recurse)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self._rows(), self.padding_idx)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(rows.dtype)
        return rows

    def extra_repr(self) -> str:
        where = "own" if self.linear is not None else "the LM head's"
        return f"{self.num_embeddings}, {self.embedding_dim}, rows from {where} {type(self.matrix).__name__}"


def quantized_embedding_for(original: nn.Embedding, linear: nn.Module | None = None,
                            source: nn.Module | None = None) -> QuantizedEmbedding:
    """A ``QuantizedEmbedding`` replacing ``original`` (its padding index and embedding scale kept)."""
    scale = getattr(original, "embed_scale", None)
    if scale is not None and not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale))
    if scale is not None and scale.is_meta:
        raise ValueError("the embedding scale is on the meta device; build the model with its buffers")
    matrix = linear if linear is not None else source
    if matrix is not None and (matrix.out_features, matrix.in_features) != tuple(original.weight.shape):
        raise ValueError(f"quantized embedding is {(matrix.out_features, matrix.in_features)}, the model's "
                         f"embedding {tuple(original.weight.shape)}")
    return QuantizedEmbedding(linear=linear, source=source, padding_idx=original.padding_idx, embed_scale=scale)
