"""vptq_core: extreme low-bit quantization of LLMs (VPTQ, LRQ, GPTQ, RTN), packed checkpoints, evaluation.

Python API::

    from vptq_core import load_model, quantize_model, evaluate, VPTQConfig
    from vptq_core.data import calibration_windows
"""

__version__ = "0.1.0"

from .eval import EvalResult, evaluate  # noqa: E402
from .models import load_model  # noqa: E402
from .quant.config import CalibConfig, LRQConfig, ScalarConfig, VPTQConfig  # noqa: E402
from .quant.pipeline import LayerReport, QuantizeResult, quantize_model  # noqa: E402
from .storage.checkpoint import load_quantized, save_quantized  # noqa: E402
from .storage.hf_integration import install as _install_hf_integration  # noqa: E402

# `import vptq_core` makes transformers' from_pretrained load our packed checkpoints (see README).
_install_hf_integration()


__all__ = [
    "CalibConfig", "EvalResult", "LRQConfig", "LayerReport", "QuantizeResult", "ScalarConfig", "VPTQConfig",
    "__version__", "evaluate", "load_model", "load_quantized", "quantize_model", "save_quantized",
]
