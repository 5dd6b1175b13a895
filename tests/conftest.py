"""Shared fixtures: a seeded tiny random llama, calibration ids and a calibration text file (built once per
session)."""

from __future__ import annotations

import pytest
import torch


def pytest_sessionstart(session):
    # Start building (or loading) the native CPU kernels while the first tests run, once per machine: later
    # processes load the cached build, and a process that finds a build in progress waits for it (bounded by
    # VPTQ_NATIVE_WAIT, then the numba kernels run). Nothing happens with VPTQ_NATIVE=0.
    # The checkout's top-level name on purpose: `vptq_core.kernels` would first run vptq_core/__init__, which
    # imports transformers for its integration; the tests run from a checkout, where `import vptq_core` later
    # makes `vptq_core.kernels` these same modules (vptq_core/_repo_kernels.py).
    from kernels import native

    native.warm_up(background=True)


@pytest.fixture(scope="session")
def tiny_model():
    # Imported here, not at the top: vptq_core imports triton, and tests/kernels/test_triton_kernels.py must be able to
    # set TRITON_INTERPRET=1 before triton's first import (conftest is imported before every test module).
    from vptq_core.models import tiny_random_llama

    return tiny_random_llama()


@pytest.fixture(scope="session")
def calib_ids() -> torch.Tensor:
    return torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> str:
    """A small plain-English text file for calibration and evaluation from a path."""
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("A small corpus of plain English words for calibration and evaluation. " * 60, encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def calib(text_file):
    """Calibration settings over ``text_file``: 4 windows of 32 tokens."""
    from vptq_core.quant.config import CalibConfig

    return CalibConfig(text=text_file, samples=4, seqlen=32, seed=0)


@pytest.fixture
def correlated_layer():
    """A weight [96, 64] and a non-diagonal Hessian [64, 64] from correlated, unevenly scaled inputs."""
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(96, 64, generator=gen)
    X = torch.randn(4096, 64, generator=gen) @ torch.randn(64, 64, generator=gen) * 0.3
    X = X * torch.linspace(0.2, 3.0, 64)
    return W, 2 * X.T @ X / X.shape[0]


# Per projection kind: a different VPTQ layout, so one checkpoint covers residual, outliers, groups, norm, perm.
VQ_LAYOUTS = {
    "q_proj": {"vector_len": 4, "num_centroids": 16, "perm": True},
    "k_proj": {"vector_len": 4, "num_centroids": 16, "num_res_centroids": 4, "norm": True},
    "v_proj": {
        "vector_len": 4,
        "num_centroids": 8,
        "outlier_size": 8,
        "outlier_vector_len": 2,
        "num_outlier_centroids": 16,
        "perm": True,
        "norm": True,
    },
    "o_proj": {"vector_len": 8, "num_centroids": 32, "group_num": 2},
    "gate_proj": {"vector_len": 6, "num_centroids": 64, "num_res_centroids": 16, "perm": True},
    "up_proj": {"vector_len": 4, "num_centroids": 16, "group_num": 4, "norm": True},
    "down_proj": {
        "vector_len": 4,
        "num_centroids": 16,
        "outlier_size": 16,
        "outlier_vector_len": 4,
        "num_outlier_centroids": 8,
        "group_num": 2,
        "perm": True,
    },
}
