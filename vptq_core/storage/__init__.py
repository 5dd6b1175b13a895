"""Quantized layers at rest and at run time: packed ``nn.Module`` replacements, checkpoints on disk, the
transformers integration and upload archives.

May import ``kernels`` and ``vptq_core.quant``; never ``vptq_core.studio``.
"""
