#!/usr/bin/env bash
# GPU checks for the kernels package, for a machine with an NVIDIA GPU and `pip install -r requirements.txt`
# already done (this script installs nothing). Every step runs even when an earlier one fails; the exit status
# is non-zero when any failed.
#   1. the Triton kernel tests on CUDA tensors (VPTQ_TRITON_DEVICE=cuda; TRITON_INTERPRET must be off)
#   2. bench/kernels_gpu.py: fused Triton GEMV vs cuBLAS fp16 at 1 / 8 tokens (4096x4096, 11008x4096; goal >= 2x
#      at 4096^2 2-bit), Triton dequantize + cuBLAS matmul at 128 tokens
#   3. bench/decode.py on the GPU: greedy decode of a 2-bit (v6 k4096 + outliers) SmolLM2-shaped and 0.5B-shaped
#      model vs the same model in fp16, same process, alternated pairs
# Usage: bash bench/gpu.sh [extra args for bench/kernels_gpu.py]
set -uo pipefail
cd "$(dirname "$0")/.."

python - <<'EOF' || exit 1
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh needs a CUDA device: torch.cuda.is_available() is False")
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
EOF

unset TRITON_INTERPRET
failed=0
echo "== 1. Triton kernel tests on CUDA =="
VPTQ_TRITON_DEVICE=cuda python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py || failed=1

echo "== 2. Triton kernels vs cuBLAS =="
python bench/kernels_gpu.py "$@" || failed=1

echo "== 3. Decode on the GPU: quantized vs fp16 =="
for shape in smollm2 0.5b; do
  python bench/decode.py --shape "$shape" --layout vptq2 --device cuda --dtype float16 --loop lean-static \
    --tokens 64 --pairs 3 || failed=1
done
exit $failed
