import copy
import dataclasses

import pytest
import torch

from vptq_core.quant.blocks import decoder_blocks
from vptq_core.quant.config import VPTQConfig
from vptq_core.quant.finetune import finetune_block_centroids
from vptq_core.quant.forward import block_dtype, capture_block_inputs, run_batched, run_block
from vptq_core.quant.methods import Cancelled
from vptq_core.quant.pipeline import quantize_model
from vptq_core.storage.checkpoint import load_quantized, save_quantized

TINY = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=3, outlier_percent=0.0)
HELD = [12, 13, 14, 15]


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    # 16 windows of 128 tokens: on this random model shorter or fewer windows make fine-tuning overfit (the
    # held-out check then rightly keeps the untuned block)
    return torch.randint(0, 256, (16, 128), generator=torch.Generator().manual_seed(1))


def _block_setup(tiny_model, windows, b=0):
    model, _ = tiny_model
    with torch.no_grad():
        inps, kwargs = capture_block_inputs(model, windows)
    qmodel, result = quantize_model(model, windows, "vptq", TINY)
    qblock = decoder_blocks(qmodel)[b]
    block = decoder_blocks(model)[b]
    kw = kwargs.at(b)
    with torch.no_grad():
        targets = run_batched(block, inps, kw)
    prefix = f"model.layers.{b}."
    states = {k[len(prefix):]: copy.deepcopy(v) for k, v in result.states.items() if k.startswith(prefix)}
    return copy.deepcopy(qblock), states, inps, targets, (lambda blk, x: run_block(blk, x, kw))


def _heldout_mse(block, inps, targets, forward, rows):
    with torch.no_grad():
        return float(torch.mean((forward(block, inps[rows]) - targets[rows]) ** 2))


def test_finetune_trains_norms_and_keeps_the_best_heldout_check(tiny_model, windows):
    block, states, inps, targets, forward = _block_setup(tiny_model, windows)
    norms_before = {n: p.detach().clone() for n, p in block.named_parameters() if p.dim() == 1}
    centroids_before = {n: st.centroids.clone() for n, st in states.items()}
    cfg = dataclasses.replace(TINY, finetune_iters=16, finetune_lr=3e-3, finetune_norm_lr=1e-2,
                              finetune_eval_every=4, finetune_holdout=0.25, train_dtype="float32")
    metrics = finetune_block_centroids(block, states, inps, targets, forward, cfg)
    assert metrics["finetune_heldout"] == 4 and metrics["finetune_best_step"] in (4, 8, 12, 16)
    assert len(metrics["finetune_curve"]) == 16 and all(v > 0 for v in metrics["finetune_curve"])
    assert metrics["finetune_loss_after"] < metrics["finetune_loss_before"]
    # the reported held-out loss is the block's (windows 12-15, never trained on), as the pipeline will use it
    assert _heldout_mse(block, inps, targets, forward, HELD) == pytest.approx(metrics["finetune_loss_after"], rel=1e-5)
    for name, p in block.named_parameters():
        if name in norms_before:
            assert not torch.equal(p, norms_before[name]), name
    for name, st in states.items():
        assert not torch.equal(st.centroids, centroids_before[name])
        torch.testing.assert_close(block.get_submodule(name).weight, st.dequantize())


def test_heldout_acceptance_never_accepts_a_worse_block(tiny_model, windows):
    block, states, inps, targets, forward = _block_setup(tiny_model, windows)
    before_block = copy.deepcopy(block)
    before_states = copy.deepcopy(states)
    held = [14, 15]  # holdout_count(16, 0.125): the last 2 windows decide
    start = _heldout_mse(block, inps, targets, forward, held)
    # a learning rate that wrecks the block: every check is worse, so nothing is kept
    cfg = dataclasses.replace(TINY, finetune_iters=6, finetune_lr=0.5, finetune_norm_lr=0.5, finetune_eval_every=2)
    metrics = finetune_block_centroids(block, states, inps, targets, forward, cfg)
    assert metrics["finetune_best_step"] == 0
    assert metrics["finetune_loss_after"] == metrics["finetune_loss_before"] == pytest.approx(start, rel=1e-6)
    for (name, p), q in zip(block.named_parameters(), before_block.parameters(), strict=True):
        assert torch.equal(p, q), name
    for name, st in states.items():
        assert torch.equal(st.centroids, before_states[name].centroids)
    # and across settings: the held-out error after is never above the one before
    for lr in (1e-3, 1e-2, 1e-1):
        blk, sts = copy.deepcopy(before_block), copy.deepcopy(before_states)
        cfg = dataclasses.replace(TINY, finetune_iters=4, finetune_lr=lr, finetune_norm_lr=lr, seed=3)
        finetune_block_centroids(blk, sts, inps, targets, forward, cfg)
        assert _heldout_mse(blk, inps, targets, forward, held) <= start * (1 + 1e-6)


def test_cancel_between_steps_leaves_the_block_as_it_was(tiny_model, windows):
    block, states, inps, targets, forward = _block_setup(tiny_model, windows)
    before_block = copy.deepcopy(block)
    calls = []

    def stop():
        calls.append(1)
        return len(calls) > 3

    cfg = dataclasses.replace(TINY, finetune_iters=50, finetune_lr=1e-2, finetune_norm_lr=1e-2)
    with pytest.raises(Cancelled):
        finetune_block_centroids(block, states, inps, targets, forward, cfg, should_stop=stop)
    assert len(calls) == 4
    for (name, p), q in zip(block.named_parameters(), before_block.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert all(type(m).__name__ != "CodebookLinear" for m in block.modules())


def test_pipeline_finetune_round_trips_through_the_packed_checkpoint(tmp_path, tiny_model, windows):
    model, tok = tiny_model
    cfg = dataclasses.replace(TINY, finetune_iters=16, finetune_lr=3e-3, finetune_norm_lr=1e-2, finetune_holdout=0.25,
                              finetune_eval_every=4)
    qmodel, result = quantize_model(model, windows, "vptq", cfg)
    changed = [name for name, p in qmodel.named_parameters()
               if "layernorm" in name and not torch.equal(p, model.get_parameter(name))]
    assert changed, "layer-wise fine-tuning should move the blocks' norm weights"
    assert all(r.extra["finetune_loss_after"] <= r.extra["finetune_loss_before"] for r in result.reports)
    save_quantized(qmodel, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    for name in changed:
        assert torch.equal(loaded.get_parameter(name), qmodel.get_parameter(name))
    with torch.no_grad():
        torch.testing.assert_close(loaded(windows, use_cache=False).logits, qmodel(windows, use_cache=False).logits,
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("field,value", [
    ("finetune_norm_lr", -1.0), ("finetune_batch", 0), ("finetune_holdout", 0.9), ("finetune_eval_every", -1),
    ("train_dtype", "float16"),
])
def test_finetune_settings_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        VPTQConfig(**{field: value})


def test_fp_chain_targets_are_the_original_models_own_block_outputs(tiny_model, windows):
    from vptq_core.quant import methods
    from vptq_core.quant.methods import BlockHook, Method

    model, _ = tiny_model
    ids = windows[:4, :32]
    with torch.no_grad():
        hidden, kwargs = capture_block_inputs(model, ids)
        fp_outputs = []
        for b, block in enumerate(decoder_blocks(model)):
            hidden = run_batched(block, hidden, kwargs.at(b), block_dtype("cpu"))  # the block stage's dtype
            fp_outputs.append(hidden.clone())
    seen: dict[str, list[torch.Tensor]] = {"fp": [], "quantized": []}
    vptq = methods.get("vptq")
    for chain in seen:
        probe = Method(name="vptq_probe", label="probe", description="records the hooks' targets",
                       config_class=VPTQConfig, bits=vptq.bits, describe=vptq.describe,
                       quantize_linear=vptq.quantize_linear,
                       after_block=(BlockHook("probe", lambda c: True,
                                              lambda ctx, c=chain: seen[c].append(ctx.targets.clone())),))
        quantize_model(model, ids, probe, dataclasses.replace(TINY, target_chain=chain))
    for b, expected in enumerate(fp_outputs):
        torch.testing.assert_close(seen["fp"][b], expected, rtol=1e-5, atol=1e-6)
    # block 0 sees the same inputs either way; later blocks' quantized-chain targets differ
    torch.testing.assert_close(seen["quantized"][0], fp_outputs[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(seen["quantized"][1], fp_outputs[1], rtol=1e-3, atol=1e-5)
    with pytest.raises(ValueError, match="target_chain"):
        VPTQConfig(target_chain="float")
