import math

import pytest

from vptq_core.quant import methods
from vptq_core.quant.bits import scalar_bits, vq_bits
from vptq_core.quant.config import ScalarConfig, VPTQConfig
from vptq_core.quant.vptq import vptq_quantize


def test_vq_bits_exact_for_known_config():
    # 576x576, v6 k4096: 96 rows x 576 cols x 12 bits of indices; codebook 4096*6 floats of 16 bits.
    info = vq_bits(576, 576, 6, 4096)
    assert info.index_bits == 96 * 576 * 12
    assert info.total_bits == 96 * 576 * 12 + 4096 * 6 * 16
    assert info.index_bits_per_weight == 2.0
    assert math.isclose(info.total_bits_per_weight, 2.0 + 4096 * 6 * 16 / (576 * 576))


def test_vq_bits_residual_outliers_norm_perm():
    info = vq_bits(64, 70, 4, 16, num_res_centroids=4, outlier_size=6, outlier_vector_len=2, outlier_centroids=8,
                   group_num=2, norm=True, perm=True)
    index = 2 * 16 * 32 * (4 + 2) + 32 * 6 * 16  # outlier indices are stored as int16
    total = index + 2 * 4 * (16 + 4) * 16 + 2 * 8 * 16 + 2 * 70 * 16 + 70 * 16
    assert (info.index_bits, info.total_bits) == (index, total)


def test_scalar_bits():
    info = scalar_bits(10, 64, 3, 32)
    assert info.index_bits == 10 * 64 * 3
    assert info.total_bits == 10 * 64 * 3 + 2 * 10 * 2 * 16
    assert scalar_bits(10, 64, 3, 0).total_bits == 10 * 64 * 3 + 2 * 10 * 16


def test_state_bits_matches_config_bits(correlated_layer):
    W, H = correlated_layer
    cfg = VPTQConfig(vector_len=4, num_centroids=16, num_res_centroids=4, outlier_percent=5, outlier_vector_len=2,
                     outlier_centroids=8, group_num=2, enable_norm=True, kmeans_iters=2)
    state = vptq_quantize(W, H, cfg).state
    assert state.storage_bits() == methods.get("vptq").bits(cfg, 96, 64)


def test_model_bits_sums_layers():
    cfg = ScalarConfig(bits=4, group_size=0)
    total = methods.get("gptq").model_bits(cfg, [(8, 16), (16, 8)])
    assert total.weights == 256 and total.index_bits == 1024


@pytest.mark.parametrize("v,k", [(6, 4096), (4, 256)])
def test_index_bits_formula(v, k):
    assert vq_bits(v * 10, 32, v, k).index_bits_per_weight == pytest.approx(math.log2(k) / v)
