import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vptq_core.quant import packed_dense
from vptq_core.quant.packed_dense import PackedLinear, packed_linears
from vptq_core.quant.sampling import sample_windows

needs_onednn = pytest.mark.skipif(not packed_dense.available(), reason="oneDNN packed linears unavailable here")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [1, 7, 24, 100])
def test_packed_linear_is_the_linear(bias, rows):
    gen = torch.Generator().manual_seed(rows)
    lin = nn.Linear(40, 72, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(72, 40, generator=gen))
        if bias:
            lin.bias.copy_(torch.randn(72, generator=gen))
    packed = PackedLinear(lin, rows=24)
    for x in (torch.randn(rows, 40, generator=gen), torch.randn(2, rows, 40, generator=gen),
              torch.randn(rows, 3, 40, generator=gen).transpose(0, 1)):  # 2-D, 3-D, not contiguous
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_packed_linears_swap_every_float32_linear_and_restore_them(tiny_model):
    model, _ = tiny_model
    ids = torch.randint(0, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    before = dict(model.named_modules())
    linears = {id(m) for m in model.modules() if type(m) is nn.Linear}
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        with packed_linears(model) as swapped:
            assert swapped == len(linears) > 0
            assert not any(type(m) is nn.Linear for m in model.modules())
            got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    after = dict(model.named_modules())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    # not while gradients are wanted, not when disabled, not when the ops are missing: the model as it is
    with packed_linears(model) as swapped:
        assert swapped == 0 and any(type(m) is nn.Linear for m in model.modules())
    with torch.no_grad(), packed_linears(model, enabled=False) as swapped:
        assert swapped == 0


def test_packed_linears_leave_the_model_alone_without_the_ops(tiny_model, monkeypatch):
    model, _ = tiny_model
    monkeypatch.setattr(packed_dense, "available", lambda: False)
    with torch.no_grad(), packed_linears(model) as swapped:
        assert swapped == 0
        assert any(type(m) is nn.Linear for m in model.modules())


def test_packed_linears_skip_other_dtypes_and_hooked_modules():
    lin = nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16))
    with torch.no_grad(), packed_linears(lin) as swapped:
        assert swapped == 0 and type(lin[0]) is nn.Linear
    hooked = nn.Sequential(nn.Linear(8, 8))
    hooked[0].register_forward_pre_hook(lambda module, args: None)
    with torch.no_grad(), packed_linears(hooked) as swapped:
        assert swapped == 0 and type(hooked[0]) is nn.Linear


@needs_onednn
def test_sampling_runs_packed_and_writes_what_the_plain_model_writes(tiny_model, monkeypatch):
    model, _ = tiny_model
    calls = []
    forward = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: calls.append(1) or forward(self, x))
    starts = torch.tensor([[5], [7], [9]])
    got, got_teacher = sample_windows(model, starts, 24, seed=3, topk=5, temperature=1e-4)
    assert calls, "a float32 CPU model samples through the packed linears"
    n = len(calls)
    want, want_teacher = sample_windows(model, starts, 24, seed=3, topk=5, temperature=1e-4, pack=False)
    assert len(calls) == n  # pack=False: the model as it is
    assert torch.equal(got, want)
    torch.testing.assert_close(got_teacher["logp"], want_teacher["logp"], rtol=1e-4, atol=1e-5)
    assert torch.equal(got_teacher["index"], want_teacher["index"])
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # restored after
