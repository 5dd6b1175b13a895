"""``transformers.AutoModelForCausalLM.from_pretrained`` for vptq_core checkpoints (CPU and GPU).

transformers maps ``quant_method == "vptq"`` to ``VptqHfQuantizer``, which needs the ``vptq`` package and a
CUDA device, and ``register_quantizer`` refuses a second "vptq" entry. ``install()`` therefore puts a subclass
of that quantizer into ``AUTO_QUANTIZER_MAPPING["vptq"]``: when ``vptq`` is importable and CUDA is present
it behaves exactly like the upstream class (the ecosystem's own kernels); otherwise it swaps in
``vptq_core.storage.modules.VQLinear`` (same tensor names, so the same checkpoint loads either way). The
scalar format ("vptq_core_scalar") is a new method, registered through the public registration functions. Models
loaded on vptq_core's modules get the lean token loop in ``model.generate`` (``quant.lean_generate``).
``install()`` is idempotent and runs on ``import vptq_core``.
"""

from __future__ import annotations

import torch
from transformers.quantizers import auto
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizer_vptq import VptqHfQuantizer
from transformers.utils import is_vptq_available
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..quant import lean_generate
from .checkpoint import SCALAR_FORMAT_VERSION, SCALAR_METHOD, VQ_METHOD, swap_quantized_modules


def upstream_vptq_usable() -> bool:
    """True when transformers' own VPTQ path can run: the ``vptq`` package and a CUDA device."""
    return bool(is_vptq_available()) and torch.cuda.is_available()


class VptqCoreHfQuantizer(VptqHfQuantizer):
    """transformers' VPTQ quantizer, falling back to vptq_core modules when ``vptq``/CUDA are missing."""

    def validate_environment(self, *args, **kwargs):
        if upstream_vptq_usable():
            return super().validate_environment(*args, **kwargs)
        return None

    def _process_model_before_weight_loading(self, model, **kwargs):
        if upstream_vptq_usable():
            return super()._process_model_before_weight_loading(model, **kwargs)
        config = self.quantization_config
        swap_quantized_modules(model, VQ_METHOD, config.config_for_layers, config.shared_layer_config, device="meta")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        model = super()._process_model_after_weight_loading(model, **kwargs)
        return model if upstream_vptq_usable() else lean_generate.enable(model)


class VptqCoreScalarConfig(QuantizationConfigMixin):
    """``quantization_config`` of scalar (RTN / GPTQ / LRQ) vptq_core checkpoints."""

    def __init__(self, config_for_layers: dict | None = None, format_version: int = SCALAR_FORMAT_VERSION,
                 modules_to_not_convert: list | None = None, **kwargs):
        self.quant_method = SCALAR_METHOD
        self.format_version = format_version
        self.config_for_layers = dict(config_for_layers or {})
        self.modules_to_not_convert = modules_to_not_convert
        if format_version != SCALAR_FORMAT_VERSION:
            raise ValueError(
                f"unsupported {SCALAR_METHOD} format_version {format_version!r} (expected {SCALAR_FORMAT_VERSION})"
            )


class VptqCoreScalarHfQuantizer(HfQuantizer):
    """Loads pre-quantized scalar checkpoints into ``ScalarQLinear`` modules."""

    requires_calibration = True

    def _process_model_before_weight_loading(self, model, **kwargs):
        swap_quantized_modules(model, SCALAR_METHOD, self.quantization_config.config_for_layers, device="meta")
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return lean_generate.enable(model)

    def is_serializable(self):
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def install() -> None:
    """Make ``AutoModelForCausalLM.from_pretrained`` load vptq_core checkpoints; safe to call repeatedly."""
    auto.AUTO_QUANTIZER_MAPPING[VQ_METHOD] = VptqCoreHfQuantizer
    if auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(SCALAR_METHOD) is not VptqCoreScalarConfig:
        auto.AUTO_QUANTIZATION_CONFIG_MAPPING.pop(SCALAR_METHOD, None)  # a stale class from a module reload
        auto.register_quantization_config(SCALAR_METHOD)(VptqCoreScalarConfig)
    if auto.AUTO_QUANTIZER_MAPPING.get(SCALAR_METHOD) is not VptqCoreScalarHfQuantizer:
        auto.AUTO_QUANTIZER_MAPPING.pop(SCALAR_METHOD, None)
        auto.register_quantizer(SCALAR_METHOD)(VptqCoreScalarHfQuantizer)


def installed() -> bool:
    """Whether ``install()`` is in effect for this process's transformers."""
    return (auto.AUTO_QUANTIZER_MAPPING.get(VQ_METHOD) is VptqCoreHfQuantizer
            and auto.AUTO_QUANTIZER_MAPPING.get(SCALAR_METHOD) is VptqCoreScalarHfQuantizer
            and auto.AUTO_QUANTIZATION_CONFIG_MAPPING.get(SCALAR_METHOD) is VptqCoreScalarConfig)
