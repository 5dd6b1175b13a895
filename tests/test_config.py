import pytest

from vptq_core.quant.config import CalibConfig, LRQConfig, ScalarConfig, VPTQConfig
from vptq_core.quant.methods import make_config


def test_defaults_valid_and_bits():
    cfg = VPTQConfig()
    assert cfg.index_bits == 12 and cfg.bits_per_index_weight == 2.0
    assert VPTQConfig(vector_len=8, num_centroids=256, num_res_centroids=256).bits_per_index_weight == 2.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_centroids": 100}, "num_centroids must be a power of two in 2..65536, got 100"),
        ({"vector_len": 0}, "vector_len must be in 1..16, got 0"),
        ({"num_res_centroids": 3}, "num_res_centroids must be a power of two"),
        ({"outlier_percent": 75.0}, r"outlier_percent must be in \[0.0, 50.0\], got 75.0"),
        ({"damp_percent": 0.0}, r"damp_percent must be in \(0.0, 1.0\]"),
        ({"enable_norm": "yes"}, "enable_norm must be true or false"),
        ({"group_num": 1.5}, "group_num must be an integer"),
    ],
)
def test_vptq_config_errors_name_field_value_and_allowed(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VPTQConfig(**kwargs)


def test_scalar_lrq_calib_errors():
    with pytest.raises(ValueError, match="bits must be in 1..8, got 9"):
        ScalarConfig(bits=9)
    with pytest.raises(ValueError, match="act_granularity must be 'token'.*'token_asym'.*got 'channel'"):
        LRQConfig(act_granularity="channel")
    with pytest.raises(ValueError, match="seqlen must be in 8..131072, got 4"):
        CalibConfig(seqlen=4)


def test_method_config_from_dict():
    assert make_config("gptq", {"bits": 3}).bits == 3
    assert make_config("vptq", {"vector_len": 4}).vector_len == 4
    with pytest.raises(ValueError, match="unknown method 'awq'; allowed: vptq, gptq, rtn, lrq"):
        make_config("awq")
    with pytest.raises(ValueError, match=r"unknown VPTQConfig settings \['centroidz'\]"):
        make_config("vptq", {"centroidz": 4})
