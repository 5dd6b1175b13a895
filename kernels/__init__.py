"""Lookup kernels for VPTQ vector-quantized linears and scalar int-code linears, behind one signature.

Backends: "reference" (torch dequantize + ``F.linear``, ground truth), "cpu" (fused numba decode kernels),
"triton" (CUDA; CPU only under ``TRITON_INTERPRET=1``). ``backend=None`` selects automatically.
"""

from .backends import available_backends
from .ops import scalar_dequantize, scalar_linear, vq_dequantize, vq_linear
from .packing import pack_codes, pack_indices, unpack_codes, unpack_indices
from .spec import VQSpec

__all__ = [
    "VQSpec",
    "available_backends",
    "pack_codes",
    "pack_indices",
    "scalar_dequantize",
    "scalar_linear",
    "unpack_codes",
    "unpack_indices",
    "vq_dequantize",
    "vq_linear",
]
