"""Streaming quantization: blocks read from safetensors one at a time (single file and sharded), bf16
checkpoints, the incremental checkpoint writer, and the same result as the whole-model path; the whole-model path
from a directory holds the original only while distillation needs it."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save_file

from vptq_core import api
from vptq_core.api import quantize_to_dir
from vptq_core.models import NotStreamable, open_streaming, tiny_random_model
from vptq_core.quant.blocks import decoder_blocks
from vptq_core.quant.config import ScalarConfig, VPTQConfig
from vptq_core.quant.pipeline import quantize_model
from vptq_core.quant.source import SafetensorsWeights, meta_tensors
from vptq_core.storage.checkpoint import SafetensorsWriter, load_quantized, save_quantized

TINY_VQ = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0)
TINY_RTN = ScalarConfig(bits=4, group_size=32)
TINY_DISTILL = dataclasses.replace(TINY_VQ, distill_iters=4, distill_lr=0.17, distill_norm_lr=3e-3,
                                   distill_holdout=0.25, distill_eval_every=2, distill_topk=32, train_dtype="float32")


def saved_model(directory: Path, family: str = "llama", dtype: torch.dtype = torch.float32, layers: int = 3,
                **save_kwargs) -> Path:
    model, tok = tiny_random_model(family, num_layers=layers)
    model.to(dtype).save_pretrained(str(directory), **save_kwargs)
    tok.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return saved_model(tmp_path_factory.mktemp("llama") / "model")


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same_checkpoint(a: Path, b: Path, whole_config: bool = True) -> None:
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert set(ta) == set(tb)
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (a, b))
    if not whole_config:  # a model built in code has no name or architectures of its own
        ca, cb = ca["quantization_config"], cb["quantization_config"]
    assert ca == cb


# ---------------------------------------------------------------------------------------------- the skeleton
def test_open_streaming_loads_only_the_non_block_tensors(llama_dir):
    source = open_streaming(str(llama_dir))
    model = source.model
    assert source.dtype == torch.float32
    left = meta_tensors(model)
    assert left and all(name.startswith("model.layers.") for name in left)
    assert all(p.is_meta for p in decoder_blocks(model).parameters())
    assert not model.model.embed_tokens.weight.is_meta and not model.model.norm.weight.is_meta
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again after loading
    reference, _ = tiny_random_model("llama", num_layers=3)
    torch.testing.assert_close(model.model.embed_tokens.weight, reference.model.embed_tokens.weight, rtol=0, atol=0)


def test_not_streamable_sources(tmp_path):
    with pytest.raises(NotStreamable, match="not a dense safetensors model directory"):
        open_streaming("tiny-random-llama")
    directory = saved_model(tmp_path / "renamed", layers=2)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.kernel"] = tensors.pop("model.layers.0.self_attn.q_proj.weight")
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NotStreamable, match="stored tensor names differ"):
        open_streaming(str(directory))


def test_blocks_are_materialised_one_at_a_time(llama_dir, calib):
    source = open_streaming(str(llama_dir))
    blocks = decoder_blocks(source.model)
    resident: list[int] = []

    class Watching:
        def load_block(self, block, prefix, device, dtype):
            source.weights.load_block(block, prefix, device, dtype)
            resident.append(sum(not next(b.parameters()).is_meta for b in blocks))
            assert next(block.parameters()).dtype == torch.float32

        def release_block(self, block):
            source.weights.release_block(block)

    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    _, result = quantize_model(source.model, ids, "rtn", TINY_RTN, weights=Watching(), device="cpu")
    assert resident == [1, 1, 1] and result.blocks_done == 3 and len(result.states) == 21
    assert all(p.is_meta for p in blocks.parameters())  # every block released again


def _live_tensor_storages() -> int:
    """Distinct storages of the tensors the garbage collector can see (meta tensors aside)."""
    ptrs = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            ptrs.add(obj.untyped_storage().data_ptr())
    return len(ptrs)


@pytest.mark.parametrize("method,config", [("vptq", TINY_VQ), ("rtn", TINY_RTN)])
def test_a_finished_block_leaves_no_tensors_behind(tmp_path, calib, method, config):
    """Streamed, with the cycle collector off: what a block held is freed when the next starts (no reference
    cycle keeps a block's activations or weights), so the tensors alive at the end of each block stay level."""
    model_dir = saved_model(tmp_path / "model", layers=6)
    counts: list[int] = []

    def on_layer(report):
        if report.name.endswith("down_proj"):  # the block's last linear
            counts.append(_live_tensor_storages())

    gc.collect()
    gc.disable()
    try:
        quantize_to_dir(str(model_dir), method, config, calib, tmp_path / "out", stream=True, on_layer=on_layer)
    finally:
        gc.enable()
    assert len(counts) == 6
    assert counts[-1] <= counts[1], f"live tensor storages at the end of each block: {counts}"


# ------------------------------------------------------------------------------------ same result both ways
@pytest.mark.parametrize("method,config", [("vptq", TINY_VQ), ("rtn", TINY_RTN)])
def test_streamed_checkpoint_equals_whole_model_checkpoint(tmp_path, llama_dir, calib, method, config):
    streamed, summary = quantize_to_dir(str(llama_dir), method, config, calib, tmp_path / "s", stream=True)
    assert summary["streaming"] == "on" and summary["layers"] == 21
    whole, summary = quantize_to_dir(str(llama_dir), method, config, calib, tmp_path / "w", stream=False)
    assert summary["streaming"] == "off"
    assert (streamed / "model.safetensors").read_bytes() == (whole / "model.safetensors").read_bytes()
    assert not (streamed / ".partial").exists()
    # and the same tensors as the Python API on the model in memory
    model, tok = tiny_random_model("llama", num_layers=3)
    from vptq_core.data import calibration_windows

    ids = calibration_windows(tok, calib.text, calib.samples, calib.seqlen, calib.seed)
    _, result = quantize_model(model, ids, method, config)
    in_memory = save_quantized(model, tok, result.states, tmp_path / "m", dtype=torch.bfloat16)
    assert_same_checkpoint(streamed, in_memory, whole_config=False)


def test_sharded_checkpoint_streams(tmp_path, calib):
    directory = saved_model(tmp_path / "sharded", family="qwen2", max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    weights = SafetensorsWeights(directory)
    assert len(weights.files) > 2
    streamed, summary = quantize_to_dir(str(directory), "rtn", TINY_RTN, calib, tmp_path / "s", stream=True)
    assert summary["streaming"] == "on"
    whole, _ = quantize_to_dir(str(directory), "rtn", TINY_RTN, calib, tmp_path / "w", stream=False)
    assert_same_checkpoint(streamed, whole)
    model, _ = load_quantized(streamed)
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # qwen2's biases travelled


def test_bf16_checkpoint_streams_in_its_own_dtype(tmp_path, calib):
    directory = saved_model(tmp_path / "bf16", dtype=torch.bfloat16, layers=2)
    source = open_streaming(str(directory))
    assert source.dtype == torch.bfloat16 and source.model.model.embed_tokens.weight.dtype == torch.bfloat16
    streamed, _ = quantize_to_dir(str(directory), "vptq", TINY_VQ, calib, tmp_path / "s", stream=True)
    whole, _ = quantize_to_dir(str(directory), "vptq", TINY_VQ, calib, tmp_path / "w", stream=False)
    assert_same_checkpoint(streamed, whole)


FT_VQ = VPTQConfig(vector_len=4, num_centroids=16, kmeans_iters=2, outlier_percent=0.0, finetune_iters=4,
                   finetune_norm_lr=0.05, finetune_holdout=0.0)


def test_fine_tuned_norms_are_saved_streamed_whole_and_resumed(tmp_path, calib):
    """Layer-wise fine-tuning trains the blocks' norms: the checkpoint holds them whether the blocks were streamed
    (each freed after its block), the model was whole, or the run was stopped and resumed from ``.partial``."""
    directory = saved_model(tmp_path / "bf16", dtype=torch.bfloat16)
    streamed, summary = quantize_to_dir(str(directory), "vptq", FT_VQ, calib, tmp_path / "s", stream=True)
    assert summary["streaming"] == "on"
    whole, summary = quantize_to_dir(str(directory), "vptq", FT_VQ, calib, tmp_path / "w", stream=False)
    assert summary["streaming"] == "off"
    seen: list = []  # stopped inside block 1 (fine-tuning polls too), resumed streamed from the end of block 0
    cut, summary = quantize_to_dir(str(directory), "vptq", FT_VQ, calib, tmp_path / "r", stream=True,
                                   on_layer=seen.append, should_stop=lambda: len(seen) >= 8)
    assert summary["cancelled"] and summary["blocks_done"] == 1
    resumed, summary = quantize_to_dir(str(directory), "vptq", FT_VQ, calib, cut, stream=True, resume=True)
    assert summary["resumed_from_block"] == 1 and not summary["cancelled"]
    assert_same_checkpoint(streamed, whole)
    assert_same_checkpoint(streamed, resumed)

    original, saved = load_file(str(directory / "model.safetensors")), checkpoint_tensors(streamed)
    norms = [key for key in saved if key.endswith("layernorm.weight")]
    assert len(norms) == 6
    for key in norms:  # every block's two norms trained, kept in float32 (bf16 would round the steps away)
        assert saved[key].dtype == torch.float32
        assert not torch.equal(saved[key], original[key].float()), key
    assert any(not torch.equal(saved[key], saved[key].to(torch.bfloat16).float()) for key in norms)
    assert torch.equal(saved["model.norm.weight"], original["model.norm.weight"].float())  # outside the blocks


def test_stream_true_refuses_a_model_built_in_code(tmp_path, calib):
    with pytest.raises(ValueError, match="cannot stream 'tiny-random-llama' block by block"):
        quantize_to_dir("tiny-random-llama", "rtn", TINY_RTN, calib, tmp_path / "x", stream=True)
    _, summary = quantize_to_dir("tiny-random-llama", "rtn", TINY_RTN, calib, tmp_path / "y")
    assert summary["streaming"].startswith("off: ")


# ------------------------------------------------------------------------------------------- the writer
def test_safetensors_writer_matches_save_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(3, 5, generator=gen).to(torch.bfloat16),
        "b.i32": torch.randint(0, 1000, (7,), generator=gen, dtype=torch.int32),
        "c.u8": torch.randint(0, 255, (3, 3), generator=gen).to(torch.uint8),
        "d.f32": torch.randn(2, 3, generator=gen),
        "e.i16": torch.randint(0, 100, (5,), generator=gen, dtype=torch.int16),
        "f.i64": torch.arange(3),
        "g.empty": torch.zeros(0, 4),
        "h.scalar": torch.tensor(2.5),
    }
    with SafetensorsWriter(tmp_path / "w.safetensors") as writer:
        for name, tensor in tensors.items():
            writer.add(name, tensor)
        writer.close(metadata={"format": "pt"})
    data = (tmp_path / "w.safetensors").read_bytes()
    loaded = load(data)  # the strict in-memory reader validates offsets and coverage
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    header_len = int.from_bytes(data[:8], "little")
    assert (8 + header_len) % 8 == 0
    header = json.loads(data[8 : 8 + header_len])
    assert header["__metadata__"] == {"format": "pt"}
    for name, entry in header.items():  # every tensor aligned to its element size
        if name != "__metadata__":
            assert entry["data_offsets"][0] % tensors[name].element_size() == 0, name
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no spool left behind


def test_safetensors_writer_cleans_up_on_error(tmp_path):
    with pytest.raises(ValueError, match="added twice"), SafetensorsWriter(tmp_path / "w.safetensors") as writer:
        writer.add("x", torch.zeros(2))
        writer.add("x", torch.zeros(2))
    assert list(tmp_path.iterdir()) == []


def test_a_run_from_a_directory_loads_the_original_for_distillation_and_lets_it_go_before_the_steps(
        tmp_path, calib, monkeypatch):
    """``api.quantize_to_dir`` (the CLI's and the app's path) hands the run a loader, not the original: a call with
    as many arguments as its call of ``quantize_model`` keeps them in a dict on the caller's stack until it returns,
    so an original passed in stayed in memory through every distillation step (0.7 GB on a 0.5B model)."""
    seen, during = [], []
    load = api.original_for

    def original_for(job):
        reference = load(job)
        seen.append(weakref.ref(reference))
        return reference

    monkeypatch.setattr(api, "original_for", original_for)

    def on_step(phase, step, steps, loss):
        if phase == "distill":
            during.append(seen[0]() is not None)

    _, summary = api.quantize_to_dir("tiny-random-llama", "vptq", TINY_DISTILL, calib, tmp_path / "q", on_step=on_step)
    assert summary["model_metrics"]["distill"]["steps"] == 4
    assert len(seen) == 1 and during == [False] * 4
