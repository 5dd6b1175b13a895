"""Models built for loading change nothing another thread sees: no default dtype, no device, no patched
``torch.nn.init`` or ``nn.Module`` while one thread builds; and what they load equals transformers' own load."""

from __future__ import annotations

import threading

import pytest
import torch
from factories import random_scalar_state
from torch import nn
from transformers import AutoModelForCausalLM

from vptq_core.models import FAMILIES, load_model, tiny_random_model
from vptq_core.quant.blocks import block_linears, decoder_blocks
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.skeleton import empty_model


def _checkpoint(family: str, directory):
    """A packed 4-bit checkpoint of a tiny bf16 model (random scalar states)."""
    model, tok = tiny_random_model(family)
    linears = {f"model.layers.{b}.{name}": m for b, block in enumerate(decoder_blocks(model))
               for name, m in block_linears(block).items()}
    states = {name: random_scalar_state(m.in_features, m.out_features, bits=4, group_size=32, seed=i,
                                       bias=m.bias is not None)
              for i, (name, m) in enumerate(linears.items())}
    return save_quantized(model.to(torch.bfloat16), tok, states, directory)


def _world() -> dict:
    """What a thread that is not loading anything sees of the process."""
    return {"default dtype": torch.get_default_dtype(), "new tensor": torch.empty(2).device.type,
            "new linear": (nn.Linear(3, 3).weight.device.type, nn.Linear(3, 3).weight.dtype),
            "init.normal_": nn.init.normal_, "register_parameter": nn.Module.register_parameter}


def _seen_mid_build(build) -> dict:
    """Run ``build()`` in a thread and, while it is registering its first parameter, look at the process
    from this thread: the build waits until the look is done, so the two overlap every time."""
    paused, looked = threading.Event(), threading.Event()
    builder = threading.get_ident

    def hook(module, name, param):
        if threading.get_ident() == worker_id[0] and not paused.is_set():
            paused.set()
            assert looked.wait(30)
        return None

    worker_id: list[int] = []
    errors: list[BaseException] = []

    def run():
        worker_id.append(builder())
        try:
            build()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            paused.set()

    handle = nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        assert paused.wait(60)
        seen = _world()
        looked.set()
        thread.join(60)
    finally:
        handle.remove()
    assert not errors, errors
    return seen


def test_building_a_bf16_model_changes_nothing_other_threads_see():
    config = tiny_random_model("gemma3")[0].config
    before = _world()
    seen = _seen_mid_build(lambda: empty_model(config, torch.bfloat16))
    assert seen == before
    assert _world() == before


def test_loading_a_checkpoint_changes_nothing_other_threads_see(tmp_path):
    ckpt = _checkpoint("llama", tmp_path / "ckpt")
    before = _world()
    seen = _seen_mid_build(lambda: load_quantized(ckpt, dtype=torch.bfloat16))
    assert seen == before


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_models_compute_the_buffers_transformers_builds(family):
    reference = tiny_random_model(family)[0]
    built = empty_model(reference.config, torch.bfloat16)
    assert {p.device.type for p in built.parameters()} == {"meta"}
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    want, got = dict(reference.named_buffers()), dict(built.named_buffers())
    assert want.keys() == got.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, "auto"])
@pytest.mark.parametrize("route", ["skeleton", "transformers"])
def test_dense_directories_load_as_transformers_loads_them(tmp_path, monkeypatch, family, dtype, route):
    """Read tensor by tensor into a skeleton, or (names that differ from the model's) by transformers' loader
    in float32 under a lock, the model is the one transformers' own load in that dtype gives."""
    import vptq_core.models as models

    if route == "transformers":
        def not_streamable(*args):
            raise models.NotStreamable("names differ")

        monkeypatch.setattr(models, "_load_safetensors_dir", not_streamable)
    model, tok = tiny_random_model(family, num_layers=3)
    model.to(torch.bfloat16).save_pretrained(str(tmp_path)), tok.save_pretrained(str(tmp_path))
    ours = load_model(str(tmp_path), dtype=dtype)[0]
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=dtype or torch.float32,
                                                  attn_implementation="sdpa").eval()
    if isinstance(dtype, torch.dtype):
        theirs = theirs.to(dtype)
    mine, ref = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == ref.keys()
    for name, value in ref.items():
        assert mine[name].dtype == value.dtype and torch.equal(mine[name], value), name
    # A buffer transformers makes in torch's default dtype (gemma3's embedding scale under "auto") stays
    # float32 here, since the default is never changed; the forward casts it to the weights' dtype.
    for (name, value), (_, other) in zip(theirs.named_buffers(), ours.named_buffers(), strict=True):
        assert torch.equal(other.to(value.dtype), value), name
    ids = torch.tensor([[1, 5, 9, 22, 40, 7]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=0, atol=0)


def test_two_threads_load_the_same_and_different_checkpoints_ten_times(tmp_path):
    made = {}
    for family in ("llama", "qwen2"):
        made[family] = _checkpoint(family, tmp_path / family)
    expected = {f: load_quantized(p, dtype=torch.bfloat16)[0].state_dict() for f, p in made.items()}
    failures: list[str] = []

    def load(family: str) -> None:
        try:
            got = load_quantized(made[family], dtype=torch.bfloat16)[0].state_dict()
            for name, value in expected[family].items():
                if not torch.equal(got[name], value):
                    failures.append(f"{family}: {name} differs")
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(f"{family}: {exc}")

    for pair in [("llama", "llama"), ("llama", "qwen2")] * 5:
        threads = [threading.Thread(target=load, args=(family,)) for family in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert failures == []
    assert torch.get_default_dtype() == torch.float32
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_tiny_models_built_while_others_draw_from_the_global_generator_are_the_same():
    """A tiny model's weights come from torch's global generator; a thread drawing from it meanwhile (as a
    sampled chat does, holding the same lock) takes turns instead of shifting the weights."""
    from vptq_core.models import GLOBAL_RNG_LOCK

    expected = tiny_random_model("llama")[0].state_dict()
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            with GLOBAL_RNG_LOCK:
                torch.rand(64)

    drawer = threading.Thread(target=draw)
    drawer.start()
    try:
        for _ in range(5):
            got = tiny_random_model("llama")[0].state_dict()
            for name, value in expected.items():
                assert torch.equal(got[name], value), name
    finally:
        stop.set()
        drawer.join(10)


@pytest.mark.parametrize(("change", "reason"), [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number, got 0"),
    ({"hidden_size": 63}, r"cannot build the model config \(StrictDataclassClassValidationError: ValueError: The "
                          r"hidden size \(63\) is not a multiple of the number of attention heads \(4\)\.\)$"),
])
def test_a_config_that_cannot_be_built_is_refused_in_one_line(tmp_path, change, reason):
    import json

    ckpt = _checkpoint("llama", tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    config.update(change)
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=reason) as refused:
        load_quantized(ckpt)
    assert "\n" not in str(refused.value)
