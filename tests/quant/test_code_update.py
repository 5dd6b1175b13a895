import dataclasses

import pytest
import torch

from tests.factories import random_vq_state
from vptq_core.kernels.reference import as_index
from vptq_core.quant.code_update import CodeLinear, CodeUpdates
from vptq_core.quant.config import VPTQConfig
from vptq_core.quant.distill import distill
from vptq_core.quant.pipeline import quantize_model
from vptq_core.storage.checkpoint import load_quantized, save_quantized

TINY = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=3, outlier_percent=0.0)
KD = {"distill_iters": 6, "distill_lr": 0.17, "distill_norm_lr": 3e-3, "distill_eval_every": 2,
      "train_dtype": "float32"}


@pytest.fixture
def no_cap(monkeypatch):
    """Proposals that reach the wanted centroids whatever their distance."""
    monkeypatch.setattr("vptq_core.quant.code_update.MOVE_CAP", float("inf"))


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))


def _crafted(layer: CodeLinear, moves: dict[int, int], norm_scale: torch.Tensor | None = None) -> float:
    """Set the layer's weight gradient to zero except on the vectors ``moves`` names (flat position in
    ``codes()`` -> wanted codebook row), where it points from the current centroid away from the wanted one; returns
    the step that puts each proposal exactly on the wanted centroid."""
    spec = layer.spec
    v, cols = spec.vector_len, spec.group_num * spec.group_size
    codebook = layer.params["centroids"].detach().reshape(-1, v)
    g = torch.zeros(spec.rows, cols, v)
    for pos, want in moves.items():
        r, c = divmod(pos, cols)
        g[r, c] = codebook[layer.codes().flatten()[pos]] - codebook[want]
    eta_g = g.clone()  # the proposal moves eta * g in codebook space: eta = 1 puts it on the wanted centroid
    if norm_scale is not None:
        g = g / norm_scale.view(1, cols, 1)
    layer.grad = g.permute(0, 2, 1).reshape(spec.rows * v, cols)[: spec.out_features]
    rms_cb = float(codebook.pow(2).mean().sqrt())
    rms_g = float(eta_g[: spec.out_features // v].pow(2).mean().sqrt())
    return rms_g / rms_cb


def test_a_crafted_gradient_moves_exactly_the_vectors_it_points_elsewhere(no_cap):
    st = random_vq_state(32, 24, vector_len=4, num_centroids=16, group_num=2, seed=3)
    layer = CodeLinear(st)
    start = layer.codes().flatten()
    # flat position r * 32 + column; columns 16..31 are group 1's, whose codebook rows are 16..31
    moves = {p: (p % 32) // 16 * 16 + (int(layer.codes().flatten()[p]) % 16 + 3 + p) % 16 for p in (5, 40, 100, 187)}
    step = _crafted(layer, moves)
    positions, rows = layer.propose(step, share=0.5)
    assert dict(zip(positions.tolist(), rows.tolist(), strict=True)) == moves
    layer.assign(positions, rows)
    expected = start.clone()
    expected[list(moves)] = torch.tensor(list(moves.values()), dtype=expected.dtype)
    assert torch.equal(layer.codes().flatten(), expected)
    assert layer.grad is None and layer.propose(step, 0.5) is None  # the gradient is used once


def test_the_share_keeps_the_vectors_that_gain_most(no_cap):
    st = random_vq_state(16, 16, vector_len=4, num_centroids=16, seed=4)
    layer = CodeLinear(st)
    codebook = layer.params["centroids"].detach().reshape(-1, 4)
    moves = {p: (int(layer.codes().flatten()[p]) + 1 + p) % 16 for p in range(0, 64, 4)}  # 16 of 64 vectors
    step = _crafted(layer, moves)
    gains = {p: float((codebook[layer.codes().flatten()[p]] - codebook[w]).pow(2).sum()) for p, w in moves.items()}
    positions, _ = layer.propose(step, share=4 / 64)
    assert positions.numel() == 4 and set(positions.tolist()) <= set(moves)
    assert sorted(gains[p] for p in positions.tolist()) == sorted(gains.values())[-4:]  # (ties: either one)


def test_the_gain_is_measured_in_weight_space_under_normalisation(no_cap):
    """With weight_scale the proposal is found in codebook space and the gain weighs each column by scale²."""
    st = random_vq_state(16, 8, vector_len=4, num_centroids=16, norm=True, seed=5)
    layer = CodeLinear(st)
    scale = layer.params["weight_scale"].detach()
    moves = {1: (int(layer.codes().flatten()[1]) + 5) % 16, 18: (int(layer.codes().flatten()[18]) + 7) % 16}
    step = _crafted(layer, moves, norm_scale=scale)
    positions, rows = layer.propose(step, share=1.0)
    assert dict(zip(positions.tolist(), rows.tolist(), strict=True)) == moves


def test_a_far_proposal_is_clipped_to_the_cap():
    """One vector with a huge gradient: clipped, its proposal stays within MOVE_CAP x a centroid's RMS length,
    so it moves to a centroid near its own, not the far one the gradient points at."""
    from vptq_core.quant.code_update import MOVE_CAP

    st = random_vq_state(16, 16, vector_len=4, num_centroids=16, seed=7)
    layer = CodeLinear(st)
    codebook = layer.params["centroids"].detach().reshape(-1, 4)
    old = int(layer.codes().flatten()[3])
    far = int((codebook - codebook[old]).norm(dim=1).argmax())
    cap = MOVE_CAP * float(codebook.pow(2).mean().sqrt()) * 2
    g = torch.zeros(4, 16, 4)
    g[0, 3] = (codebook[old] - codebook[far]) * 100
    layer.grad = g.permute(0, 2, 1).reshape(16, 16)
    got = layer.propose(1.0, share=1.0)
    target = codebook[old] + cap * (codebook[far] - codebook[old]) / (codebook[far] - codebook[old]).norm()
    nearest = int((codebook - target).norm(dim=1).argmin())
    if nearest == old:
        assert got[0].numel() == 0
    else:
        assert got[0].tolist() == [3] and got[1].tolist() == [nearest] and nearest != far


def test_codes_of_a_worse_check_are_not_kept():
    st = random_vq_state(16, 16, vector_len=4, num_centroids=16, seed=6)
    before = st.indices.clone()
    updates = CodeUpdates(every=1, share=1.0, step=1.0)
    layer = updates.linear("x", st, None, "cpu")
    updates.checked(1.0)
    layer.assign(torch.tensor([0, 1]), (layer.codes().flatten()[:2] + 1) % 16)
    updates.checked(2.0)  # worse: train_holdout keeps the start
    assert updates.finish(0) == 0 and torch.equal(st.indices, before)
    layer.assign(torch.tensor([0]), (layer.codes().flatten()[:1] + 1) % 16)
    updates.checked(0.5)
    assert updates.finish(2) == 1 and st.indices.dtype == before.dtype
    assert int((st.indices != before).sum()) == 1


def test_code_updates_keep_the_packed_format_and_the_kept_check(tmp_path, tiny_model, windows):
    """Codes move; indices keep dtype, shape and range; the checkpoint loads back to the distilled model, whose
    KL is the kept check's (full vocabulary, every window checked)."""
    model, tok = tiny_model
    qmodel, result = quantize_model(model, windows, "vptq", TINY)
    start = {name: st.indices.clone() for name, st in result.states.items()}
    cfg = dataclasses.replace(TINY, **KD, distill_holdout=0.0, distill_topk=259, distill_code_every=2,
                              distill_code_share=0.01, distill_code_step=0.25)
    metrics = distill(qmodel, model, result.states, windows, cfg)
    assert metrics["best_step"] > 0 and metrics["codes_moved"] > 0
    moved = 0
    for name, st in result.states.items():
        assert st.indices.dtype == start[name].dtype and st.indices.shape == start[name].shape
        assert int(as_index(st.indices).min()) >= 0 and int(as_index(st.indices).max()) < st.num_centroids
        moved += int((st.indices != start[name]).sum())
        torch.testing.assert_close(qmodel.get_submodule(name).weight, st.dequantize())
    assert moved == metrics["codes_moved"]
    save_quantized(qmodel, tok, result.states, tmp_path / "ckpt", dtype=torch.float32)
    loaded, _ = load_quantized(tmp_path / "ckpt", dtype=torch.float32)
    with torch.no_grad():
        p = torch.log_softmax(model(windows, use_cache=False).logits[:, :-1].float(), -1)
        q = torch.log_softmax(loaded(windows, use_cache=False).logits[:, :-1].float(), -1)
        torch.testing.assert_close(loaded(windows, use_cache=False).logits,
                                   qmodel(windows, use_cache=False).logits, rtol=1e-4, atol=1e-4)
    assert float((p.exp() * (p - q)).sum(-1).mean()) == pytest.approx(metrics["kl_after"], rel=1e-4)


def test_code_updates_never_due_train_bitwise_as_off(tiny_model, windows):
    model, _ = tiny_model
    runs = []
    for every in (0, 1000):
        qmodel, result = quantize_model(model, windows, "vptq", TINY)
        cfg = dataclasses.replace(TINY, **KD, distill_code_every=every)
        metrics = distill(qmodel, model, result.states, windows, cfg)
        runs.append((metrics["kl_after"], result.states))
    assert runs[0][0] == runs[1][0]
    for name, st in runs[0][1].items():
        other = runs[1][1][name]
        assert torch.equal(st.centroids, other.centroids) and torch.equal(st.indices, other.indices)
