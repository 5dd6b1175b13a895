"""Native C++ CPU kernels (kernels/native.py, kernels/csrc) against the torch reference.

The extension is built once (cached on disk); every test but the fallback one skips with the reason when
``kernels.native.status()`` is not usable. Tolerances: fp32 x -> fp32 accumulation in both (summation order
differs); bf16 x -> both round the output to bf16 (the reference also rounds W, and for norm W * scale, to bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from vptq_core.kernels import VQSpec, native, reference, synthetic

ROOT = Path(__file__).resolve().parents[2]
TOKENS = (1, 2, 3, 8, 9, 128)
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def ext():
    usable, reason = native.status()
    if not usable:
        pytest.skip(reason)
    yield
    native.set_isa("auto")


@pytest.fixture
def threads():
    saved = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(saved)


# --------------------------------------------------------------------------------------- helpers
def _vq_fields(layer) -> dict:  # noqa: ANN001 - VQWeights (NamedTuple) or a dict of tensors
    return layer._asdict() if hasattr(layer, "_asdict") else dict(layer)


def _ref_vq(x: torch.Tensor, spec: VQSpec, layer) -> torch.Tensor:  # noqa: ANN001
    if isinstance(layer, dict):
        return reference.vq_linear(x, spec, **layer)
    return reference.vq_linear(x, spec, layer)


def _scalar_layer(out_f: int, in_f: int, bits: int, group_size: int, dtype: torch.dtype, seed: int = 0):
    """(reference arguments, native prepare_scalar keyword arguments) for a random scalar layer."""
    made = synthetic.random_scalar_layer(out_f, in_f, bits, group_size, seed=seed, dtype=dtype, bias=True)
    if isinstance(made, dict):  # older synthetic API: keyword arguments of reference.scalar_linear
        tensors = {"codes_packed": made["codes_packed"], "scales": made["scales"], "zeros": made["zeros"],
                   "bias": made["bias"]}
    else:
        _, weights = made
        tensors = {"codes_packed": weights.codes, "scales": weights.scales, "zeros": weights.zeros,
                   "bias": weights.bias}
    return made, dict(tensors, bits=bits, group_size=group_size, in_features=in_f)


def _ref_scalar(x: torch.Tensor, made) -> torch.Tensor:  # noqa: ANN001
    if isinstance(made, dict):
        return reference.scalar_linear(x, **made)
    return reference.scalar_linear(x, *made)


def _close(y: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert y.dtype == ref.dtype and y.shape == ref.shape, what
    scale = max(ref.float().abs().max().item(), 1e-3)
    if ref.dtype == torch.bfloat16:
        torch.testing.assert_close(y.float(), ref.float(), rtol=1.6e-2, atol=1e-2 * scale, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * scale, msg=lambda m: f"{what}: {m}")


def _spec(in_f, out_f, v, k, kr=-1, group_num=1, outliers=None) -> VQSpec:  # noqa: ANN001
    osz, vo, ko = outliers if outliers else (0, -1, -1)
    return VQSpec(in_f, out_f, v, k, num_res_centroids=kr, outlier_vector_len=vo, num_outlier_centroids=ko,
                  group_num=group_num, outlier_size=osz)


# (name, spec, perm, norm, bias): every vector length 1..16 used by the brief, k 2..65536 (index widths up to
# 16 bits, offsets wider than 16 bits), residual, outliers with several vo, group_num 1/2/3 and group_size 1,
# out not divisible by v.
LAYERS = [
    ("v2-k2", _spec(40, 31, 2, 2), True, False, False),
    ("v3-k16-res16-outl-v2-g2", _spec(43, 29, 3, 16, 16, 2, (3, 2, 16)), False, True, True),
    ("v4-k256-g3", _spec(96, 64, 4, 256, group_num=3), True, True, False),
    ("v5-k4096-res256", _spec(50, 33, 5, 4096, 256), False, False, True),
    ("v6-k4096-outl-v4", _spec(69, 100, 6, 4096, outliers=(5, 4, 256)), True, False, False),
    ("v7-k65536", _spec(24, 20, 7, 65536), False, True, False),
    ("v8-k256-res256", _spec(64, 64, 8, 256, 256), True, True, True),
    ("v12-k4096-outl-v6", _spec(34, 50, 12, 4096, outliers=(2, 6, 16)), False, False, True),
    ("v16-k65536-res2", _spec(40, 33, 16, 65536, 2), True, False, False),
    ("v4-k16-gs1", _spec(24, 17, 4, 16, group_num=24), True, False, True),
    ("v8-k2-gs1-outl-v3", _spec(5, 9, 8, 2, group_num=3, outliers=(2, 3, 4)), False, True, False),
    ("v6-k16-res4-g2-outl-v8", _spec(64, 55, 6, 16, 4, 2, (4, 8, 2)), False, True, False),
    ("v2-k65536-res65536-outl-v16", _spec(37, 17, 2, 65536, 65536, outliers=(5, 16, 65536)), True, True, True),
    ("v1-k16", _spec(20, 10, 1, 16), True, False, False),
    ("v16-k4096-outl-v12", _spec(52, 47, 16, 4096, outliers=(4, 12, 64)), True, True, True),
    ("v4-k4096-outl-v4", _spec(48, 70, 4, 4096, outliers=(3, 4, 256)), True, False, True),  # bf16 codebook on AVX2
]

# Big enough to run on ATen's thread pool with 2 threads.
BIG_LAYERS = [
    ("v6-k4096-outl-v4-big", _spec(516, 600, 6, 4096, outliers=(4, 4, 256)), True, True, True),
    ("v4-k256-res256-big", _spec(768, 515, 4, 256, 256), True, False, False),
    ("v16-k256-big", _spec(512, 301, 16, 256), False, True, True),
]


def _check_vq(spec: VQSpec, perm: bool, norm: bool, bias: bool, tokens, name: str, seed: int = 0) -> None:  # noqa: ANN001
    for dtype in DTYPES:
        layer = synthetic.random_vq_layer(spec, seed=seed, dtype=dtype, perm=perm, norm=norm, bias=bias)
        prepared = native.prepare_vq(spec, **_vq_fields(layer))
        gen = torch.Generator().manual_seed(seed + 1)
        for n in tokens:
            x = torch.randn(n, spec.in_features, generator=gen).to(dtype)
            _close(native.vq_linear(x, prepared), _ref_vq(x, spec, layer), f"{name} {dtype} tokens={n}")


# --------------------------------------------------------------------------------------- VQ layers
@pytest.mark.parametrize("name,spec,perm,norm,bias", LAYERS, ids=[entry[0] for entry in LAYERS])
def test_vq_matches_reference(ext, threads, name, spec, perm, norm, bias):
    threads(1)
    _check_vq(spec, perm, norm, bias, TOKENS, name)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("name,spec,perm,norm,bias", BIG_LAYERS, ids=[entry[0] for entry in BIG_LAYERS])
def test_vq_threads(ext, threads, num_threads, name, spec, perm, norm, bias):
    threads(num_threads)
    _check_vq(spec, perm, norm, bias, (1, 2, 5, 8, 33), f"{name} threads={num_threads}")


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_vq_lower_isas(ext, threads, isa):
    """The AVX2 and plain C++ kernels (forced) on the same layouts (only where this CPU can run them)."""
    levels = ["scalar", "avx2", "avx512"]
    if levels.index(isa) > levels.index(native.cpu_isa()):
        pytest.skip(f"this CPU has no {isa}")
    threads(1)
    assert native.set_isa(isa) == isa
    try:
        for name, spec, perm, norm, bias in LAYERS:
            _check_vq(spec, perm, norm, bias, (1, 3, 8, 9), f"{isa} {name}")
        name, spec, perm, norm, bias = BIG_LAYERS[0]
        threads(2)
        _check_vq(spec, perm, norm, bias, (1, 4, 33), f"{isa} {name} threads=2")
    finally:
        native.set_isa("auto")


def test_prefill_paths(ext, threads):
    """Every prefill path (oneDNN micro-kernel when this CPU has it; tiles + torch.mm in bf16 and tiles + fp32
    torch.mm for bf16 x, always) on even and odd in, with and without bias."""
    threads(1)
    auto = native.set_prefill("auto")
    assert auto in ("brgemm", "mm", "fp32")
    assert native.set_prefill("fp32") == "fp32" and native.set_prefill("mm") == "mm"
    with pytest.raises(RuntimeError, match="prefill mode must be auto, mm, brgemm or fp32"):
        native.set_prefill("bf16")
    modes = ["mm", "fp32"] + (["brgemm", "brgemm-gather"] if auto == "brgemm" else [])
    tuning = native._ext()  # private knob: perm via a gather of x (big layers) or via the index order (small ones)
    try:
        for mode in modes:
            native.set_prefill(mode.split("-")[0])
            tuning.set_gather(1 if mode.endswith("gather") else 2)
            for name, spec, perm, norm, bias in (LAYERS[2], LAYERS[4], LAYERS[6], LAYERS[11], LAYERS[14]):
                _check_vq(spec, perm, norm, bias, (9, 40), f"{mode} {name}")
            for bits, group_size in ((4, 128), (3, 48), (8, 7)):
                made, kwargs = _scalar_layer(37, 256, bits, group_size, torch.bfloat16, seed=3)
                prepared = native.prepare_scalar(**kwargs)
                x = torch.randn(21, 256).to(torch.bfloat16)
                _close(native.scalar_linear(x, prepared), _ref_scalar(x, made), f"{mode} scalar {bits} g{group_size}")
    finally:
        native.set_prefill("auto")
        tuning.set_gather(0)


def test_prefill_on_two_threads_under_inference_mode(ext, threads):
    """The prefill paths run ATen GEMMs on torch's worker threads into an output made under inference mode (the
    chat's decode loop): the workers carry the caller's inference mode, in every path."""
    threads(2)
    name, spec, perm, norm, bias = BIG_LAYERS[0]
    layer = synthetic.random_vq_layer(spec, seed=0, dtype=torch.bfloat16, perm=perm, norm=norm, bias=bias)
    prepared = native.prepare_vq(spec, **_vq_fields(layer))
    made, kwargs = _scalar_layer(515, 768, 4, 128, torch.bfloat16, seed=7)
    scalar = native.prepare_scalar(**kwargs)
    x, xs = torch.randn(64, spec.in_features).to(torch.bfloat16), torch.randn(64, 768).to(torch.bfloat16)
    want, want_s = _ref_vq(x, spec, layer), _ref_scalar(xs, made)
    modes = ["mm", "fp32"] + (["brgemm"] if native.set_prefill("auto") == "brgemm" else [])
    try:
        for mode in modes:
            native.set_prefill(mode)
            with torch.inference_mode():
                _close(native.vq_linear(x, prepared), want, f"{mode} {name} inference mode")
                _close(native.scalar_linear(xs, scalar), want_s, f"{mode} scalar inference mode")
    finally:
        native.set_prefill("auto")


def test_vq_input_forms(ext):
    """Leading dims, non-contiguous x, fp16 x, int16/int32/int64 perm, VQWeights or separate tensors."""
    spec = _spec(69, 100, 6, 4096, outliers=(5, 4, 256))
    for perm_dtype in (torch.int16, torch.int32, torch.int64):
        layer = synthetic.random_vq_layer(spec, seed=3, dtype=torch.float32, perm=True, norm=True,
                                          perm_dtype=perm_dtype)
        fields = _vq_fields(layer)
        prepared = native.prepare_vq(spec, **fields)
        x = torch.randn(2, 3, 69)
        _close(native.vq_linear(x, prepared), _ref_vq(x, spec, layer), f"3-d x perm {perm_dtype}")
        xt = torch.randn(69, 4).t()  # non-contiguous
        _close(native.vq_linear(xt, prepared), _ref_vq(xt, spec, layer), "non-contiguous x")
    again = native.prepare_vq(spec, layer)  # the whole VQWeights / dict in place of indices
    x = torch.randn(1, 69)
    torch.testing.assert_close(native.vq_linear(x, again), native.vq_linear(x, prepared))
    x16 = torch.randn(3, 69).half()
    y16 = native.vq_linear(x16, prepared)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.float(), _ref_vq(x16.float(), spec, layer), rtol=2e-3, atol=2e-3)
    assert native.vq_linear(torch.randn(0, 69), prepared).shape == (0, 100)


def test_vq_concurrent_calls(ext, threads):
    """Several Python threads calling the same prepared layers (thread-local scratch) get the right answers."""
    threads(2)
    spec = _spec(516, 600, 6, 4096, outliers=(4, 4, 256))
    layer = synthetic.random_vq_layer(spec, seed=5, dtype=torch.bfloat16, perm=True, norm=True, bias=True)
    prepared = native.prepare_vq(spec, **_vq_fields(layer))
    xs = [torch.randn(n, 516).bfloat16() for n in (1, 3, 8, 20)]
    expected = [native.vq_linear(x, prepared) for x in xs]
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(20):
            for x, want in zip(xs, expected):
                if not torch.equal(native.vq_linear(x, prepared), want):
                    errors.append(f"thread {i}: tokens={x.shape[0]}")
                    return

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors


def test_vq_rejects_bad_inputs(ext):
    spec = _spec(40, 31, 2, 16)
    layer = _vq_fields(synthetic.random_vq_layer(spec, seed=0))
    prepared = native.prepare_vq(spec, **layer)
    with pytest.raises(RuntimeError, match="last dimension"):
        native.vq_linear(torch.randn(2, 39), prepared)
    with pytest.raises(RuntimeError):
        native.prepare_vq(spec, **dict(layer, indices=layer["indices"][:, :-1]))
    with pytest.raises(RuntimeError, match="vector lengths"):
        big = VQSpec(40, 31, 20, 16)
        native.prepare_vq(big, **_vq_fields(synthetic.random_vq_layer(big, seed=0)))


# --------------------------------------------------------------------------------------- scalar layers
SCALAR_BITS = (2, 3, 4, 5, 8)
SCALAR_GROUPS = (256, 32, 128, 48, 7)  # in_features = 256: per-channel, 32, 128, odd ones


@pytest.mark.parametrize("bits", SCALAR_BITS)
def test_scalar_matches_reference(ext, threads, bits):
    threads(1)
    for group_size in SCALAR_GROUPS:
        for dtype in DTYPES:
            made, kwargs = _scalar_layer(37, 256, bits, group_size, dtype, seed=bits)
            prepared = native.prepare_scalar(**kwargs)
            for n in TOKENS:
                x = torch.randn(n, 256).to(dtype)
                _close(native.scalar_linear(x, prepared), _ref_scalar(x, made),
                       f"bits={bits} g={group_size} {dtype} tokens={n}")


def test_scalar_1bit_threads_and_isas(ext, threads):
    made, kwargs = _scalar_layer(37, 200, 1, 64, torch.float32)
    prepared = native.prepare_scalar(**kwargs)
    x = torch.randn(3, 200)
    _close(native.scalar_linear(x, prepared), _ref_scalar(x, made), "1-bit")
    levels = ["scalar", "avx2", "avx512"]
    isas = levels[: levels.index(native.cpu_isa()) + 1]
    cases = []
    for bits, group_size in ((4, 128), (3, 48), (8, 7)):
        for dtype in DTYPES:
            made, kwargs = _scalar_layer(515, 768, bits, group_size, dtype, seed=7)
            prepared = native.prepare_scalar(**kwargs)
            for n in (1, 4, 9):
                x = torch.randn(n, 768).to(dtype)
                cases.append((prepared, x, _ref_scalar(x, made), f"bits={bits} g={group_size} {dtype} tokens={n}"))
    try:
        for isa in isas:
            native.set_isa(isa)
            for num_threads in (1, 2):
                threads(num_threads)
                for prepared, x, ref, what in cases:
                    _close(native.scalar_linear(x, prepared), ref, f"{isa} threads={num_threads} {what}")
    finally:
        native.set_isa("auto")


# --------------------------------------------------------------------------------------- activations
def test_act_quant_equals_the_python_fake_quant_exactly(ext, threads):
    """The C++ activation fake-quant gives bit for bit quantize_activations' values: every granularity, 4 and 8
    bits, fp32 / bf16 / fp16 inputs, widths that leave vector tails, all-zero tokens, every ISA, 1 and 2 threads."""
    from vptq_core.quant.act_quant import quantize_activations

    gen = torch.Generator().manual_seed(3)
    levels = ["scalar", "avx2", "avx512"]
    try:
        for isa in levels[: levels.index(native.cpu_isa()) + 1]:
            native.set_isa(isa)
            for num_threads in (1, 2):
                threads(num_threads)
                for width in (5, 96, 577):
                    x = torch.randn(70, width, generator=gen) * torch.logspace(-3, 1, width)
                    x[3] = 0  # the EPS floor
                    x[4] = x[4].abs()  # one-signed tokens: the asymmetric grid's zero sits at an end
                    x[5] = -x[5].abs()
                    x[6, 0] = 300.0  # a massive activation
                    for dtype in (torch.float32, torch.bfloat16, torch.float16):
                        xd = x.to(dtype).reshape(7, 10, width)
                        for granularity in ("token", "token_asym", "tensor"):
                            scale = torch.tensor(0.02) if granularity == "tensor" else None
                            for bits in (4, 8):
                                want = quantize_activations(xd, bits, granularity, scale)
                                got = native.act_quant(xd, granularity, bits, 0.02 if scale is not None else 0.0)
                                assert got.dtype == dtype and got.shape == xd.shape
                                assert torch.equal(got, want), (isa, num_threads, width, dtype, granularity, bits)
    finally:
        native.set_isa("auto")
    with pytest.raises(ValueError, match="granularity must be one of"):
        native.act_quant(torch.zeros(2, 4), "channel", 8)
    with pytest.raises(RuntimeError, match="static scale must be positive"):
        native.act_quant(torch.zeros(2, 4), "tensor", 8, 0.0)


# --------------------------------------------------------------------------------------- status / fallback
@pytest.mark.slow  # subprocesses or a served app: seconds each
def test_disabled_by_environment(monkeypatch):
    """VPTQ_NATIVE=0 forces the fallback: status() says why, entry points raise, importing never does."""
    monkeypatch.setenv("VPTQ_NATIVE", "0")
    usable, reason = native.status()
    assert not usable and "VPTQ_NATIVE=0" in reason
    with pytest.raises(RuntimeError, match="VPTQ_NATIVE=0"):
        native.prepare_scalar(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), torch.zeros(1, 1), None, 4,
                              8, 8)
    out, err = _fallback_run(VPTQ_NATIVE="0")
    assert out.startswith("fallback: native kernels disabled by VPTQ_NATIVE=0 | backend cpu | close")
    assert err.count("VPTQ_NATIVE=0") == 1, err  # one line, once


# A process that binds a small layer automatically and compares it with the reference: prints
# "fallback: <reason> | backend <name> | close" (or "usable ...").
_FALLBACK_CODE = """
import torch
import vptq_core.kernels.native as n
from vptq_core.kernels import VQSpec, bind_vq, reference, synthetic
spec = VQSpec(48, 40, 4, 16, num_res_centroids=4, outlier_vector_len=2, num_outlier_centroids=8, outlier_size=6)
w = synthetic.random_vq_layer(spec, seed=0, dtype=torch.float32, perm=True, norm=True, bias=True)
k = bind_vq(spec, w)
x = torch.randn(3, 48)
torch.testing.assert_close(k(x), reference.vq_linear(x, spec, w), rtol=2e-5, atol=2e-5)
k(x)
ok, why = n.status()
print(('usable' if ok else 'fallback: ' + why) + ' | backend ' + k.backend + ' | close')
"""


def _fallback_run(**env: str) -> tuple[str, str]:
    base = {k: v for k, v in os.environ.items() if k != "VPTQ_NATIVE"}  # the case under test decides
    run = subprocess.run([sys.executable, "-c", _FALLBACK_CODE], cwd=ROOT, env=dict(base, **env),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip(), run.stderr


@pytest.mark.slow  # subprocesses or a served app: seconds each
def test_no_compiler_falls_back_to_numba(tmp_path):
    """An empty build cache and no compiler (a Space without one): numba kernels, same outputs, one line."""
    out, err = _fallback_run(VPTQ_NATIVE_CACHE=str(tmp_path), CXX=str(tmp_path / "no-such-c++"))
    assert out.startswith("fallback: native kernels unavailable: no C++ compiler found") and "backend cpu" in out
    assert len([line for line in err.splitlines() if "no C++ compiler" in line]) == 1, err
    assert "using the cpu kernels" in err


@pytest.mark.slow
def test_failed_build_falls_back_to_numba(tmp_path):
    """A compiler that fails: "build failed: <first error line>", numba kernels, same outputs."""
    cxx = tmp_path / "broken-c++"
    cxx.write_text("#!/bin/sh\necho 'fake.cpp:1:1: error: this compiler always fails' >&2\nexit 1\n")
    cxx.chmod(0o755)
    out, err = _fallback_run(VPTQ_NATIVE_CACHE=str(tmp_path / "cache"), CXX=str(cxx))
    assert out.startswith("fallback: native kernels unavailable: build failed") and "backend cpu" in out


@pytest.mark.slow  # subprocesses or a served app: seconds each
def test_build_in_progress_elsewhere_times_out_to_numba(tmp_path, monkeypatch):
    """Another live process holds the build lock: after VPTQ_NATIVE_WAIT seconds the fallback runs (no hang)."""
    monkeypatch.setenv("VPTQ_NATIVE_CACHE", str(tmp_path))
    build_dir = native._build_dir()
    build_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (build_dir / "build.lock").write_text(f"pid={holder.pid} host={native.socket.gethostname()} started=0\n")
        out, err = _fallback_run(VPTQ_NATIVE_CACHE=str(tmp_path), VPTQ_NATIVE_WAIT="1")
    finally:
        holder.kill()
        holder.wait()
    assert out.startswith("fallback: native kernels unavailable: build not finished after 1 s") and "backend cpu" in out
    assert "using the cpu kernels" in err


def test_stale_locks_are_taken_over(tmp_path, monkeypatch):
    """A lock of a process that is gone, an old one, or garbage left for a while is taken over; a live one is
    waited for until the deadline."""
    import time

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = native.socket.gethostname()
    lock = tmp_path / "build.lock"
    for text, age in ((f"pid={dead.pid} host={host} started=0", 0), (f"pid={os.getpid()} host=other", 3600),
                      ("", 60)):
        lock.write_text(text)
        os.utime(lock, (time.time() - age, time.time() - age))
        assert native._acquire_build_lock(tmp_path, time.monotonic()) == lock
        assert f"pid={os.getpid()}" in lock.read_text()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="another process is building the native kernels"):
        native._acquire_build_lock(tmp_path, time.monotonic() + 0.5)  # held by this (live) process
    assert 0.4 < time.monotonic() - t0 < 5


def test_builder_removes_a_killed_builds_torch_lock(tmp_path, monkeypatch):
    """torch's cpp_extension waits forever on its 'lock' file; one left by a killed build is removed by the next
    builder (which holds build.lock), and build.lock is released after the build."""
    monkeypatch.setattr(native, "_build_dir", lambda: tmp_path)
    (tmp_path / "lock").write_text("")
    seen = []
    monkeypatch.setattr(native, "_compile", lambda d: seen.append(((d / "lock").exists(),
                                                                   (d / "build.lock").exists())) or "module")
    assert native._build_or_import(native.time.monotonic() + 5) == "module"
    assert seen == [(False, True)] and not (tmp_path / "build.lock").exists()


def test_bad_wait_setting(monkeypatch):
    monkeypatch.setenv("VPTQ_NATIVE_WAIT", "soon")
    with pytest.raises(ValueError, match="VPTQ_NATIVE_WAIT must be a number of seconds, got 'soon'"):
        native._wait_seconds()


# --------------------------------------------------------------------------------------- a whole checkpoint
@pytest.mark.parametrize("kind", ["vq", "scalar"])
def test_checkpoint_logits_native_equal_reference(ext, tmp_path, kind):
    """A saved and loaded checkpoint (every layout of tests/conftest.py's VQ_LAYOUTS, or 2/3/4-bit scalar codes
    with 8-bit activations) gives the reference backend's logits with the native kernels, at prefill (brgemm /
    tiles) and through greedy decode steps (GEMV); bf16 model, float32 logits."""
    from conftest import VQ_LAYOUTS
    from factories import random_scalar_state, random_vq_state
    from torch import nn

    from vptq_core import generation
    from vptq_core.models import tiny_random_llama
    from vptq_core.storage.checkpoint import load_quantized, save_quantized
    from vptq_core.storage.modules import ScalarQLinear, VQLinear

    model, tok = tiny_random_llama()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}
    if kind == "vq":
        states = {n: random_vq_state(m.in_features, m.out_features, **VQ_LAYOUTS[n.rpartition(".")[2]], seed=i)
                  for i, (n, m) in enumerate(linears.items())}
    else:
        states = {n: random_scalar_state(m.in_features, m.out_features, bits=(2, 3, 4)[i % 3], group_size=16,
                                         method="rtn", seed=i, **({"act_bits": 8} if "mlp" in n else {}))
                  for i, (n, m) in enumerate(linears.items())}
    path = save_quantized(model, tok, states, tmp_path / "ckpt", report={"method": kind}, dtype=torch.bfloat16)
    loaded = {name: load_quantized(path)[0].eval() for name in ("native", "reference")}
    for name, m in loaded.items():
        for module in m.modules():
            if isinstance(module, (VQLinear, ScalarQLinear)):
                module.backend = name
    prompt = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = {name: m(prompt).logits.float() for name, m in loaded.items()}
    backends = {module._kernel.backend for module in loaded["native"].modules() if isinstance(module, (VQLinear,
                ScalarQLinear))}
    assert backends == {"native"}
    torch.testing.assert_close(out["native"], out["reference"], rtol=0.05, atol=0.05 * out["reference"].abs().max())
    for m in loaded.values():
        m.generation_config.eos_token_id = None
    greedy = {name: generation.decode_loop(m, prompt, 6) for name, m in loaded.items()}
    assert greedy["native"] == greedy["reference"]
