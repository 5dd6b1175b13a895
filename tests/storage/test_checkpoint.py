"""Packed checkpoints: save -> load_quantized / from_pretrained reproduce the model; damage fails clearly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VQ_LAYOUTS
from factories import random_scalar_state, random_vq_state
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from vptq_core.models import tiny_random_llama
from vptq_core.quant import lean_generate
from vptq_core.storage import hf_integration
from vptq_core.storage.checkpoint import checkpoint_size, load_quantized, save_quantized
from vptq_core.storage.modules import ScalarQLinear, VQLinear, replace_linears

PROMPT = torch.tensor([[5, 17, 42, 99, 3, 250, 77, 8, 1, 64]])



def block_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n}


def vq_states(model: nn.Module) -> dict:
    return {
        name: random_vq_state(m.in_features, m.out_features, **VQ_LAYOUTS[name.rpartition(".")[2]], seed=i)
        for i, (name, m) in enumerate(block_linears(model).items())
    }


def scalar_states(model: nn.Module) -> dict:
    states = {}
    for i, (name, m) in enumerate(block_linears(model).items()):
        act = {"act_bits": 8, "act_granularity": ("token", "tensor", "token_asym")[i % 3]} if "mlp" in name else {}
        states[name] = random_scalar_state(
            m.in_features,
            m.out_features,
            bits=(2, 3, 4)[i % 3],
            group_size=(16, 32, 64)[i % 3],
            method="lrq",
            seed=i,
            **act,
        )
    return states


def in_memory(states: dict, dtype: torch.dtype) -> nn.Module:
    model, _ = tiny_random_llama()
    model = replace_linears(model, states, dtype)
    for param in model.parameters():  # the non-quantized weights as the checkpoint stores them
        param.data = param.data.to(dtype)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits.float()


@pytest.fixture(scope="module")
def vq_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    model, tok = tiny_random_llama()
    states = vq_states(model)
    path = save_quantized(
        model, tok, states, tmp_path_factory.mktemp("vq") / "ckpt", report={"method": "vptq"}, dtype=torch.bfloat16
    )
    return path, states


@pytest.fixture(scope="module")
def scalar_checkpoint(tmp_path_factory) -> tuple[Path, dict]:
    model, tok = tiny_random_llama()
    states = scalar_states(model)
    return save_quantized(model, tok, states, tmp_path_factory.mktemp("scalar") / "ckpt"), states


def damaged_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------------------------- round trips
def test_vq_checkpoint_layout(vq_checkpoint):
    path, states = vq_checkpoint
    assert {"config.json", "model.safetensors", "quant_report.json", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    assert set(qc) == {"quant_method", "config_for_layers", "shared_layer_config"}
    assert qc["quant_method"] == "vptq" and qc["shared_layer_config"] == {}
    assert qc["config_for_layers"] == {name: state.layer_config() for name, state in states.items()}
    assert config["dtype"] == "bfloat16"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.q_proj.indices").get_dtype() == "I32"
        assert f.get_slice("model.layers.0.self_attn.v_proj.outlier_indices").get_dtype() == "I16"
        assert f.get_slice("model.layers.0.self_attn.q_proj.perm").get_dtype() == "I16"
        assert f.get_slice("model.layers.1.mlp.gate_proj.centroids.weight").get_dtype() == "BF16"
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"  # 1-D tensors keep every trained bit
        assert f.get_slice("model.layers.0.input_layernorm.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in keys  # tied to the embeddings
    assert not any(k.endswith("proj.weight") for k in keys)


def test_load_quantized_reproduces_in_memory_model(vq_checkpoint):
    path, states = vq_checkpoint
    model, tok = load_quantized(path)
    assert tok is not None and tok.decode(tok.encode("hello")) == "hello"
    assert isinstance(model.model.layers[1].mlp.down_proj, VQLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.bfloat16 and not model.training
    reference = in_memory(states, torch.bfloat16)
    ref_sd = reference.state_dict()
    for key, tensor in model.state_dict().items():
        assert tensor.dtype == ref_sd[key].dtype and torch.equal(tensor, ref_sd[key]), key
    torch.testing.assert_close(logits(model), logits(reference), rtol=0, atol=0)


def test_load_quantized_dtype_override(vq_checkpoint):
    path, _ = vq_checkpoint
    bf16, _ = load_quantized(path)
    fp32, _ = load_quantized(path, dtype=torch.float32)
    assert fp32.model.layers[0].self_attn.k_proj.res_centroids.weight.dtype == torch.float32
    assert fp32.model.layers[0].self_attn.q_proj.indices.dtype == torch.int32
    torch.testing.assert_close(logits(fp32), logits(bf16), rtol=0.05, atol=0.05)


def test_a_trained_norm_survives_save_and_load_exactly(tmp_path):
    model, tok = tiny_random_llama()
    states = vq_states(model)
    trained = 1 + 2**-12  # between two bf16 neighbours (1 and 1 + 2**-7): bf16 would round it to 1
    assert torch.tensor(trained).to(torch.bfloat16).item() != trained
    norm = "model.layers.1.post_attention_layernorm.weight"
    with torch.no_grad():
        model.get_parameter(norm)[3] = trained
        model.model.norm.weight[0] = -trained
    path = save_quantized(model, tok, states, tmp_path / "ckpt", dtype=torch.bfloat16)
    stored = load_file(str(path / "model.safetensors"))
    assert stored[norm].dtype == torch.float32 and stored[norm][3].item() == trained
    assert torch.equal(stored[norm], model.get_parameter(norm).detach())
    assert torch.equal(stored["model.norm.weight"], model.model.norm.weight.detach())
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16  # matrices stay in the checkpoint dtype

    exact, _ = load_quantized(path, dtype=torch.float32)
    assert exact.get_parameter(norm)[3].item() == trained
    assert torch.equal(exact.get_parameter(norm), model.get_parameter(norm).detach())
    assert torch.equal(exact.model.norm.weight, model.model.norm.weight.detach())
    # in the stored bf16 the norms run in the model's dtype, as the next layer expects its inputs
    bf16, _ = load_quantized(path)
    assert bf16.get_parameter(norm).dtype == torch.bfloat16
    assert bf16.get_parameter(norm)[3].item() == torch.tensor(trained).to(torch.bfloat16).item()
    assert logits(bf16).dtype == torch.float32 and torch.isfinite(logits(bf16)).all()


def test_from_pretrained_matches_load_quantized(vq_checkpoint):
    from transformers import AutoModelForCausalLM

    hf_integration.install()
    hf_integration.install()  # idempotent
    assert hf_integration.installed()
    path, _ = vq_checkpoint
    ours, _ = load_quantized(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(path))
    assert isinstance(theirs.model.layers[0].self_attn.v_proj, VQLinear) and theirs.dtype == torch.bfloat16
    assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    theirs_sd = theirs.state_dict()
    for key, tensor in ours.state_dict().items():
        assert tensor.dtype == theirs_sd[key].dtype and torch.equal(tensor, theirs_sd[key]), key
    torch.testing.assert_close(logits(theirs), logits(ours), rtol=0, atol=0)
    generated = theirs.generate(PROMPT, max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, ours.generate(PROMPT, max_new_tokens=5, do_sample=False))
    assert lean_generate.enabled(ours) and lean_generate.enabled(theirs)  # both loaders: the lean token loop
    assert torch.equal(generated, type(ours).generate(ours, PROMPT, max_new_tokens=5, do_sample=False))


def test_scalar_checkpoint_round_trips_through_both_loaders(scalar_checkpoint):
    from transformers import AutoModelForCausalLM

    hf_integration.install()
    path, states = scalar_checkpoint
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "vptq_core_scalar" and qc["format_version"] == 1
    entry = qc["config_for_layers"]["model.layers.0.mlp.up_proj"]
    assert entry["act_bits"] == 8 and entry["method"] == "lrq" and entry["bits"] in (2, 3, 4)
    ours, _ = load_quantized(path)
    module = ours.model.layers[0].mlp.up_proj
    assert isinstance(module, ScalarQLinear) and module.act_bits == 8
    reference = in_memory(states, torch.float32)
    torch.testing.assert_close(logits(ours), logits(reference), rtol=0, atol=0)
    theirs = AutoModelForCausalLM.from_pretrained(str(path))
    torch.testing.assert_close(logits(theirs), logits(ours), rtol=0, atol=0)


def test_quant_report_sizes(vq_checkpoint):
    path, states = vq_checkpoint
    report = json.loads((path / "quant_report.json").read_text())
    assert report["method"] == "vptq"
    sizes = report["sizes"]
    quantized_bytes = 0
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = f.keys()  # safe_open handles are not iterable
        for key in names:
            if key.rpartition(".")[0] in states or key.rsplit(".", 2)[0] in states:
                t = f.get_tensor(key)
                quantized_bytes += t.numel() * t.element_size()
    weights = sum(s.in_features * s.out_features for s in states.values())
    assert sizes["quantized_linear_bytes"] == quantized_bytes
    assert (
        sizes["quantized_linear_bytes"]
        == sizes["index_bytes"] + sizes["codebook_bytes"] + sizes["other_quantized_bytes"]
    )
    assert sizes["bf16_linear_bytes"] == 2 * weights and sizes["quantized_weights"] == weights
    assert sizes["ratio_to_bf16"] == pytest.approx(quantized_bytes / (2 * weights))
    assert sizes["safetensors_file_bytes"] == (path / "model.safetensors").stat().st_size
    assert checkpoint_size(path) == sum(p.stat().st_size for p in path.iterdir())


def test_hf_save_pretrained_output_loads_back(vq_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_integration.install()
    model = AutoModelForCausalLM.from_pretrained(str(vq_checkpoint[0]))
    model.save_pretrained(str(tmp_path / "resaved"))
    loaded, _ = load_quantized(tmp_path / "resaved")
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)


def test_save_without_tokenizer(tmp_path):
    model, _ = tiny_random_llama()
    states = vq_states(model)
    path = save_quantized(model, None, states, tmp_path / "ckpt")
    loaded, tok = load_quantized(path)
    assert tok is None
    torch.testing.assert_close(logits(loaded), logits(in_memory(states, torch.float32)), rtol=0, atol=0)


def test_save_accepts_model_with_swapped_modules(tmp_path):
    model, tok = tiny_random_llama()
    states = vq_states(model)
    replace_linears(model, states, torch.float32)
    loaded, _ = load_quantized(save_quantized(model, tok, states, tmp_path / "ckpt"))
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ bad input (save)
def test_save_rejects_bad_states(tmp_path):
    model, tok = tiny_random_llama()
    linears = block_linears(model)
    name = next(iter(linears))
    vq = random_vq_state(64, 64, vector_len=4, num_centroids=16)
    with pytest.raises(ValueError, match="states must be all VQLayerState or all ScalarLayerState"):
        save_quantized(
            model, tok, {name: vq, "model.layers.0.mlp.up_proj": random_scalar_state(64, 128)}, tmp_path / "a"
        )
    with pytest.raises(ValueError, match="no such module"):
        save_quantized(model, tok, {"model.layers.7.self_attn.q_proj": vq}, tmp_path / "b")
    with pytest.raises(ValueError, match=r"is \(64, 64\) \(in, out\) but the module is \(64, 32\)"):
        save_quantized(model, tok, {"model.layers.0.self_attn.k_proj": vq}, tmp_path / "c")
    with pytest.raises(ValueError, match="the embedding reads the rows of 'lm_head', which is not a quantized layer"):
        save_quantized(model, tok, {name: vq}, tmp_path / "d", embedding="lm_head")  # tied head: see test_embedding
    with pytest.raises(ValueError, match="report is not JSON-serialisable"):
        save_quantized(model, tok, {name: vq}, tmp_path / "e", report={"t": torch.zeros(1)})
    assert not (tmp_path / "e").exists()


# ------------------------------------------------------------------------------------------ bad input (load)
def test_truncated_safetensors(vq_checkpoint, tmp_path):
    path = damaged_copy(vq_checkpoint[0], tmp_path / "ckpt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        load_quantized(path)


def test_garbage_safetensors_header(vq_checkpoint, tmp_path):
    path = damaged_copy(vq_checkpoint[0], tmp_path / "ckpt")
    data = bytearray((path / "model.safetensors").read_bytes())
    data[8:40] = b"#" * 32
    (path / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        load_quantized(path)


def test_missing_safetensors(vq_checkpoint, tmp_path):
    path = damaged_copy(vq_checkpoint[0], tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"model\.safetensors: file not found"):
        load_quantized(path)


def rewrite_tensors(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda t: t.pop("model.layers.1.mlp.gate_proj.res_centroids.weight"),
            r"missing tensors \['model.layers.1.mlp.gate_proj.res_centroids.weight'\]",
        ),
        (
            lambda t: t.update({"model.layers.0.extra": torch.zeros(2)}),
            r"unexpected tensors \['model.layers.0.extra'\]",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.indices": torch.zeros(1, 16, 7, dtype=torch.int32)}),
            r"tensor 'model.layers.0.self_attn.q_proj.indices' has shape \(1, 16, 7\), expected \(1, 16, 8\)",
        ),
        (
            lambda t: t.update(
                {
                    "model.layers.0.self_attn.q_proj.indices": t["model.layers.0.self_attn.q_proj.indices"].to(
                        torch.int64
                    )
                }
            ),
            r"tensor 'model.layers.0.self_attn.q_proj.indices' has dtype I64, expected I32",
        ),
        (
            lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].float()}),
            r"tensor 'model.embed_tokens.weight' has dtype F32, expected BF16",
        ),
        (  # a 1-D tensor may be float32 (how the writer stores norms and biases) or the stored dtype, nothing else
            lambda t: t.update({"model.norm.weight": t["model.norm.weight"].half()}),
            r"tensor 'model.norm.weight' has dtype F16, expected BF16 or F32",
        ),
        (
            lambda t: t["model.layers.0.self_attn.v_proj.outlier_indices"].fill_(16),
            r"outlier index 16 >= num_outlier_centroids \(16\)",
        ),
        (lambda t: t["model.layers.0.self_attn.q_proj.perm"].fill_(3), "not a permutation of range"),
    ],
    ids=["missing", "unexpected", "shape", "int-dtype", "float-dtype", "float-dtype-1d", "outlier-range", "perm"],
)
def test_inconsistent_tensors(vq_checkpoint, tmp_path, edit, match):
    path = damaged_copy(vq_checkpoint[0], tmp_path / "ckpt")
    rewrite_tensors(path, edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(path)


def edit_config(path: Path, edit) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _layer(config: dict, name: str = "model.layers.0.self_attn.q_proj") -> dict:
    return config["quantization_config"]["config_for_layers"][name]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda c: c.pop("quantization_config"), "'quantization_config' is missing"),
        (lambda c: c["quantization_config"].update(quant_method="awq"), "quant_method must be one of"),
        (lambda c: _layer(c).update(in_features=32, group_size=32), r"says in/out features \(32, 64\)"),
        (lambda c: _layer(c).update(num_centroids=[-1, 12]), "layer 'model.layers.0.self_attn.q_proj'.*power of two"),
        (lambda c: _layer(c).update(group_size=16), "must equal in_features"),
        (
            lambda c: c["quantization_config"]["config_for_layers"].update(
                {"model.layers.0.input_layernorm": dict(_layer(c))}
            ),
            "'model.layers.0.input_layernorm': not an nn.Linear",
        ),
        (
            lambda c: c["quantization_config"]["config_for_layers"].update(
                {"model.layers.9.mlp.up_proj": dict(_layer(c))}
            ),
            "'model.layers.9.mlp.up_proj': no such module",
        ),
        (lambda c: c.update(dtype="int8"), "dtype must be one of"),
        (lambda c: c.update(model_type="no-such-arch"), "cannot build the model config"),
    ],
    ids=["no-qc", "method", "features", "centroids", "group-size", "not-linear", "no-module", "dtype", "arch"],
)
def test_inconsistent_config(vq_checkpoint, tmp_path, edit, match):
    path = damaged_copy(vq_checkpoint[0], tmp_path / "ckpt")
    edit_config(path, edit)
    with pytest.raises(ValueError, match=match):
        load_quantized(path)


def test_bad_json_config(vq_checkpoint, tmp_path):
    path = damaged_copy(vq_checkpoint[0], tmp_path / "ckpt")
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=r"config\.json: invalid JSON"):
        load_quantized(path)


def test_not_a_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        load_quantized(tmp_path / "nothing-here")
