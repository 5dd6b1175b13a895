"""What distillation holds in memory: the original let go once its top-k are made, no fake-quant weights of the
trained linears while it runs, the codes gathered from the states' own tensors, the original's embedding and head shared
with the model's; and the trained model is the one it was without these."""

import contextlib
import copy
import dataclasses
import subprocess
import sys
import weakref

import pytest
import torch
from factories import random_vq_state

from vptq_core.quant import device
from vptq_core.quant import distill as distill_module
from vptq_core.quant.config import VPTQConfig
from vptq_core.quant.device import drop_pages
from vptq_core.quant.distill import distill
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.student import share_outer_weights
from vptq_core.quant.trainable import CodebookLinear, released_weights

TINY = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=3, outlier_percent=0.0)
TRAIN = dict(distill_iters=4, distill_lr=0.17, distill_norm_lr=3e-3, distill_holdout=0.25, distill_eval_every=2,
             distill_topk=32, train_dtype="float32")


@pytest.fixture(scope="module")
def windows() -> torch.Tensor:
    return torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(2))


def _linears(dtype: torch.dtype) -> tuple[dict, dict]:
    states = {"a": random_vq_state(64, 48, seed=1), "b": random_vq_state(32, 40, vector_len=8, seed=2)}
    linears = {}
    for name, st in states.items():
        linears[name] = torch.nn.Linear(st.in_features, st.out_features, bias=False, dtype=dtype)
        linears[name].weight.data.copy_(st.dequantize().to(dtype))
    return linears, states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_weights_hold_one_element_inside_and_the_dequantized_states_after(dtype):
    linears, states = _linears(dtype)
    before = {name: linear.weight.detach().clone() for name, linear in linears.items()}
    params = {name: linear.weight for name, linear in linears.items()}
    with released_weights(linears, states):
        for name, linear in linears.items():
            w = linear.weight
            assert w is params[name] and w.shape == before[name].shape and w.dtype == dtype
            assert w.untyped_storage().nbytes() == w.element_size()
        states["b"].centroids = states["b"].centroids * 2  # training moves a state
    assert torch.equal(linears["a"].weight, before["a"])  # bit for bit what it was
    assert torch.equal(linears["b"].weight, states["b"].dequantize().to(dtype))
    assert not torch.equal(linears["b"].weight, before["b"])
    with pytest.raises(RuntimeError, match="boom"), released_weights(linears, states):
        raise RuntimeError("boom")
    assert all(linears[n].weight.untyped_storage().nbytes() == before[n].numel() * before[n].element_size()
               for n in linears)
    assert torch.equal(linears["a"].weight, before["a"])


def test_drop_pages_gives_back_the_whole_pages_a_storage_holds(tmp_path):
    """A private mapping of a file, written over (its pages copied on write): its pages are given back and read
    the file again. A storage with no whole page inside keeps everything."""
    page = 4096
    (tmp_path / "w.bin").write_bytes(bytes(8 * page))
    t = torch.from_file(str(tmp_path / "w.bin"), shared=False, size=8 * page // 4, dtype=torch.float32)
    t.fill_(1.0)
    assert drop_pages(t.untyped_storage()) == 8 * page
    assert float(t.abs().sum()) == 0.0  # the file's zeros again
    small = torch.ones(100)
    assert drop_pages(small.untyped_storage()) == 0 and float(small.sum()) == 100.0


def test_released_weights_drop_the_pages_of_weights_nothing_else_holds(monkeypatch):
    linears, states = _linears(torch.float32)
    kept_view = linears["b"].weight.detach()[:4]  # another tensor reads b's memory: its pages stay
    expected = kept_view.clone()
    dropped = []
    monkeypatch.setattr(device, "drop_pages", lambda storage: dropped.append(storage.nbytes()) or 0)
    with released_weights(linears, states):
        pass
    assert dropped == [48 * 64 * 4]  # a's alone
    assert torch.equal(kept_view, expected)


def test_codebook_linears_gather_from_the_states_codes_and_hold_nothing_per_vector():
    """A trainable layer keeps the state's own code tensor (2 bytes a vector, no copy) and builds nothing per
    vector that outlives a step: a whole model's layers trained at once add their codebooks, not their codes."""
    states = [random_vq_state(96, 64, seed=2), random_vq_state(32, 40, vector_len=8, seed=3, num_res_centroids=8)]
    for state in states:
        layer = CodebookLinear(state)
        assert layer._codes.untyped_storage().data_ptr() == state.indices.untyped_storage().data_ptr()
        layer(torch.randn(3, state.in_features)).square().sum().backward()
        per_vector = [t for t in vars(layer).values()
                      if isinstance(t, torch.Tensor) and t.numel() >= state.indices.numel()]
        assert all(t is state.indices or t is state.res_indices for t in per_vector)


def _original(model: torch.nn.Module, seen: list) -> torch.nn.Module:
    """A copy of ``model`` that only the caller's callee will hold (``seen`` gets a weak reference to it)."""
    reference = copy.deepcopy(model)
    seen.append(weakref.ref(reference))
    return reference


def test_distillation_lets_the_original_go_and_holds_no_fake_quant_weights_while_it_steps(tiny_model, windows):
    model, _ = tiny_model
    qmodel = copy.deepcopy(model)
    head = qmodel.get_output_embeddings()
    linears = {name: m for name, m in qmodel.named_modules()
               if isinstance(m, torch.nn.Linear) and m is not head}
    seen, during = [], []

    def on_step(phase, step, steps, loss):
        during.append((seen[0]() is not None, max(m.weight.untyped_storage().nbytes() for m in linears.values())))

    cfg = dataclasses.replace(TINY, **TRAIN)
    _, result = quantize_model(qmodel, windows, "vptq", cfg, inplace=True, reference=_original(model, seen),
                               on_step=on_step)
    assert result.model_metrics["distill"]["steps"] == 4
    assert during == [(False, 4)] * 4  # the original freed; each weight one float32 element
    assert set(result.states) == set(linears)
    for name, st in result.states.items():  # after: the trained states' dequantized weights
        assert torch.equal(linears[name].weight, st.dequantize().to(linears[name].weight.dtype))


def test_distillation_trains_the_model_it_trained_with_the_weights_held(tiny_model, windows, monkeypatch):
    """The trained linears' fake-quant weights are not read while they are released: holding them (and writing
    the dequantized states into them at the end, as before) trains the same model bit for bit."""
    model, _ = tiny_model
    qmodel, result = quantize_model(model, windows, "vptq", TINY)
    cfg = dataclasses.replace(TINY, **TRAIN)
    runs = []
    for held in (False, True):
        qm, states = copy.deepcopy(qmodel), copy.deepcopy(result.states)
        if held:
            @contextlib.contextmanager
            def kept(linears, states):
                yield
                with torch.no_grad():
                    for name, linear in linears.items():
                        linear.weight.copy_(states[name].dequantize().to(linear.weight.dtype))

            monkeypatch.setattr(distill_module, "released_weights", kept)
        metrics = distill(qm, model, states, windows, cfg)
        runs.append((metrics, qm.state_dict(), states))
    (m0, sd0, st0), (m1, sd1, st1) = runs
    assert m0["steps"] == m1["steps"] == 4 and m0["best_step"] > 0
    assert (m0["kl_before"], m0["kl_after"], m0["train_kl_last"]) == (m1["kl_before"], m1["kl_after"],
                                                                      m1["train_kl_last"])
    assert sd0.keys() == sd1.keys() and all(torch.equal(sd0[k], sd1[k]) for k in sd0)
    assert all(torch.equal(st0[n].centroids, st1[n].centroids) for n in st0)


def test_the_original_shares_the_models_embedding_and_head(tiny_model, windows):
    model, _ = tiny_model
    ours = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    tied = reference.get_input_embeddings().weight is reference.get_output_embeddings().weight
    with torch.no_grad():
        before = reference(windows[:2], use_cache=False).logits
    emb, head = ours.get_input_embeddings().weight, ours.get_output_embeddings().weight
    saved = share_outer_weights(reference, ours)
    assert reference.get_input_embeddings().weight is emb and reference.get_output_embeddings().weight is head
    assert (reference.get_input_embeddings().weight is reference.get_output_embeddings().weight) is tied
    assert saved == emb.numel() * emb.element_size() * (1 if tied else 2)
    with torch.no_grad():
        assert torch.equal(reference(windows[:2], use_cache=False).logits, before)
    assert share_outer_weights(reference, ours) == 0  # shared already
    other = copy.deepcopy(model).to(torch.bfloat16)  # another dtype: left as it is
    assert share_outer_weights(other, ours) == 0 and other.get_input_embeddings().weight is not emb


# Run in a process of its own: the threshold is process-wide. A 24 MB block freed first raises glibc's default
# threshold past 20 MB, so without ``map_large_allocations`` the 20 MB tensor comes from the heap and its pages stay
# resident after it is freed (a small tensor allocated after it keeps the heap from shrinking at its top).
_FREED_BLOCK = """
import sys
import torch
from vptq_core.quant.device import map_large_allocations

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

if sys.argv[1] == "mapped":
    assert map_large_allocations(16 << 20)
torch.empty(6 << 20, dtype=torch.float32).fill_(1)  # 24 MB, freed at once
before = rss()
big = torch.empty(5 << 20, dtype=torch.float32).fill_(1)  # 20 MB
small = torch.ones(1 << 14)
held = rss() - before
del big
print(held, rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not device.return_freed_memory(), reason="needs glibc")
def test_mapped_large_allocations_leave_the_resident_set_when_freed():
    def run(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _FREED_BLOCK, mode], capture_output=True, text=True, check=True)
        held, after = map(int, out.stdout.split())
        return held, after

    held, after = run("mapped")
    assert held >= 19 << 20  # the tensor was resident while it lived
    assert after < 2 << 20, after  # and its pages left with it
    held, after = run("heap")  # glibc's default: the freed tensor's pages stay (the behaviour the setting ends)
    assert held >= 19 << 20 and after >= 19 << 20, (held, after)
