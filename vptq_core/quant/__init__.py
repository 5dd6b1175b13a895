"""The quantization methods and the block-by-block driver: pure tensor code, no files, no UI.

May import ``kernels`` and nothing else of this project (not ``vptq_core.storage``, ``vptq_core.studio`` or
the top-level modules).
"""
