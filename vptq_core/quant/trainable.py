"""The trainable forms of quantized linears, and the helpers that swap them into a model and write the
training back: what layer-wise fine-tuning and end-to-end distillation train.

``CodebookLinear`` is the trainable form of a ``VQLayerState``: its codebooks (and normalisation tensors) as
parameters, the indices fixed; the weight is a row gather from each codebook in stored (permuted) column order,
and the input is permuted instead of the weight's columns, which is far cheaper to differentiate than
``kernels.reference.vq_expand`` with the same values (tested against ``VQLayerState.dequantize``).
``ScaleLinear`` is the trainable form of a ``ScalarLayerState``: its per-group scales, as log-scales.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vptq_core.kernels.reference import as_index

from .act_quant import quantize_activations
from .device import drop_unheld, return_freed_memory
from .states import ScalarLayerState, VQLayerState

# The float tensors of a VQ layer that training moves (indices, permutation and shapes never change).
TRAINED_TENSORS = ("centroids", "res_centroids", "outlier_centroids", "weight_scale", "weight_bias")


# device -> float32 ones that the row-sum matrices of the trainable layers alive share (held by those layers)
_ONES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_ones(n: int, device: torch.device) -> torch.Tensor:
    """At least n float32 ones on ``device``: the tensor the trainable layers alive share, a longer one when it is
    too short. Every row-sum matrix's values are ones, one per codebook row gathered: sliced from this tensor,
    a whole model's layers hold about one layer's worth instead of a copy each."""
    device = torch.device(device)
    ones = _ONES.get(device)
    if ones is None or ones.numel() < n:
        ones = torch.ones(n, dtype=torch.float32, device=device)
        _ONES[device] = ones
    return ones


def row_sum_matrix(rows: torch.Tensor, num_rows: int, ones: torch.Tensor | None = None) -> torch.Tensor:
    """The [num_rows, n] 0/1 matrix (sparse CSR, int32 indices) with a 1 at (rows[j], j): times a [n, v] matrix it
    sums each group of rows gathered from the same codebook row. ``ones``: float32 ones, at least n, whose first
    n become its values (``shared_ones``; by default its own)."""
    order = torch.argsort(rows, stable=True)
    crow = F.pad(torch.bincount(rows, minlength=num_rows).cumsum(0), (1, 0))
    values = torch.ones(rows.numel(), dtype=torch.float32, device=rows.device) if ones is None else ones[: rows.numel()]
    with warnings.catch_warnings():  # "sparse CSR support is in beta": CSR x dense is all this needs
        warnings.simplefilter("ignore", UserWarning)
        return torch.sparse_csr_tensor(crow.to(torch.int32), order.to(torch.int32), values,
                                       size=(num_rows, rows.numel()))


def _rows32(rows: torch.Tensor) -> torch.Tensor:
    """Codebook row numbers as int32 (a layer's codebooks hold far fewer than 2^31 rows)."""
    return rows.to(torch.int32)


class _RowGather(torch.autograd.Function):
    """codebook [K, v] -> codebook[rows] [n, v], whose backward sums the n row gradients into the K codebook rows
    as one sparse x dense product (``row_sum_matrix``) instead of autograd's index_add, which is several times
    slower on the CPU at the row counts of a model's codebooks."""

    @staticmethod
    def forward(ctx, codebook: torch.Tensor, rows: torch.Tensor, row_sums: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.row_sums, ctx.num_rows = row_sums, codebook.shape[0]
        return codebook.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad.dtype != ctx.row_sums.dtype:  # e.g. a reduced-precision gradient: the plain sum
            (rows,) = ctx.saved_tensors
            return grad.new_zeros(ctx.num_rows, grad.shape[1]).index_add_(0, rows, grad), None, None
        return torch.sparse.mm(ctx.row_sums, grad.contiguous()), None, None


class CodebookLinear(nn.Module):
    """A VQ linear whose float tensors are ``nn.Parameter``s (float32 copies of ``state``'s), indices fixed.

    forward(x) = F.linear(x, state.dequantize(), bias) up to float rounding, computed as
    ``F.linear(x[..., perm], Wp)`` with ``Wp`` [out, in] the stored-order weight gathered row by row from
    the codebooks. ``bias``: the replaced linear's own bias ``Parameter`` (shared, trained as a dense tensor).
    """

    def __init__(self, state: VQLayerState, bias: nn.Parameter | None = None, device=None) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else state.centroids.device
        self.state = state
        self.spec = spec = state.spec
        self.params = nn.ParameterDict({
            key: nn.Parameter(getattr(state, key).detach().to(device, torch.float32).clone())
            for key in TRAINED_TENSORS if getattr(state, key) is not None
        })
        self.bias = bias
        G, k = spec.group_num, spec.num_centroids
        offsets = (torch.arange(G, device=device) * k).view(G, 1, 1)
        # [G, R, gs] -> [R, G, gs]: one codebook row per vector, in stored column order; int32, half of int64's
        # bytes for what a whole model's layers hold while distillation trains them all
        self._rows = _rows32((as_index(state.indices).to(device) + offsets).permute(1, 0, 2).reshape(-1))
        self._res_rows = None
        if state.res_indices is not None:
            res_offsets = offsets // k * spec.num_res_centroids
            self._res_rows = _rows32((as_index(state.res_indices).to(device) + res_offsets).permute(1, 0, 2)
                                     .reshape(-1))
        self._outlier_rows = None
        if state.outlier_indices is not None:
            self._outlier_rows = _rows32(as_index(state.outlier_indices[0]).to(device).reshape(-1))
        self._perm = None if state.perm is None else as_index(state.perm).to(device)
        self._row_sums: dict[str, torch.Tensor] = {}  # codebook name -> row_sum_matrix, built at the first step
        self._ones: torch.Tensor | None = None  # the row-sum matrices' values (``shared_ones``), held here

    def _expand(self, key: str, rows: torch.Tensor, v: int, n_rows: int, cols: int, out: int):
        codebook = self.params[key].reshape(-1, v)
        if codebook.requires_grad and codebook.device.type == "cpu" and torch.is_grad_enabled():
            if key not in self._row_sums:
                if self._ones is None or self._ones.numel() < rows.numel():
                    self._ones = shared_ones(rows.numel(), rows.device)
                self._row_sums[key] = row_sum_matrix(rows, codebook.shape[0], self._ones)
            vectors = _RowGather.apply(codebook, rows, self._row_sums[key])
        else:
            vectors = codebook.index_select(0, rows)  # [n_rows * cols, v]
        return vectors.view(n_rows, cols, v).permute(0, 2, 1).reshape(n_rows * v, cols)[:out]

    def stored_weight(self) -> torch.Tensor:
        """Ŵp [out, in] float32 in stored column order (``Ŵ = Ŵp[:, argsort(perm)]``), differentiable."""
        spec = self.spec
        cols = spec.group_num * spec.group_size
        weight = self._expand("centroids", self._rows, spec.vector_len, spec.rows, cols, spec.out_features)
        if self._res_rows is not None:
            weight = weight + self._expand("res_centroids", self._res_rows, spec.vector_len, spec.rows, cols,
                                           spec.out_features)
        if self._outlier_rows is not None:
            outliers = self._expand("outlier_centroids", self._outlier_rows, spec.outlier_vector_len,
                                    spec.outlier_rows, spec.outlier_size, spec.out_features)
            weight = torch.cat([outliers, weight], dim=1)
        p = self.params
        if "weight_scale" in p:
            scale = p["weight_scale"] if self._perm is None else p["weight_scale"][self._perm]
            weight = weight * scale
        if "weight_bias" in p:
            shift = p["weight_bias"] if self._perm is None else p["weight_bias"][self._perm]
            weight = weight + shift
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._perm is not None:
            x = x.index_select(-1, self._perm)
        return F.linear(x, self.stored_weight(), self.bias)

    def trained(self) -> dict[str, torch.Tensor]:
        """The current float tensors, detached, in the state's dtype and on its device."""
        return {key: p.detach().to(getattr(self.state, key).device, getattr(self.state, key).dtype).clone()
                for key, p in self.params.items()}

    def trained_state(self) -> VQLayerState:
        """A copy of the state with the current float tensors (the state itself is not changed)."""
        return dataclasses.replace(self.state, **self.trained())


class ScaleLinear(nn.Module):
    """A scalar-quantized linear whose per-group scales train (as log-scales), codes and zero points fixed.

    forward(x) = F.linear(q(x), scales[:, g] * (codes - zeros[:, g]), bias), with ``q`` the state's activation
    fake-quantization (W4A8 / W8A8; straight-through, as at run time) and ``scales = scales0 * exp(log_scale)``:
    the step ``distill_lr`` moves each scale by a fraction of itself, whatever its magnitude. The codes and
    zero points stay on their integer grid, so the packed format holds the trained layer exactly.
    """

    def __init__(self, state: ScalarLayerState, bias: nn.Parameter | None = None, device=None) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else state.scales.device
        self.state = state
        self._scales0 = state.scales.detach().to(device, torch.float32).clone()
        self.params = nn.ParameterDict({"log_scale": nn.Parameter(torch.zeros_like(self._scales0))})
        group = torch.arange(state.in_features, device=device) // state.group_size
        self._group = None if self._scales0.shape[1] == 1 else group
        zeros = state.zeros.detach().to(device, torch.float32)
        self._centered = state.codes.to(device, torch.float32) - (zeros if self._group is None else zeros[:, group])
        self.bias = bias

    def scales(self) -> torch.Tensor:
        return self._scales0 * torch.exp(self.params["log_scale"])

    def stored_weight(self) -> torch.Tensor:
        """Ŵ [out, in] float32, differentiable in the log-scales."""
        scales = self.scales()
        return self._centered * (scales if self._group is None else scales[:, self._group])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        st = self.state
        if st.act_bits < 16:
            x = quantize_activations(x, st.act_bits, st.act_granularity, st.act_scale)
        return F.linear(x, self.stored_weight(), self.bias)

    def trained(self) -> dict[str, torch.Tensor]:
        """The current scales, detached, in the state's dtype and on its device."""
        ref = self.state.scales
        return {"scales": self.scales().detach().to(ref.device, ref.dtype).clone()}

    def trained_state(self) -> ScalarLayerState:
        return dataclasses.replace(self.state, **self.trained())


def trainable_linear(state: VQLayerState | ScalarLayerState, bias: nn.Parameter | None = None,
                     device=None) -> CodebookLinear | ScaleLinear:
    """The trainable form of a layer state: codebooks of a VQ layer, log-scales of a scalar one."""
    if isinstance(state, VQLayerState):
        return CodebookLinear(state, bias, device)
    if isinstance(state, ScalarLayerState):
        return ScaleLinear(state, bias, device)
    raise TypeError(f"no trainable form for {type(state).__name__}; expected a VQLayerState or ScalarLayerState")


def dense_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The 1-D float parameters of ``module`` (norm weights and biases), each once: dense tensors of the
    packed checkpoint that training may move."""
    seen: set[int] = set()
    out = []
    for p in module.parameters():
        if p.is_floating_point() and p.dim() == 1 and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def dense_tensors(module: nn.Module, prefix: str = "", packed: Iterable[str] = ()) -> dict[str, torch.Tensor]:
    """Full name (``prefix`` + state-dict name) -> a float32 CPU copy of every 1-D float parameter of ``module``
    outside the packed linears ``packed`` (names relative to ``module``; their biases live in the layer states):
    the norm weights and biases training may have moved, as the checkpoint writer stores them."""
    skip = tuple(f"{name}." for name in packed)
    dot = f"{prefix}." if prefix else ""
    return {f"{dot}{name}": p.detach().to("cpu", torch.float32).clone()
            for name, p in module.named_parameters()
            if p.is_floating_point() and p.dim() == 1 and not p.is_meta and not name.startswith(skip)}


@contextlib.contextmanager
def swapped_in(root: nn.Module, names: Iterable[str], make: Callable[[str, nn.Module], nn.Module]):
    """Replace the submodules ``names`` of ``root`` by ``make(name, module)`` inside the block; the
    originals are put back afterwards (whatever happens). Yields {name: new module}."""
    originals = {name: root.get_submodule(name) for name in names}
    new = {name: make(name, module) for name, module in originals.items()}

    def put(name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(root.get_submodule(parent) if parent else root, child, module)

    try:
        for name, module in new.items():
            put(name, module)
        yield new
    finally:
        for name, module in originals.items():
            put(name, module)


@contextlib.contextmanager
def only_trainable(root: nn.Module, trainable: Iterable[nn.Parameter]):
    """``requires_grad`` only for ``trainable`` among ``root``'s parameters; the flags are restored after."""
    flags = {id(p): (p, p.requires_grad) for p in root.parameters()}
    keep = {id(p) for p in trainable}
    try:
        for p, _ in flags.values():
            p.requires_grad_(id(p) in keep)
        yield
    finally:
        for p, flag in flags.values():
            p.requires_grad_(flag)


def write_states(linears: dict[str, nn.Module], trainables: dict[str, CodebookLinear | ScaleLinear],
                 states: dict[str, VQLayerState | ScalarLayerState]) -> None:
    """Put the trained float tensors into ``states`` (in place: the pipeline's result holds the same objects) and
    copy each linear's bias into its state."""
    with torch.no_grad():
        for name, layer in trainables.items():
            state = states[name]
            for key, value in layer.trained().items():
                setattr(state, key, value)
            linear = linears[name]
            if linear.bias is not None:
                ref = state.bias if state.bias is not None else linear.bias
                state.bias = linear.bias.detach().to(ref.device, ref.dtype).clone()


def write_back(linears: dict[str, nn.Module], trainables: dict[str, CodebookLinear | ScaleLinear],
               states: dict[str, VQLayerState | ScalarLayerState]) -> None:
    """``write_states``, then the dequantized weight into each (fake-quant) linear."""
    write_states(linears, trainables, states)
    with torch.no_grad():
        for name in trainables:
            linear = linears[name]
            linear.weight.data.copy_(states[name].dequantize().to(linear.weight.device, linear.weight.dtype))


@contextlib.contextmanager
def released_weights(linears: dict[str, nn.Module], states: dict[str, VQLayerState | ScalarLayerState]):
    """The fake-quant weights of ``linears`` hold no memory inside the block, and are the dequantized ``states``
    after it, whatever happens: for training that replaces those linears by their trainable forms
    (``swapped_in``), so the weights, which the states give again, are not held through the steps. Inside, each
    weight keeps its shape, dtype and device but is one element broadcast (written into, it raises). The memory
    is given back to the system as the block starts and ends: a weight nothing else holds has its pages dropped
    (``drop_unheld``: a model loaded from safetensors keeps them in the file's mapping after the tensor goes), and
    the heap pages freed are trimmed (``return_freed_memory``: a layer's weight is under glibc's mmap threshold,
    so freeing it alone would leave the resident set as it was)."""
    weights = {name: linear.weight for name, linear in linears.items()}
    storages = [weight.untyped_storage() for weight in weights.values()]
    for weight in weights.values():
        weight.data = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
    drop_unheld(storages)
    return_freed_memory()
    try:
        yield
    finally:
        return_freed_memory()  # what the block freed, before the weights take memory again
        with torch.no_grad():
            for name, weight in weights.items():
                weight.data = states[name].dequantize().to(weight.device, weight.dtype).contiguous()
