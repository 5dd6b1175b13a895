"""Quantized ``nn.Module`` replacements for ``nn.Linear``: VPTQ lookup linears and scalar int-code linears.

``VQLinear`` holds exactly the tensors of the public VPTQ reader (``vptq.layers.vqlinear.VQuantLinear`` with
packed indices), under the same state-dict names, so checkpoints written from it load in the ecosystem::

    centroids.weight      [G, k*v]              model dtype
    res_centroids.weight  [G, k_res*v]          model dtype   (residual codebook)
    indices               [G, R, words] int32   packed (res << b) | idx bit streams
    outlier_centroids.weight [1, k_o*vo]        model dtype   (outlier codebook)
    outlier_indices       [1, Ro, outlier_size] int16 (uint16 patterns)
    perm                  [in] int16 (uint16 patterns)
    weight_scale, weight_bias [in]              model dtype   (norm)
    bias                  [out]                 model dtype

With ``codebook_bits`` 8 in the layer config (this project's extension, which the public reader does not know),
every ``<codebook>.weight`` is int8 and a ``<codebook>.scale`` [G (1 for outliers), v] float32 comes beside it
(``quant.codebook_grid``); the module computes the float table the kernels read from them (``Int8Codebook``).

``ScalarQLinear`` holds bit-packed integer codes with per-(row, group) scales and zero points (RTN, GPTQ, LRQ)
and optionally fake-quantizes its input activations. No dense weight is ever cached: each module binds its
tensors to a ``kernels`` backend once (``kernels.bind_vq`` / ``bind_scalar``: checked, prepared, backend
chosen) and every forward just runs it. Moving the module (``.to``), loading a state dict or setting
``backend`` rebinds; after editing the tensors in place by hand, call ``rebind()``. With autograd on for a
trainable tensor the checked reference path runs instead, and under ``torch.compile`` the registered custom op.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vptq_core.kernels import (
    ScalarSpec,
    ScalarWeights,
    VQSpec,
    VQWeights,
    bind_scalar,
    bind_vq,
    pack_codes,
    pack_indices,
    scalar_dequantize,
    scalar_linear,
    vq_dequantize,
    vq_linear,
)
from vptq_core.kernels.ops import backend_module

from ..quant.act_quant import _EPS as _ACT_EPS
from ..quant.act_quant import asym_token_grid, quantize_activations
from ..quant.codebook_grid import from_grid, to_grid
from ..quant.config import ACT_GRANULARITIES
from ..quant.states import ScalarLayerState, VQLayerState

# Keys of a public ``config_for_layers`` entry; the ignored ones are constructor arguments of the public
# module that carry no information for an inference-only packed checkpoint.
VQ_CONFIG_KEYS = (
    "bias", "enable_norm", "enable_perm", "group_num", "group_size", "in_features", "indices_as_float",
    "is_indice_packed", "num_centroids", "num_res_centroids", "out_features", "outlier_size", "vector_lens",
)
_VQ_OPTIONAL_KEYS = {"bias": False, "enable_norm": False, "enable_perm": False, "indices_as_float": False,
                     "is_indice_packed": True, "outlier_size": 0}
_VQ_IGNORED_KEYS = {"vector_quant_dim": "out", "enable_proxy_error": None}
# This project's own keys (the public reader does not know them), with the value that means their absence.
_VQ_EXTENSION_KEYS = {"codebook_bits": 16}

SCALAR_CONFIG_KEYS = (
    "act_bits", "act_granularity", "bias", "bits", "group_size", "in_features", "method", "out_features",
)


class Codebook(nn.Module):
    """A float table ``weight`` [rows, cols]; a module only so the state-dict key is ``<name>.weight``."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device), requires_grad=False)

    @property
    def table(self) -> torch.Tensor:
        """The float table the kernels read."""
        return self.weight

    def fill(self, table: torch.Tensor) -> None:
        """Set from a state's table (cast to this codebook's dtype)."""
        self.weight.copy_(table)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class Int8Codebook(nn.Module):
    """An 8-bit codebook as stored (``quant.codebook_grid``): ``weight`` int8 [rows, cols] and ``scale`` float32
    [rows, v], whatever the model's dtype. ``table``, the float table the kernels read, is computed from them in
    ``dtype`` (the model's: ``.to(dtype)`` changes it) whenever they or it changed, so it follows ``fill``,
    ``load_state_dict``, transformers' loading and ``.to`` alike; it is not stored."""

    def __init__(self, rows: int, cols: int, vector_len: int, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.vector_len = vector_len
        self.dtype = dtype or torch.get_default_dtype()
        self.register_buffer("weight", torch.zeros(rows, cols, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(rows, vector_len, dtype=torch.float32, device=device))
        self._table: torch.Tensor | None = None
        self._made_from: tuple | None = None

    def fill(self, table: torch.Tensor) -> None:
        """Set from a state's table: its grid codes and scales."""
        codes, scale = to_grid(table, self.vector_len)
        self.weight.copy_(codes)
        self.scale.copy_(scale)

    @property
    def table(self) -> torch.Tensor:
        """The float table [rows, cols] in ``dtype``, on ``weight``'s device."""
        source = (self.weight.data_ptr(), self.weight._version, self.scale.data_ptr(), self.scale._version,
                  self.weight.device, self.dtype)
        if source != self._made_from or self._table is None:
            # on the codes' device (on "meta", a table of the right shape and no data)
            table = from_grid(self.weight, self.scale.to(self.weight.device), self.vector_len)
            self._table, self._made_from = table.to(self.dtype), source
        return self._table

    def _apply(self, fn, recurse=True):  # .to(dtype) changes the table's dtype; the scale stays float32
        scale = self.scale
        super()._apply(fn, recurse)
        self._buffers["scale"] = scale.to(self.weight.device)
        self.dtype = fn(torch.zeros(0, dtype=self.dtype)).dtype
        return self

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, int8, {self.dtype}"


def _as_uint16_pattern(values: torch.Tensor, name: str) -> torch.Tensor:
    """int values in [0, 65536) -> int16 holding the uint16 bit pattern (public storage of small indices)."""
    values = values.to(torch.int64)
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 0xFFFF):
        raise ValueError(f"{name} values must be in [0, 65536), got range [{int(values.min())}, {int(values.max())}]")
    return torch.where(values >= 0x8000, values - 0x10000, values).to(torch.int16)


def _pair(name: str, value: object) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"{name} must be a list of two ints [outlier, main], got {value!r}")
    return int(value[0]), int(value[1])


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")  # noqa: TRY004 - a config value
    return value


def vq_spec_from_config(layer_config: dict) -> VQSpec:
    """Validate a public ``config_for_layers`` entry and return its ``VQSpec`` (ValueError naming the key)."""
    if not isinstance(layer_config, dict):
        raise ValueError(  # noqa: TRY004 - a malformed config file is a bad value
            f"a VPTQ layer config must be a JSON object, got {type(layer_config).__name__}"
        )
    unknown = set(layer_config) - set(VQ_CONFIG_KEYS) - set(_VQ_IGNORED_KEYS) - set(_VQ_EXTENSION_KEYS)
    if unknown:
        raise ValueError(f"unknown VPTQ layer config keys {sorted(unknown)}; allowed: "
                         f"{[*VQ_CONFIG_KEYS, *_VQ_EXTENSION_KEYS]}")
    codebook_bits = layer_config.get("codebook_bits", 16)
    if isinstance(codebook_bits, bool) or codebook_bits not in (16, 8):
        raise ValueError(f"codebook_bits must be 16 or 8, got {codebook_bits!r}")
    missing = [k for k in VQ_CONFIG_KEYS if k not in layer_config and k not in _VQ_OPTIONAL_KEYS]
    if missing:
        raise ValueError(f"VPTQ layer config misses keys {missing}")
    if layer_config.get("vector_quant_dim", "out") != "out":
        raise ValueError(f"vector_quant_dim must be 'out', got {layer_config['vector_quant_dim']!r}")
    if _flag("is_indice_packed", layer_config.get("is_indice_packed", True)) is not True:
        raise ValueError("is_indice_packed must be true: only packed index streams are supported")
    if _flag("indices_as_float", layer_config.get("indices_as_float", False)):
        raise ValueError("indices_as_float must be false: float-typed indices are a training-time format")
    for key in ("bias", "enable_norm", "enable_perm"):
        _flag(key, layer_config.get(key, False))
    outlier_v, v = _pair("vector_lens", layer_config["vector_lens"])
    outlier_k, k = _pair("num_centroids", layer_config["num_centroids"])
    outlier_res_k, res_k = _pair("num_res_centroids", layer_config["num_res_centroids"])
    if outlier_res_k != -1:
        raise ValueError(f"num_res_centroids[0] (outlier residual) must be -1, got {outlier_res_k}")
    outlier_size = layer_config.get("outlier_size", 0)
    has_outliers = isinstance(outlier_size, int) and outlier_size > 0
    try:
        spec = VQSpec(
            in_features=layer_config["in_features"], out_features=layer_config["out_features"], vector_len=v,
            num_centroids=k, num_res_centroids=res_k if res_k > 0 else -1,
            outlier_vector_len=outlier_v if has_outliers else -1,
            num_outlier_centroids=outlier_k if has_outliers else -1,
            group_num=layer_config["group_num"], group_size=layer_config["group_size"], outlier_size=outlier_size,
        )
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    if layer_config["group_size"] == 0:
        raise ValueError("group_size must be given explicitly (> 0) in a checkpoint layer config, got 0")
    if layer_config.get("enable_perm", False) and spec.in_features > 65536:
        raise ValueError(f"enable_perm needs in_features <= 65536 (uint16 perm), got {spec.in_features}")
    return spec


class _BoundLinear(nn.Module):
    """Shared by the quantized modules: a ``kernels.LayerKernel`` bound lazily on first forward."""

    def __init__(self) -> None:
        super().__init__()
        self._backend: str | None = None
        self._kernel = None

    @property
    def backend(self) -> str | None:
        """Kernel backend (None = automatic); setting it rebinds."""
        return self._backend

    @backend.setter
    def backend(self, value: str | None) -> None:
        self._backend = value
        self._kernel = None

    def rebind(self) -> None:
        """Forget the bound kernel (it binds again on the next forward): after in-place edits of the tensors."""
        self._kernel = None

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(), ...: the tensors change
        self._kernel = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._kernel = None
        super()._load_from_state_dict(*args, **kwargs)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> y [..., out] through the bound kernel, or the checked path where it cannot serve."""
        if torch.compiler.is_compiling():  # the registered custom op, which dynamo can trace
            return self._checked_linear(x, self.spec, self.weights(), backend=self._backend)
        if torch.is_grad_enabled():
            weights = self.weights()
            if any(t is not None and t.requires_grad for t in weights.float_tensors()):
                return self._checked_linear(x, self.spec, weights, backend=self._backend)  # autograd
        return self._bound(x)(x)

    def _bound(self, x: torch.Tensor):  # noqa: ANN202 - a kernels.LayerKernel
        """The kernel bound to this module's tensors on x's device, binding it first where needed."""
        kernel = self._kernel
        # A new index tensor (assigned, not edited in place) or another device also needs a new binding.
        if kernel is None or kernel.device != x.device or kernel.weights[0] is not self._buffers[self._INDEX]:
            kernel = self._kernel = self._bind(self.spec, self.weights(), x.device, backend=self._backend)
        return kernel

    def dequantize(self) -> torch.Tensor:
        """Dense W [out, in] in the module dtype (for tests and evaluation; never used by ``forward``)."""
        return self._dequantize(self.spec, self.weights())

    def lean_kernel(self, device: torch.device) -> tuple[str, object, tuple[int, int, float] | None] | None:
        """For a decode loop that calls the native kernels itself (several layers on one input in one call):
        ("vq" | "scalar", the bound native C++ layer, the input's fake quantization as (mode, bits, static step)
        or None): the outputs of ``forward`` with autograd off; None where ``forward`` would not run the native
        kernel on ``device`` (another backend)."""
        kernel = self._bound(torch.empty(0, device=device))
        if kernel.backend != "native":
            return None
        return self._LEAN_KIND, kernel.layer, self._lean_act()

    def _lean_act(self) -> tuple[int, int, float] | None:
        return None


class VQLinear(_BoundLinear):
    """A VPTQ-quantized linear layer: ``y = x @ W.T + bias`` with ``W`` looked up from codebooks.

    Construct empty from a public layer config (``VQLinear(**layer_config, dtype=...)`` or ``from_config``)
    and fill it with ``load_state_dict``, or build it filled from a ``VQLayerState`` with ``from_state``.
    ``backend`` (None = automatic) is passed to ``kernels.vq_linear``.
    """

    _INDEX = "indices"  # the buffer whose replacement means new tensors
    _LEAN_KIND = "vq"
    _bind, _checked_linear, _dequantize = staticmethod(bind_vq), staticmethod(vq_linear), staticmethod(vq_dequantize)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        vector_lens: list[int],
        num_centroids: list[int],
        num_res_centroids: list[int],
        group_num: int,
        group_size: int,
        outlier_size: int = 0,
        enable_norm: bool = False,
        enable_perm: bool = False,
        bias: bool = False,
        indices_as_float: bool = False,
        is_indice_packed: bool = True,
        codebook_bits: int = 16,
        dtype: torch.dtype | None = None,
        device=None,
        **ignored,
    ) -> None:
        super().__init__()
        config = {
            "in_features": in_features, "out_features": out_features, "vector_lens": list(vector_lens),
            "num_centroids": list(num_centroids), "num_res_centroids": list(num_res_centroids),
            "group_num": group_num, "group_size": group_size, "outlier_size": outlier_size,
            "enable_norm": enable_norm, "enable_perm": enable_perm, "bias": bias,
            "indices_as_float": indices_as_float, "is_indice_packed": is_indice_packed, "codebook_bits": codebook_bits,
            **ignored,
        }
        self.spec = vq_spec_from_config(config)
        spec = self.spec
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.enable_norm, self.enable_perm = enable_norm, enable_perm
        float_kw = {"dtype": dtype, "device": device}
        self.codebook_bits = codebook_bits

        def codebook(rows: int, k: int, v: int) -> Codebook | Int8Codebook:
            return Int8Codebook(rows, k * v, v, **float_kw) if codebook_bits == 8 else Codebook(rows, k * v, **float_kw)

        self.centroids = codebook(spec.group_num, spec.num_centroids, spec.vector_len)
        self.res_centroids = codebook(spec.group_num, spec.num_res_centroids, spec.vector_len) \
            if spec.has_residual else None
        self.register_buffer(
            "indices", torch.zeros(spec.group_num, spec.rows, spec.packed_words, dtype=torch.int32, device=device)
        )
        if spec.has_outliers:
            self.outlier_centroids = codebook(1, spec.num_outlier_centroids, spec.outlier_vector_len)
            self.register_buffer(
                "outlier_indices",
                torch.zeros(1, spec.outlier_rows, spec.outlier_size, dtype=torch.int16, device=device),
            )
        else:
            self.outlier_centroids = None
            self.register_buffer("outlier_indices", None)
        # Placeholder only (modules built from a config are filled by load_state_dict); works on "meta".
        perm = torch.zeros(spec.in_features, dtype=torch.int16, device=device) if enable_perm else None
        self.register_buffer("perm", perm)
        if enable_norm:
            self.weight_scale = nn.Parameter(torch.ones(spec.in_features, **float_kw), requires_grad=False)
            self.weight_bias = nn.Parameter(torch.zeros(spec.in_features, **float_kw), requires_grad=False)
        else:
            self.register_parameter("weight_scale", None)
            self.register_parameter("weight_bias", None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(spec.out_features, **float_kw), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_config(cls, layer_config: dict, dtype: torch.dtype | None = None, device=None) -> VQLinear:
        """An empty module for one public ``config_for_layers`` entry (tensors filled by ``load_state_dict``)."""
        vq_spec_from_config(layer_config)
        return cls(**layer_config, dtype=dtype, device=device)

    @classmethod
    def from_state(cls, state: VQLayerState, dtype: torch.dtype, device=None) -> VQLinear:
        """A filled module from an unpacked ``VQLayerState``; float tensors are cast to ``dtype``."""
        if not isinstance(state, VQLayerState):
            raise TypeError(f"state must be a VQLayerState, got {type(state).__name__}")
        _check_vq_state(state)
        module = cls.from_config(state.layer_config(), dtype=dtype, device=device)
        spec = module.spec
        device = module.indices.device
        with torch.no_grad():
            module.centroids.fill(state.centroids)
            module.indices.copy_(pack_indices(
                state.indices.to(device), spec.index_bits,
                None if state.res_indices is None else state.res_indices.to(device), spec.res_bits,
            ))
            if spec.has_residual:
                module.res_centroids.fill(state.res_centroids)
            if spec.has_outliers:
                outlier_indices = state.outlier_indices.to(torch.int64)
                if int(outlier_indices.max()) >= spec.num_outlier_centroids or int(outlier_indices.min()) < 0:
                    raise ValueError(f"outlier_indices must be in [0, {spec.num_outlier_centroids})")
                module.outlier_centroids.fill(state.outlier_centroids)
                module.outlier_indices.copy_(_as_uint16_pattern(outlier_indices, "outlier_indices"))
            if state.perm is not None:
                module.perm.copy_(_as_uint16_pattern(state.perm, "perm"))
            if state.weight_scale is not None:
                module.weight_scale.copy_(state.weight_scale)
                module.weight_bias.copy_(state.weight_bias)
            if state.bias is not None:
                module.bias.copy_(state.bias)
        return module

    def layer_config(self) -> dict:
        """The public ``config_for_layers`` entry of this module (with 8-bit codebooks, ``codebook_bits``)."""
        config = self.spec.layer_config(bias=self.bias is not None, enable_norm=self.enable_norm,
                                        enable_perm=self.enable_perm)
        return {**config, "codebook_bits": 8} if self.codebook_bits == 8 else config

    def weights(self) -> VQWeights:
        """This module's tensors as the kernels take them."""
        return VQWeights(
            indices=self.indices, centroids=self.centroids.table,
            res_centroids=None if self.res_centroids is None else self.res_centroids.table,
            outlier_indices=self.outlier_indices,
            outlier_centroids=None if self.outlier_centroids is None else self.outlier_centroids.table,
            perm=self.perm, weight_scale=self.weight_scale, weight_bias=self.weight_bias, bias=self.bias,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> y [..., out]."""
        return self._linear(x)

    def extra_repr(self) -> str:
        s = self.spec
        parts = [f"in_features={s.in_features}", f"out_features={s.out_features}",
                 f"vector_len={s.vector_len}", f"num_centroids={s.num_centroids}"]
        if s.has_residual:
            parts.append(f"num_res_centroids={s.num_res_centroids}")
        if s.group_num > 1:
            parts.append(f"group_num={s.group_num}")
        if s.has_outliers:
            parts.append(f"outliers={s.outlier_size}(v={s.outlier_vector_len},k={s.num_outlier_centroids})")
        parts += [f"norm={self.enable_norm}", f"perm={self.enable_perm}", f"bias={self.bias is not None}"]
        return ", ".join(parts)


def _check_vq_state(state: VQLayerState) -> None:
    """Consistency the dataclass does not check itself (optional tensors and their shapes)."""
    G, R, gs = state.group_num, math.ceil(state.out_features / state.vector_len), state.group_size
    if (state.res_indices is None) != (state.res_centroids is None):
        raise ValueError("res_indices must be given exactly when res_centroids is given")
    if state.res_indices is not None and tuple(state.res_indices.shape) != (G, R, gs):
        raise ValueError(f"res_indices shape {tuple(state.res_indices.shape)} != expected {(G, R, gs)}")
    if state.outlier_size > 0:
        rows = math.ceil(state.out_features / state.outlier_vector_len)
        if state.outlier_indices is None or tuple(state.outlier_indices.shape) != (1, rows, state.outlier_size):
            shape = None if state.outlier_indices is None else tuple(state.outlier_indices.shape)
            raise ValueError(f"outlier_indices shape {shape} != expected {(1, rows, state.outlier_size)}")
    if (state.weight_scale is None) != (state.weight_bias is None):
        raise ValueError("weight_scale and weight_bias must be given together (norm) or both be None")
    for name, expected in (("perm", state.in_features), ("weight_scale", state.in_features),
                           ("weight_bias", state.in_features), ("bias", state.out_features)):
        tensor = getattr(state, name)
        if tensor is not None and tuple(tensor.shape) != (expected,):
            raise ValueError(f"{name} shape {tuple(tensor.shape)} != expected ({expected},)")
    if state.perm is not None and not torch.equal(
        torch.sort(state.perm.to(torch.int64)).values, torch.arange(state.in_features, device=state.perm.device)
    ):
        raise ValueError("perm must be a permutation of range(in_features)")


# ------------------------------------------------------------------------------------------------ scalar
def scalar_config_from_dict(layer_config: dict) -> dict:
    """Validate a scalar ``config_for_layers`` entry (ValueError naming the key); returns it normalised."""
    if not isinstance(layer_config, dict):
        raise ValueError(  # noqa: TRY004 - a malformed config file is a bad value
            f"a scalar layer config must be a JSON object, got {type(layer_config).__name__}"
        )
    unknown = set(layer_config) - set(SCALAR_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown scalar layer config keys {sorted(unknown)}; allowed: {list(SCALAR_CONFIG_KEYS)}")
    missing = [k for k in ("bits", "group_size", "in_features", "out_features") if k not in layer_config]
    if missing:
        raise ValueError(f"scalar layer config misses keys {missing}")
    config = {"bias": False, "method": "rtn", "act_bits": 16, "act_granularity": "token", **layer_config}
    for key, lo, hi in (("bits", 1, 8), ("in_features", 1, None), ("out_features", 1, None),
                        ("group_size", 1, None), ("act_bits", 2, 16)):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            allowed = f"an int in {lo}..{hi}" if hi is not None else f"an int >= {lo}"
            raise ValueError(f"{key} must be {allowed}, got {value!r}")
    if config["group_size"] > config["in_features"]:
        raise ValueError(f"group_size ({config['group_size']}) must be <= in_features ({config['in_features']})")
    if config["act_granularity"] not in ACT_GRANULARITIES:
        raise ValueError(f"act_granularity must be one of {ACT_GRANULARITIES}, got {config['act_granularity']!r}")
    if not isinstance(config["method"], str):
        raise ValueError(f"method must be a string, got {config['method']!r}")  # noqa: TRY004 - a config value
    _flag("bias", config["bias"])
    return config


class ScalarQLinear(_BoundLinear):
    """A scalar-quantized linear: ``W[o, j] = scales[o, j // group_size] * (codes[o, j] - zeros[o, ...])``.

    Tensors: ``codes`` int32 [out, ceil(in*bits/32)] (bit-packed), ``scales``/``zeros`` [out, n_groups] and
    ``bias`` [out] in the model dtype, ``act_scale`` [] (static per-tensor activation scale, only when
    ``act_bits < 16`` and ``act_granularity == "tensor"``). With ``act_bits < 16`` the input is fake-quantized
    (``vptq_core.quant.act_quant``) before the matmul.
    """

    _INDEX = "codes"  # the buffer whose replacement means new tensors
    _LEAN_KIND = "scalar"
    _bind, _checked_linear = staticmethod(bind_scalar), staticmethod(scalar_linear)
    _dequantize = staticmethod(scalar_dequantize)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        bias: bool = False,
        method: str = "rtn",
        act_bits: int = 16,
        act_granularity: str = "token",
        dtype: torch.dtype | None = None,
        device=None,
    ) -> None:
        super().__init__()
        config = scalar_config_from_dict({
            "in_features": in_features, "out_features": out_features, "bits": bits, "group_size": group_size,
            "bias": bias, "method": method, "act_bits": act_bits, "act_granularity": act_granularity,
        })
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.method = bits, group_size, config["method"]
        self.act_bits, self.act_granularity = act_bits, act_granularity
        self.spec = ScalarSpec(in_features, out_features, bits, group_size)
        groups = math.ceil(in_features / group_size)
        words = math.ceil(in_features * bits / 32)
        self.register_buffer("codes", torch.zeros(out_features, words, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.ones(out_features, groups, dtype=dtype, device=device))
        self.register_buffer("zeros", torch.zeros(out_features, groups, dtype=dtype, device=device))
        static = act_bits < 16 and act_granularity == "tensor"
        self.register_buffer("act_scale", torch.ones((), dtype=dtype, device=device) if static else None)
        self._act_native = None  # (bound kernel, its forward_act, mode, bits, static step)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_config(cls, layer_config: dict, dtype: torch.dtype | None = None, device=None) -> ScalarQLinear:
        """An empty module for one scalar ``config_for_layers`` entry."""
        return cls(**scalar_config_from_dict(layer_config), dtype=dtype, device=device)

    @classmethod
    def from_state(cls, state: ScalarLayerState, dtype: torch.dtype, device=None) -> ScalarQLinear:
        """A filled module from a ``ScalarLayerState``; float tensors are cast to ``dtype``."""
        if not isinstance(state, ScalarLayerState):
            raise TypeError(f"state must be a ScalarLayerState, got {type(state).__name__}")
        if state.bias is not None and tuple(state.bias.shape) != (state.out_features,):
            raise ValueError(f"bias shape {tuple(state.bias.shape)} != expected ({state.out_features},)")
        static = state.act_bits < 16 and state.act_granularity == "tensor"
        if static and (state.act_scale is None or state.act_scale.numel() != 1):
            raise ValueError("act_scale (one element) is required for static per-tensor activation quantization")
        module = cls(
            state.in_features, state.out_features, state.bits, state.group_size, bias=state.bias is not None,
            method=state.method, act_bits=state.act_bits, act_granularity=state.act_granularity,
            dtype=dtype, device=device,
        )
        with torch.no_grad():
            module.codes.copy_(pack_codes(state.codes.to(torch.int64), state.bits))
            module.scales.copy_(state.scales)
            module.zeros.copy_(state.zeros)
            if static:
                module.act_scale.copy_(state.act_scale.reshape(()))
            if state.bias is not None:
                module.bias.copy_(state.bias)
        return module

    def layer_config(self) -> dict:
        """This module's entry of the scalar ``config_for_layers``."""
        return {
            "act_bits": self.act_bits, "act_granularity": self.act_granularity, "bias": self.bias is not None,
            "bits": self.bits, "group_size": self.group_size, "in_features": self.in_features,
            "method": self.method, "out_features": self.out_features,
        }

    def weights(self) -> ScalarWeights:
        """This module's tensors as the kernels take them."""
        return ScalarWeights(self.codes, self.scales, self.zeros, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> y [..., out]."""
        if self.act_bits < 16:
            if torch.is_grad_enabled() or torch.compiler.is_compiling() or x.ndim == 0:
                x = quantize_activations(x, self.act_bits, self.act_granularity, self.act_scale)
            else:
                kernel = self._bound(x)
                if kernel.backend == "native":
                    return self._native_act_linear(kernel, x)
                return kernel(_fake_quant_inference(x, self.act_bits, self.act_granularity, self.act_scale))
        return self._linear(x)

    def _native_act_linear(self, kernel, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - a LayerKernel
        """Fake-quantize x (the same values as ``_fake_quant_inference``) and run the layer, in one C++ call on
        the bound native layer; the static step is read once per binding, not per call."""
        cached = self._act_native
        if cached is None or cached[0] is not kernel:
            if self.act_granularity == "tensor" and not bool(self.act_scale.reshape(()) > 0):
                raise ValueError(f"scale must be positive, got {float(self.act_scale)}")
            step = float(self.act_scale) if self.act_granularity == "tensor" else 0.0
            mode = backend_module("native").ACT_MODES[self.act_granularity]
            cached = self._act_native = (kernel, kernel.layer.forward_act, mode, self.act_bits, step)
        return cached[1](x, cached[2], cached[3], cached[4])

    def _lean_act(self) -> tuple[int, int, float] | None:
        if self.act_bits >= 16:
            return None
        if self.act_granularity == "tensor" and not bool(self.act_scale.reshape(()) > 0):
            raise ValueError(f"scale must be positive, got {float(self.act_scale)}")
        step = float(self.act_scale) if self.act_granularity == "tensor" else 0.0
        return backend_module("native").ACT_MODES[self.act_granularity], int(self.act_bits), step

    def extra_repr(self) -> str:
        act = f", act_bits={self.act_bits}({self.act_granularity})" if self.act_bits < 16 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, method={self.method}, bias={self.bias is not None}{act}")


def _fake_quant_inference(x: torch.Tensor, bits: int, granularity: str, scale: torch.Tensor | None) -> torch.Tensor:
    """``quantize_activations`` without autograd and its argument checks (the module checked them at
    construction): the same values with in-place ops, a third of the small ops per call."""
    xf = x.to(torch.float32, copy=True)
    if granularity == "token_asym":
        step, zero = asym_token_grid(xf, bits)
        return xf.div_(step).round_().add_(zero).clamp_(0, 2**bits - 1).sub_(zero).mul_(step).to(x.dtype)
    qmax = 2 ** (bits - 1) - 1
    if granularity == "token":
        step = xf.abs().amax(dim=-1, keepdim=True).div_(qmax).clamp_(min=_ACT_EPS)
        return xf.div_(step).round_().mul_(step).to(x.dtype)  # absmax steps: nothing to clip
    if scale.device.type == "cpu" and not bool(scale.reshape(()) > 0):
        raise ValueError(f"scale must be positive, got {float(scale)}")
    step = scale.to(device=x.device, dtype=torch.float32).reshape(())
    return xf.div_(step).round_().clamp_(-qmax, qmax).mul_(step).to(x.dtype)


# ------------------------------------------------------------------------------------------- model surgery
QuantizedLinear = VQLinear | ScalarQLinear


def module_from_state(state: VQLayerState | ScalarLayerState, dtype: torch.dtype, device=None) -> nn.Module:
    """``VQLinear`` or ``ScalarQLinear`` for one layer state."""
    if isinstance(state, VQLayerState):
        return VQLinear.from_state(state, dtype, device)
    if isinstance(state, ScalarLayerState):
        return ScalarQLinear.from_state(state, dtype, device)
    raise TypeError(f"state must be a VQLayerState or ScalarLayerState, got {type(state).__name__}")


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at the dotted path ``name``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def get_linear(model: nn.Module, name: str) -> nn.Linear:
    """The ``nn.Linear`` at ``name``, or ValueError saying what is there instead."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"model has no submodule {name!r}") from None
    if not isinstance(module, nn.Linear):
        raise TypeError(f"module {name!r} is a {type(module).__name__}, expected nn.Linear")
    return module


def replace_linears(
    model: nn.Module, states: dict[str, VQLayerState | ScalarLayerState], dtype: torch.dtype
) -> nn.Module:
    """Swap each ``nn.Linear`` named in ``states`` (full module names, e.g. "model.layers.0.self_attn.q_proj")
    for its quantized module, on the linear's device; returns ``model`` (modified in place)."""
    if not isinstance(states, dict):
        raise TypeError(f"states must be a dict of module name -> layer state, got {type(states).__name__}")
    modules = {}
    for name, state in states.items():
        if not isinstance(state, (VQLayerState, ScalarLayerState)):
            raise TypeError(
                f"state for {name!r} must be a VQLayerState or ScalarLayerState, got {type(state).__name__}"
            )
        linear = get_linear(model, name)
        if (state.in_features, state.out_features) != (linear.in_features, linear.out_features):
            raise ValueError(
                f"state for {name!r} is {state.in_features}->{state.out_features} but the linear is "
                f"{linear.in_features}->{linear.out_features}"
            )
        if (linear.bias is not None) != (state.bias is not None):
            raise ValueError(
                f"state for {name!r} {'has' if state.bias is not None else 'lacks'} a bias but the linear "
                f"{'has' if linear.bias is not None else 'has none'}"
            )
        device = linear.weight.device if linear.weight.device.type != "meta" else None
        modules[name] = module_from_state(state, dtype, device)
    for name, module in modules.items():
        set_submodule(model, name, module)
    return model
