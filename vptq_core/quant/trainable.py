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


def _native_codebooks(*tensors: torch.Tensor):
    """The native extension when its codebook gather / sum can take these float32 CPU tensors, else None (the torch
    path: no compiler, a failed build, ``VPTQ_NATIVE=0``, another device or dtype)."""
    if any(t.device.type != "cpu" for t in tensors) or any(
            t.is_floating_point() and t.dtype != torch.float32 for t in tensors):
        return None
    from vptq_core.kernels import native

    usable, _ = native.status()
    return native._ext() if usable else None


def code_rows(codes: torch.Tensor, k: int) -> torch.Tensor:
    """Codes [G, R, group_size] (int16 as uint16 patterns) -> codebook rows g * k + code, int64, flat in
    [R, G, group_size] order: one per vector of the stored-order weight, rows of vectors first."""
    # the offsets from ``codes`` itself (no factory call with a device): a backward runs this on autograd's
    # device thread, where only the tensor's own methods are sure to reach its device
    offsets = (codes.new_ones(codes.shape[0], dtype=torch.int64).cumsum(0) - 1).mul_(k).view(-1, 1, 1)
    return (as_index(codes) + offsets).permute(1, 0, 2).reshape(-1)


def expand_codes(codebook: torch.Tensor, codes: torch.Tensor, k: int, out: int) -> torch.Tensor:
    """The stored-order weight W [out, G * group_size] of codes [G, R, group_size] in codebook [G * k, v]:
    ``W[r * v + j, g * group_size + c] = codebook[g * k + codes[g, r, c], j]``."""
    ext = _native_codebooks(codebook)
    if ext is not None and codes.is_contiguous():
        return ext.codebook_expand(codebook, codes, k, out)
    G, R, gs = codes.shape
    v = codebook.shape[1]
    vectors = codebook.index_select(0, code_rows(codes, k))  # [R * G * gs, v]
    return vectors.view(R, G * gs, v).permute(0, 2, 1).reshape(R * v, G * gs)[:out]


def sum_into_codes(grad: torch.Tensor, codes: torch.Tensor, k: int, v: int) -> torch.Tensor:
    """``expand_codes``' backward: grad [out, G * group_size] -> the codebook's gradient [G * k, v], each entry the
    sum of the weight gradients at the places its codebook row was gathered to."""
    ext = _native_codebooks(grad)
    if ext is not None and codes.is_contiguous():
        return ext.codebook_sum(grad.contiguous(), codes, k, v)
    G, R, gs = codes.shape
    padded = grad.new_zeros(R * v, G * gs)
    padded[: grad.shape[0]] = grad
    vectors = padded.view(R, v, G * gs).permute(0, 2, 1).reshape(-1, v)
    return grad.new_zeros(G * k, v).index_add_(0, code_rows(codes, k), vectors)


class _Expand(torch.autograd.Function):
    """codebook [G * k, v] -> ``expand_codes``; the backward sums the weight's gradient into the codebook rows
    (``sum_into_codes``). Nothing but the codes (held by the layer anyway) is kept for it."""

    @staticmethod
    def forward(ctx, codebook: torch.Tensor, codes: torch.Tensor, k: int, out: int) -> torch.Tensor:
        ctx.save_for_backward(codes)
        ctx.k, ctx.v = k, codebook.shape[1]
        return expand_codes(codebook, codes, k, out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (codes,) = ctx.saved_tensors
        return sum_into_codes(grad, codes, ctx.k, ctx.v), None, None, None


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
        self.spec = state.spec
        self.params = nn.ParameterDict({
            key: nn.Parameter(getattr(state, key).detach().to(device, torch.float32).clone())
            for key in TRAINED_TENSORS if getattr(state, key) is not None
        })
        self.bias = bias
        # The codes as stored (int16 [G, R, group_size] for a state on this device: the state's own tensor, no
        # copy); each forward gathers the weight from them, so a whole model's layers hold 2 bytes per vector.
        self._codes = state.indices.to(device).contiguous()
        self._res_codes = None if state.res_indices is None else state.res_indices.to(device).contiguous()
        self._outlier_codes = None if state.outlier_indices is None else state.outlier_indices.to(device).contiguous()
        self._perm = None if state.perm is None else as_index(state.perm).to(device)

    def _expand(self, key: str, codes: torch.Tensor, k: int, v: int) -> torch.Tensor:
        codebook = self.params[key].reshape(-1, v)
        if codebook.requires_grad and torch.is_grad_enabled():
            return _Expand.apply(codebook, codes, k, self.spec.out_features)
        return expand_codes(codebook, codes, k, self.spec.out_features)

    def stored_weight(self) -> torch.Tensor:
        """Ŵp [out, in] float32 in stored column order (``Ŵ = Ŵp[:, argsort(perm)]``), differentiable."""
        spec = self.spec
        weight = self._expand("centroids", self._codes, spec.num_centroids, spec.vector_len)
        if self._res_codes is not None:
            weight = weight + self._expand("res_centroids", self._res_codes, spec.num_res_centroids, spec.vector_len)
        if self._outlier_codes is not None:
            outliers = self._expand("outlier_centroids", self._outlier_codes, spec.num_outlier_centroids,
                                    spec.outlier_vector_len)
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
            if isinstance(state, VQLayerState):
                state.snap_codebooks()  # 8-bit codebooks: back on the grid the checkpoint stores
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
