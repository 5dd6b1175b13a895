"""Lookup kernels for VPTQ vector-quantized linears and scalar int-code linears, behind one signature.

Every backend takes ``(x, spec, weights)``: ``VQSpec`` + ``VQWeights`` or ``ScalarSpec`` + ``ScalarWeights``.
Backends: "reference" (torch dequantize + ``F.linear``, ground truth), "native" (C++ AVX2/AVX-512 kernels, built
on first use), "cpu" (fused numba kernels), "triton" (CUDA; CPU only under ``TRITON_INTERPRET=1``).
``backend=None`` selects automatically. ``bind_vq`` / ``bind_scalar`` check and prepare a layer once.

This package imports nothing from ``vptq_core``.
"""

from .backends import available_backends
from .ops import (
    LayerKernel,
    bind_scalar,
    bind_vq,
    scalar_dequantize,
    scalar_linear,
    vq_dequantize,
    vq_linear,
)
from .packing import pack_codes, pack_indices, unpack_codes, unpack_indices
from .spec import ScalarSpec, ScalarWeights, VQSpec, VQWeights

__all__ = [
    "LayerKernel",
    "ScalarSpec",
    "ScalarWeights",
    "VQSpec",
    "VQWeights",
    "available_backends",
    "bind_scalar",
    "bind_vq",
    "pack_codes",
    "pack_indices",
    "scalar_dequantize",
    "scalar_linear",
    "unpack_codes",
    "unpack_indices",
    "vq_dequantize",
    "vq_linear",
]
