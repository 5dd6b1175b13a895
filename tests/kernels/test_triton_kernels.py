"""kernels.triton_kernels against the torch reference.

Without a GPU the kernels run on CPU tensors in Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before ``triton`` is first imported. When this module is not the first importer
(a full test run), the kernel tests skip in-process and ``test_interpreter_suite_in_subprocess`` reruns
this file in a fresh interpreter. ``VPTQ_TRITON_DEVICE=cuda`` runs everything on CUDA tensors instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = "cuda" if os.environ.get("VPTQ_TRITON_DEVICE", "cpu") == "cuda" else "cpu"
if DEVICE == "cpu" and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed")

from vptq_core.kernels import VQSpec, VQWeights, scalar_linear, vq_linear  # noqa: E402
from vptq_core.kernels.reference import scalar_dequantize as ref_scalar_dequantize  # noqa: E402
from vptq_core.kernels.reference import vq_dequantize as ref_vq_dequantize  # noqa: E402
from vptq_core.kernels.synthetic import random_scalar_layer, random_vq_layer  # noqa: E402


def _interpreter_works() -> bool:
    """True when triton.language was imported with the interpreter on (or a GPU is used)."""
    if DEVICE == "cuda":
        return torch.cuda.is_available()
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return False
    from vptq_core.kernels import triton_kernels

    spec = VQSpec(8, 4, 2, 2)
    layer = random_vq_layer(spec)
    try:
        triton_kernels.vq_linear(torch.zeros(1, 8), spec, layer)
    except Exception:  # the interpreter raises various errors when triton was imported without it
        return False
    return True


IN_PROCESS = _interpreter_works()
needs_kernels = pytest.mark.skipif(
    not IN_PROCESS,
    reason="triton was imported before TRITON_INTERPRET=1 was set (or no CUDA device); "
    "covered by test_interpreter_suite_in_subprocess",
)

SPECS = [
    VQSpec(24, 13, 6, 64),
    VQSpec(30, 17, 4, 32, num_res_centroids=8),
    VQSpec(40, 11, 3, 16, num_res_centroids=4, outlier_vector_len=4, num_outlier_centroids=8, group_num=2,
           group_size=17, outlier_size=6),
    VQSpec(48, 20, 8, 256, num_res_centroids=256),
    VQSpec(36, 21, 2, 65536, num_res_centroids=65536),
    VQSpec(70, 33, 16, 8, outlier_vector_len=2, num_outlier_centroids=4, outlier_size=3, group_num=1),
    VQSpec(33, 20, 5, 8192, group_num=3, group_size=9, outlier_size=6, outlier_vector_len=3,
           num_outlier_centroids=32),
]


def _layer(spec: VQSpec, seed: int, extras: bool) -> VQWeights:
    return random_vq_layer(spec, seed=seed, perm=extras, norm=extras, bias=extras, device=DEVICE)


@needs_kernels
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"v{s.vector_len}k{s.num_centroids}r{s.num_res_centroids}")
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "perm+norm+bias"])
@pytest.mark.parametrize("fused", [True, False], ids=["gemv", "dequant+matmul"])
def test_triton_vq_linear_matches_reference(spec: VQSpec, extras: bool, fused: bool) -> None:
    from vptq_core.kernels import triton_kernels

    layer = _layer(spec, seed=spec.vector_len, extras=extras)
    x = torch.randn(3, spec.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    expected = vq_linear(x, spec, layer, backend="reference")
    got = triton_kernels.vq_linear(x, spec, layer, fused=fused)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("v", list(range(2, 17)))
def test_triton_every_vector_length(v: int) -> None:
    spec = VQSpec(20, 2 * v + 1, v, 16, num_res_centroids=4 if v % 2 else -1)
    layer = _layer(spec, seed=v, extras=True)
    x = torch.randn(1, 20, generator=torch.Generator().manual_seed(v)).to(DEVICE)
    torch.testing.assert_close(vq_linear(x, spec, layer, backend="triton"),
                               vq_linear(x, spec, layer, backend="reference"), rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("index_bits", [1, 3, 7, 12, 13, 16])
def test_triton_dequantize_is_exact(index_bits: int) -> None:
    from vptq_core.kernels import triton_kernels

    spec = VQSpec(37, 10, 4, 2**index_bits, num_res_centroids=8 if index_bits < 16 else -1, outlier_size=2,
                  outlier_vector_len=2, num_outlier_centroids=4)
    layer = _layer(spec, seed=index_bits, extras=True)
    torch.testing.assert_close(triton_kernels.vq_dequantize(spec, layer), ref_vq_dequantize(spec, layer),
                               rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("fused", [True, False], ids=["gemv", "dequant+matmul"])
def test_triton_scalar_matches_reference(bits: int, fused: bool) -> None:
    from vptq_core.kernels import triton_kernels

    s = random_scalar_layer(21, 70, bits, 16, seed=bits, bias=True, device=DEVICE)  # (spec, weights)
    x = torch.randn(2, 70, generator=torch.Generator().manual_seed(bits)).to(DEVICE)
    expected = scalar_linear(x, *s, backend="reference")
    torch.testing.assert_close(triton_kernels.scalar_linear(x, *s, fused=fused), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(triton_kernels.scalar_dequantize(*s), ref_scalar_dequantize(*s))


@needs_kernels
def test_triton_backend_through_public_api_bf16() -> None:
    spec = SPECS[2]
    layer = random_vq_layer(spec, seed=3, dtype=torch.bfloat16, perm=True, norm=True, device=DEVICE)
    x = torch.randn(2, 4, spec.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).to(DEVICE)
    got = vq_linear(x, spec, layer, backend="triton")
    assert got.dtype == torch.bfloat16 and got.shape == (2, 4, spec.out_features)
    layer32 = VQWeights(*[t.float() if t is not None and t.is_floating_point() else t for t in layer])
    torch.testing.assert_close(got.float(), vq_linear(x.float(), spec, layer32, backend="reference"),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.slow
@pytest.mark.skipif(IN_PROCESS or DEVICE != "cpu", reason="kernel tests already run in this process")
def test_interpreter_suite_in_subprocess() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", VPTQ_TRITON_DEVICE="cpu")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) >= 50, proc.stdout[-2000:]
