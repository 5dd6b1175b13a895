"""vptq_core: extreme low-bit quantization of LLMs (VPTQ, LRQ, GPTQ, RTN), packed checkpoints, evaluation.

Python API::

    from vptq_core import load_model, quantize_model, evaluate, VPTQConfig
    from vptq_core.data import calibration_windows

The public names are imported on first use (PEP 562), so ``import vptq_core`` stays light; it does two things at
once: it makes ``vptq_core.kernels`` importable in a repository checkout (see ``_repo_kernels``), and it makes
transformers' ``from_pretrained`` load our packed checkpoints (``storage.hf_integration``).
"""

from pathlib import Path as _Path

from . import _repo_kernels

_repo_kernels.register(_Path(__file__).resolve().parent)

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_LAZY = {
    "EvalResult": ".eval",
    "evaluate": ".eval",
    "load_model": ".models",
    "CalibConfig": ".quant.config",
    "LRQConfig": ".quant.config",
    "ScalarConfig": ".quant.config",
    "VPTQConfig": ".quant.config",
    "LayerReport": ".quant.results",
    "QuantizeResult": ".quant.results",
    "quantize_model": ".quant.pipeline",
    "load_quantized": ".storage.checkpoint",
    "save_quantized": ".storage.checkpoint",
}

__all__ = ["__version__", *sorted(_LAZY)]


def __getattr__(name: str):
    """A public name, or a submodule not imported yet (``vptq_core.models`` after a bare ``import vptq_core``)."""
    import importlib
    import importlib.util

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


from .storage.hf_integration import install as _install_hf_integration  # noqa: E402

_install_hf_integration()
