#!/usr/bin/env bash
# Every GPU check in one run, for one device window (well under 10 minutes on one H200): installs what a bare
# machine lacks from .gpu-assets/ (wheels and the SmolLM2 GGUF in pieces, packed beforehand on a machine with
# network by `python bench/gpu_assets.py`; carried there part by part), then bench/gpu_steps.py runs each step
# with its own time limit and prints one table (one row per step: status, seconds, figures):
#   1. the Triton kernel tests on CUDA tensors
#   2. fused Triton GEMV vs cuBLAS fp16 at 1 token, dequantize + GEMM at 128 (4096^2, 11008x4096; goal >= 2x at 2 bits)
#   3. greedy decode of a 2-bit model of the SmolLM2 shape and of the 0.5B shape vs fp16
#   4. the "2.5 bits" preset quantizing SmolLM2 on CUDA, each phase timed, held-out perplexity vs the CPU run's
#   5. two processes with NCCL, where the machine has two GPUs
# Without CUDA every row says "skipped: no CUDA" and the status is 0; a failed or timed-out step makes it 1.
# Usage: bash bench/gpu.sh [--quick] [--log DIR]   (the logs default to $OUT/gpu-logs when $OUT is set)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || PY=python

site=${TMPDIR:-/tmp}/vptq-gpu-site
wheels=$(ls .gpu-assets/*/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" $wheels \
      >/dev/null 2>&1; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "installed: $(echo "$wheels" | xargs -n1 basename | tr '\n' ' ')" >&2
  else
    echo "install: the carried wheels did not install; steps that need them will say so" >&2
  fi
fi
gguf_args=()
manifest=$(ls .gpu-assets/*/manifest.json 2>/dev/null | head -n1)
if [ -n "$manifest" ]; then
  gguf=${TMPDIR:-/tmp}/vptq-gpu-smollm2.gguf
  if "$PY" - "$manifest" "$gguf" <<'PYEOF' >&2
import glob, hashlib, json, sys
manifest, target = json.load(open(sys.argv[1])), sys.argv[2]
found = {p.rsplit("/", 1)[-1]: p for p in glob.glob(".gpu-assets/*/smollm2.gguf.*")}
missing = [n for n in manifest["pieces"] if n not in found]
if missing:
    sys.exit(f"SmolLM2 GGUF: pieces {missing} not carried; step 4 is skipped")
data = b"".join(open(found[n], "rb").read() for n in manifest["pieces"])
if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
    sys.exit("SmolLM2 GGUF: the joined pieces do not match the manifest; step 4 is skipped")
open(target, "wb").write(data)
print(f"SmolLM2 GGUF joined: {len(data) / 2**20:.1f} MiB")
PYEOF
  then gguf_args=(--gguf "$gguf"); fi
fi
log_args=()
if [ -n "${OUT:-}" ]; then log_args=(--log "$OUT/gpu-logs"); fi
exec "$PY" bench/gpu_steps.py "${gguf_args[@]}" "${log_args[@]}" "$@"
