"""The lean decoder's fused native calls (q/k/v and gate/up of quantized layers in one call each, the other
quantized linears as bare C++ layers) give exactly the outputs of its plain path, which calls every module."""

from __future__ import annotations

import pytest
import torch

from vptq_core.kernels import VQSpec, native
from vptq_core.kernels.synthetic import random_scalar_layer, random_vq_layer
from vptq_core.models import tiny_random_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.quant.lean_decoder import LeanDecoder
from vptq_core.storage.modules import ScalarQLinear, VQLinear, set_submodule

pytestmark = pytest.mark.skipif(not native.status(wait=None)[0], reason="native kernels unavailable")


def _vq(linear: torch.nn.Module, seed: int, dtype: torch.dtype) -> VQLinear:
    spec = VQSpec(linear.in_features, linear.out_features, 4, 256 if seed % 2 else 1024, outlier_vector_len=4,
                  num_outlier_centroids=16, outlier_size=3)
    w = random_vq_layer(spec, seed=seed, dtype=dtype, perm=True)
    module = VQLinear.from_config(spec.layer_config(enable_perm=True), dtype=dtype)
    module.load_state_dict({"indices": w.indices, "centroids.weight": w.centroids, "perm": w.perm,
                            "outlier_indices": w.outlier_indices, "outlier_centroids.weight": w.outlier_centroids})
    return module


def _scalar(linear: torch.nn.Module, seed: int, dtype: torch.dtype, act: str | None) -> ScalarQLinear:
    group = 32 if act is None else linear.in_features
    _, w = random_scalar_layer(linear.out_features, linear.in_features, 4, group, seed=seed, dtype=dtype)
    module = ScalarQLinear(linear.in_features, linear.out_features, 4, group, act_bits=16 if act is None else 8,
                           act_granularity=act or "token", dtype=dtype)
    state = {"codes": w.codes, "scales": w.scales, "zeros": w.zeros}
    if act == "tensor":
        state["act_scale"] = torch.tensor(0.05, dtype=dtype)
    module.load_state_dict(state)
    return module


def _model(kind: str, dtype: torch.dtype):  # noqa: ANN202
    model, _ = tiny_random_model("llama", seed=1, hidden=64, intermediate=160)
    model = model.to(dtype).eval()
    for b, block in enumerate(decoder_blocks(model)):
        for i, (name, linear) in enumerate(block_linears(block).items()):
            seed = b * 8 + i
            if kind == "vq":
                module = _vq(linear, seed, dtype)
            elif kind == "mixed":  # q and gate VQ, the others scalar: those groups stay unfused
                module = _vq(linear, seed, dtype) if name.endswith(("q_proj", "gate_proj")) else \
                    _scalar(linear, seed, dtype, None)
            else:
                module = _scalar(linear, seed, dtype, None if kind == "scalar" else kind.split("-")[1])
            set_submodule(block, name, module)
    return model


def _run(dec: LeanDecoder, fused: bool, steps: int = 4) -> list[torch.Tensor]:
    saved = dec.layers
    dec.layers = dec.layers if fused else dec.plain_layers
    try:
        ids = torch.randint(3, 200, (1, 11), generator=torch.Generator().manual_seed(5))
        out = [dec.prefill(ids)]
        for _ in range(steps):
            out.append(dec.step(out[-1].argmax(-1, keepdim=True)))
        return out
    finally:
        dec.layers = saved


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["vq", "scalar", "scalar-token", "scalar-token_asym", "scalar-tensor", "mixed"])
def test_fused_calls_equal_the_plain_path(kind, dtype, num_threads):
    saved = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        model = _model(kind, dtype)
        dec = LeanDecoder(model, 20)
        layers = len(dec.layers)
        # per layer: qkv, o, gate_up, down replaced; mixed: only o and down (q/k/v and gate/up are of two kinds)
        assert dec.fused == (2 if kind == "mixed" else 4) * layers
        with torch.inference_mode():
            fused, plain = _run(dec, True), _run(dec, False)
        for a, b in zip(fused, plain):
            assert torch.equal(a, b)
        if kind.startswith("scalar-"):  # fake-quantized inputs: a bf16 rounding apart can flip a step
            return
        with torch.no_grad():
            dense = model(input_ids=torch.randint(3, 200, (1, 11), generator=torch.Generator().manual_seed(5)))
        ref = dense.logits[:, -1].float()
        err = (fused[0].float() - ref).abs().max() / ref.abs().max()  # the model's forward, within bf16 rounding
        assert err < 2e-2, float(err)
    finally:
        torch.set_num_threads(saved)


def test_hooked_linears_and_autograd_take_the_plain_path():
    model = _model("vq", torch.bfloat16)
    block = decoder_blocks(model)[0]
    calls = []
    block.self_attn.k_proj.register_forward_hook(lambda *_: calls.append("k"))
    dec = LeanDecoder(model, 20)
    assert dec.fused == 4 * len(dec.layers) - 1  # layer 0's q/k/v: one module hooked, the group runs the modules
    with torch.inference_mode():
        dec.prefill(torch.tensor([[5, 6, 7]]))
    assert calls == ["k"]
    with torch.enable_grad():  # autograd on: every module is called (their own autograd path where it applies)
        dec.prefill(torch.tensor([[5, 6, 7]]))
    assert calls == ["k", "k"]
