"""8-bit codebooks (``codebook_bits`` 8): the grid, the bits it saves, and the quantizer and training keeping
the codebooks on it."""

import dataclasses

import pytest
import torch
from factories import random_vq_state

from vptq_core.quant.bits import vq_bits
from vptq_core.quant.codebook_grid import LEVELS, from_grid, snap, to_grid
from vptq_core.quant.config import VPTQConfig
from vptq_core.quant.trainable import CodebookLinear, write_states
from vptq_core.quant.vptq import vptq_quantize


def _on_grid(table: torch.Tensor, v: int) -> bool:
    """Every entry an integer multiple of its row's and dimension's scale, |code| <= 127."""
    codes, scale = to_grid(table, v)
    return bool(torch.allclose(from_grid(codes, scale, v), table.float(), rtol=2e-7, atol=0))


def test_the_grid_holds_every_entry_within_half_a_step_and_its_largest_exactly():
    torch.manual_seed(0)
    table = torch.randn(3, 64 * 4) * torch.tensor([1.0, 0.01, 30.0])[:, None]
    codes, scale = to_grid(table, 4)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 4)
    assert int(codes.abs().max()) == LEVELS
    values = from_grid(codes, scale, 4).reshape(3, 64, 4)
    err = (values - table.reshape(3, 64, 4)).abs()
    assert bool((err <= scale[:, None, :] / 2 * (1 + 1e-6)).all())
    amax = table.reshape(3, 64, 4).abs().amax(1)
    torch.testing.assert_close(values.abs().amax(1), amax, rtol=1e-6, atol=0)


def test_snap_is_a_projection_and_keeps_dtype_and_zero_columns():
    torch.manual_seed(1)
    table = torch.randn(2, 32 * 3)
    table[:, 1::3] = 0  # a dimension that is zero in every centroid
    once = snap(table, 3)
    assert once.dtype == table.dtype and bool((once[:, 1::3] == 0).all())
    assert torch.equal(to_grid(snap(once, 3), 3)[0], to_grid(once, 3)[0])
    torch.testing.assert_close(snap(once, 3), once, rtol=2e-7, atol=0)  # at most one float32 rounding
    assert snap(table.bfloat16(), 3).dtype == torch.bfloat16


@pytest.mark.parametrize("bad, match", [
    (lambda: to_grid(torch.zeros(2, 10), 4), r"\[rows, k \* vector_len\]"),
    (lambda: from_grid(torch.zeros(2, 8), torch.ones(2, 4), 4), "int8"),
    (lambda: from_grid(torch.zeros(2, 8, dtype=torch.int8), torch.ones(1, 4), 4), r"scale must be \[2, 4\]"),
])
def test_the_grid_names_a_wrong_shape_or_dtype(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_an_8_bit_codebook_costs_8_bits_per_entry_and_32_per_scale():
    base = vq_bits(576, 576, 6, 4096)
    eight = vq_bits(576, 576, 6, 4096, codebook_bits=8)
    assert eight.index_bits == base.index_bits
    assert eight.total_bits == base.index_bits + 4096 * 6 * 8 + 6 * 32
    # residual, outlier codebooks and groups: every table at 8 bits, a scale per row and dimension of each
    full = vq_bits(64, 70, 4, 16, num_res_centroids=4, outlier_size=6, outlier_vector_len=2, outlier_centroids=8,
                   group_num=2, codebook_bits=8)
    index = 2 * 16 * 32 * (4 + 2) + 32 * 6 * 16
    assert full.total_bits == index + 2 * 4 * (16 + 4) * 8 + 2 * 2 * 4 * 32 + 2 * 8 * 8 + 2 * 32
    with pytest.raises(ValueError, match="codebook_bits must be 16 or 8, got 4"):
        vq_bits(64, 64, 4, 16, codebook_bits=4)


def test_the_setting_refuses_other_widths():
    assert VPTQConfig(codebook_bits=8).codebook_bits == 8
    with pytest.raises(ValueError, match="codebook_bits must be"):
        VPTQConfig(codebook_bits=4)


def test_the_quantizer_assigns_against_the_stored_grid_and_counts_its_bits(correlated_layer):
    W, H = correlated_layer
    common = dict(vector_len=4, num_centroids=64, num_res_centroids=16, outlier_percent=5, outlier_vector_len=2,
                  outlier_centroids=8, kmeans_iters=3)
    wide_result = vptq_quantize(W, H, VPTQConfig(**common))
    result = vptq_quantize(W, H, VPTQConfig(**common, codebook_bits=8))
    wide, state = wide_result.state, result.state
    assert state.codebook_bits == 8 and state.layer_config()["codebook_bits"] == 8 and "codebook_bits" not in \
        wide.layer_config()
    for name, (table, v) in state.codebook_tables().items():
        assert _on_grid(table, v), name
    saved = wide.storage_bits().total_bits - state.storage_bits().total_bits
    assert saved == 8 * (wide.centroids.numel() + wide.res_centroids.numel() + wide.outlier_centroids.numel()) \
        - 32 * (4 + 4 + 2)
    # the grid costs the layer almost nothing: its proxy loss within 3% of the 16-bit codebooks' (both ways within
    # a few percent, as the sweep's choices differ), far from the next coarser layout's
    coarse = vptq_quantize(W, H, VPTQConfig(**{**common, "num_centroids": 32})).proxy_loss
    assert result.proxy_loss <= wide_result.proxy_loss * 1.03 < coarse
    # a codebook refit moves the entries off the grid; the layer is put back on it, and its loss stays near
    refit = vptq_quantize(W, H, VPTQConfig(**common, codebook_bits=8, refit_iters=2))
    for name, (table, v) in refit.state.codebook_tables().items():
        assert _on_grid(table, v), name
    assert refit.proxy_loss <= result.proxy_loss * 1.03


def test_training_writes_the_codebooks_back_onto_the_grid():
    state = dataclasses.replace(random_vq_state(32, 16, vector_len=4, num_centroids=16, seed=3), codebook_bits=8)
    state.snap_codebooks()
    layer = CodebookLinear(state)
    with torch.no_grad():
        layer.params["centroids"].add_(torch.randn_like(layer.params["centroids"]) * 0.01)
    linear = torch.nn.Linear(32, 16, bias=False)
    write_states({"l": linear}, {"l": layer}, {"l": state})
    assert _on_grid(state.centroids, 4)
    moved = layer.params["centroids"].detach().reshape(state.centroids.shape)
    assert not torch.equal(state.centroids, moved)
    torch.testing.assert_close(state.centroids, snap(moved, 4))
