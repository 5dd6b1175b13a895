"""GGUF export of scalar checkpoints: a tiny llama (itself read from a GGUF file, whose tokenizer the export
copies) quantized through the CLI at the settings GGUF holds, exported, and read back with the ``gguf``
package (the tensors) and the project's own GGUF reader (the model's logits); every other setting refused in
one line."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from factories import random_vq_state
from test_gguf import write_gguf

from vptq_core.cli import main
from vptq_core.gguf_export import ALLOWED, export_gguf, gguf_name, row_order
from vptq_core.models import load_model, tiny_random_llama
from vptq_core.storage.checkpoint import load_quantized, save_quantized
from vptq_core.storage.modules import ScalarQLinear

IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("VPTQ_CORE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The tiny llama as an F32 GGUF file (the run's source), and a calibration text beside it."""
    root = tmp_path_factory.mktemp("source")
    model, tok = tiny_random_llama()
    (root / "calib.txt").write_text("Plain words for a small calibration text, repeated. " * 40, encoding="utf-8")
    return write_gguf(root / "tiny-llama.F32.gguf", model, tok)


def quantize(model: str, out: Path, *flags: str, calib: Path | None = None) -> Path:
    calib = calib or Path(model).with_name("calib.txt")
    rc = main(["quantize", "--model", model, "--calib-text", str(calib), "--calib-samples", "4", "--seqlen", "32",
               "--out", str(out), "--quiet", *flags])
    assert rc == 0
    return out


def read_back(path: Path) -> dict[str, tuple[np.ndarray, Q]]:
    """GGUF name -> (dequantized float32 [rows, cols], stored type)."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: (gguf.quants.dequantize(t.data, t.tensor_type), t.tensor_type) for t in reader.tensors}


def project_weights(ckpt: Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], object]:
    """GGUF name -> (the project's dequantized weight in llama.cpp's row order, scales, zeros), float32."""
    model, _ = load_quantized(ckpt, dtype=torch.float32, head_bits=0)
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, ScalarQLinear):
            order = row_order(name, module.out_features, model.config)
            order = torch.arange(module.out_features) if order is None else order
            out[f"{gguf_name(name)}.weight"] = (module.dequantize().float()[order], module.scales.float()[order],
                                                module.zeros.float()[order])
    return out, model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS, use_cache=False).logits


SETTINGS = [  # (method, flags, expected GGUF type of the quantized linears)
    ("rtn", ["--bits", "4", "--set", "sym=true"], Q.Q4_0),
    ("gptq", ["--bits", "4", "--set", "sym=true"], Q.Q4_0),
    ("rtn", ["--bits", "4"], Q.Q4_1),
    ("gptq", ["--bits", "4"], Q.Q4_1),
    ("gptq", ["--bits", "8", "--set", "sym=true"], Q.Q8_0),
]


@pytest.mark.parametrize(("method", "flags", "qtype"), SETTINGS, ids=lambda v: getattr(v, "name", None))
def test_export_round_trip(source, tmp_path, capsys, method, flags, qtype):
    ckpt = quantize(str(source), tmp_path / "ckpt", "--method", method, "--group-size", "32", *flags)
    out = tmp_path / "model.gguf"
    assert main(["export-gguf", "--model", str(ckpt), "--out", str(out)]) == 0
    assert f'"{qtype.name}": 14' in capsys.readouterr().out
    stored = read_back(out)
    weights, qmodel = project_weights(ckpt)
    assert set(weights) <= set(stored) and len(weights) == 14
    for name, (w, scales, zeros) in weights.items():
        got, kind = stored[name]
        assert kind == qtype, name
        got = torch.from_numpy(got.copy()).reshape(w.shape)
        if qtype != Q.Q4_1:  # the same fp16 scale times the same integer: exact
            assert torch.equal(got, w), name
            continue
        # Q4_1 stores m = -scale * zero rounded to fp16 (half an ulp: 2^-11 relative, 2^-25 absolute below
        # fp16's normal range), then float32 rounds d * q + m (2^-24 relative).
        m = (scales * zeros).repeat_interleave(32, dim=1)
        bound = m.abs() * 2**-11 + 2**-25 + (w.abs() + m.abs()) * 2**-24
        assert bool(((got - w).abs() <= bound).all()), name
    assert stored["token_embd.weight"][1] == Q.BF16 and stored["output_norm.weight"][1] == Q.F32
    assert "output.weight" not in stored  # tied head: llama.cpp reuses token_embd
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == qmodel.config.vocab_size
    # the project's own GGUF reader (transformers' loader) builds the same model from the exported file
    dense, _ = load_model(str(out))
    torch.testing.assert_close(logits(dense), logits(qmodel), rtol=1e-4, atol=1e-4)


def test_quantized_head_and_embedding_export(source, tmp_path):
    ckpt = quantize(str(source), tmp_path / "ckpt", "--method", "rtn", "--bits", "8", "--set", "sym=true",
                    "--group-size", "32", "--quantize-head", "--quantize-embedding")
    out = tmp_path / "model.gguf"
    summary = export_gguf(ckpt, out)
    stored = read_back(out)
    assert stored["token_embd.weight"][1] == Q.Q8_0 and "output.weight" not in stored, summary
    qmodel, _ = load_quantized(ckpt, dtype=torch.float32, head_bits=0)
    dense, _ = load_model(str(out))
    torch.testing.assert_close(logits(dense), logits(qmodel), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------- refusals
def refusal(args: list[str], capsys) -> str:
    capsys.readouterr()
    rc = main(["export-gguf", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and err.startswith("python -m vptq_core export-gguf: error: "), err
    return err


@pytest.mark.parametrize(("flags", "reason"), [
    (["--method", "rtn", "--bits", "4", "--group-size", "64"], "uses group size 64, GGUF blocks hold 32 weights"),
    (["--method", "rtn", "--bits", "3", "--group-size", "32"], "has 3-bit codes"),
    (["--method", "rtn", "--bits", "8", "--group-size", "32"], "8-bit with a zero point; Q8_0 is symmetric"),
    (["--method", "rtn", "--bits", "4", "--group-size", "32", "--act-bits", "8"], "quantizes its activations"),
])
def test_settings_without_a_gguf_twin_are_refused(source, tmp_path, capsys, flags, reason):
    ckpt = quantize(str(source), tmp_path / "ckpt", *flags)
    out = tmp_path / "model.gguf"
    err = refusal(["--model", str(ckpt), "--out", str(out)], capsys)
    assert reason in err and ALLOWED in err
    assert not out.exists() and not list(tmp_path.glob(".model.gguf.tmp*"))


def test_vector_quantized_checkpoint_is_refused(tmp_path, capsys):
    model, tok = tiny_random_llama()
    states = {name: random_vq_state(m.in_features, m.out_features, seed=i)
              for i, (name, m) in enumerate(model.named_modules())
              if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    ckpt = save_quantized(model, tok, states, tmp_path / "ckpt", report={"method": "vptq"}, dtype=torch.bfloat16)
    err = refusal(["--model", str(ckpt), "--out", str(tmp_path / "m.gguf")], capsys)
    assert "is a vector-quantized (vptq) checkpoint" in err


def test_tokenizer_needs_a_gguf_source(source, tmp_path, capsys):
    ckpt = quantize("tiny-random-llama", tmp_path / "ckpt", "--method", "rtn", "--bits", "4", "--set", "sym=true",
                    "--group-size", "32", calib=source.with_name("calib.txt"))
    out = tmp_path / "model.gguf"
    err = refusal(["--model", str(ckpt), "--out", str(out)], capsys)
    assert "--tokenizer-gguf" in err and not out.exists()
    assert main(["export-gguf", "--model", str(ckpt), "--out", str(out), "--tokenizer-gguf", str(source)]) == 0
    assert read_back(out)["blk.0.attn_q.weight"][1] == Q.Q4_0


def test_bad_paths(tmp_path, capsys):
    err = refusal(["--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "m.gguf")], capsys)
    assert "is not a quantized checkpoint" in err
    assert "must name a .gguf file" in refusal(["--model", str(tmp_path), "--out", str(tmp_path / "m.bin")], capsys)

