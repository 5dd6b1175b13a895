#!/usr/bin/env bash
# GPU checks for the kernels package, for a machine with an NVIDIA GPU and `pip install -r requirements.txt`
# already done (this script installs nothing).
#   1. the Triton kernel tests on CUDA tensors (VPTQ_TRITON_DEVICE=cuda; TRITON_INTERPRET must be off)
#   2. bench/kernels_gpu.py: fused Triton GEMV vs cuBLAS fp16 at batch 1, dequantize + matmul at 128 tokens
# Usage: bash bench/gpu.sh [extra args for bench/kernels_gpu.py]
set -euo pipefail
cd "$(dirname "$0")/.."

python - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh needs a CUDA device: torch.cuda.is_available() is False")
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
EOF

unset TRITON_INTERPRET
echo "== Triton kernel tests on CUDA =="
VPTQ_TRITON_DEVICE=cuda python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py

echo "== Triton kernels vs cuBLAS =="
python bench/kernels_gpu.py "$@"
