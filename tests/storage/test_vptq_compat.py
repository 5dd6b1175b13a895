"""The public ``vptq`` reader (0.0.5.post1, torch fallback on CPU) reads our checkpoints to the same outputs.

Needs the dev extras (see requirements-dev: vptq installed with --no-deps plus the imports its package
``__init__`` pulls in). Its whole-model loader (``vptq.AutoModelForCausalLM``) targets transformers 4.x, so the
model is assembled here with its own ``make_quant_linear`` + ``VQuantLinear`` on a transformers skeleton.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VQ_LAYOUTS
from factories import random_vq_state
from safetensors.torch import load_file
from torch import nn

from vptq_core.models import tiny_random_llama
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.modules import VQLinear

vqlinear = pytest.importorskip(
    "vptq.layers.vqlinear", reason="the public vptq package (pip install --no-deps vptq==0.0.5.post1) is not installed"
)
model_base = pytest.importorskip("vptq.layers.model_base", reason="vptq.layers.model_base does not import here")

# The checkpoint tests' layouts, with k = 4096 for up_proj to exercise 12-bit index entries.
LAYOUTS = {**VQ_LAYOUTS, "up_proj": {**VQ_LAYOUTS["up_proj"], "num_centroids": 4096}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, tok = tiny_random_llama()
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]
    states = {
        name: random_vq_state(m.in_features, m.out_features, **LAYOUTS[name.rpartition(".")[2]], seed=i)
        for i, (name, m) in enumerate(linears)
    }
    return save_quantized(model, tok, states, tmp_path_factory.mktemp("compat") / "ckpt", dtype=torch.bfloat16)


def public_module(layer_config: dict, tensors: dict, dtype: torch.dtype) -> nn.Module:
    module = vqlinear.VQuantLinear(**layer_config, enable_proxy_error=False, dtype=dtype)
    module.load_state_dict(tensors, strict=True)  # exact public names, shapes and dtypes
    return module.eval()


def test_each_layer_matches_public_vquantlinear(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    tensors = load_file(str(checkpoint / "model.safetensors"))
    ours, _ = load_quantized(checkpoint, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    assert len(config["config_for_layers"]) == 14
    for name, layer_config in config["config_for_layers"].items():
        layer_tensors = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
        public = public_module(layer_config, layer_tensors, torch.bfloat16).float()
        mine = ours.get_submodule(name)
        assert isinstance(mine, VQLinear)
        x = torch.randn(3, layer_config["in_features"], generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(mine(x), public(x), rtol=1e-5, atol=1e-6, msg=name)
            torch.testing.assert_close(mine(x[:1]), public(x[:1]), rtol=1e-5, atol=1e-6, msg=name)


def test_layer_with_bias_matches_public_vquantlinear():
    state = random_vq_state(
        48,
        20,
        vector_len=6,
        num_centroids=32,
        num_res_centroids=8,
        group_num=2,
        outlier_size=8,
        outlier_vector_len=4,
        num_outlier_centroids=16,
        norm=True,
        perm=True,
        bias=True,
        seed=9,
    )
    mine = VQLinear.from_state(state, torch.float32)
    public = public_module(mine.layer_config(), mine.state_dict(), torch.float32)
    x = torch.randn(4, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mine(x), public(x), rtol=1e-5, atol=1e-6)


def test_whole_model_through_public_make_quant_linear(checkpoint):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(checkpoint)), dtype=torch.bfloat16)
    model_base.make_quant_linear(
        skeleton, config["config_for_layers"], config["shared_layer_config"], target_layer=vqlinear.VQuantLinear
    )
    result = skeleton.load_state_dict(load_file(str(checkpoint / "model.safetensors")), strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == ["lm_head.weight"]
    skeleton.tie_weights()
    skeleton.eval()
    ours, _ = load_quantized(checkpoint)
    prompt = torch.tensor([[5, 17, 42, 99, 3, 250, 77, 8]])
    with torch.no_grad():
        theirs_logits = skeleton(prompt).logits.float()
        ours_logits = ours(prompt).logits.float()
    # Bit-identical with backend='reference'; the fused kernels (auto) accumulate bf16 in another order.
    torch.testing.assert_close(ours_logits, theirs_logits, rtol=2e-2, atol=2e-2)
    assert torch.equal(ours_logits.argmax(-1), theirs_logits.argmax(-1))
