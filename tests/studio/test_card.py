"""The model card packed with every archive: base model, method, settings, bits, evaluation, license."""

from __future__ import annotations

import json
from pathlib import Path

from vptq_core.models import BUNDLED, TINY
from vptq_core.studio.card import model_card, write_model_card


def _ckpt(tmp_path: Path, source: str) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    report = {"model": {"source": source}, "method": "vptq",
              "settings": {"vector_len": 6, "num_centroids": 4096, "num_res_centroids": 0},
              "summary": {"index_bits_per_weight": 2.0, "total_bits_per_weight": 2.8},
              "calibration": {"text": "wiki", "samples": 32, "seqlen": 512, "seed": 0},
              "sizes": {"quantized_linear_bytes": 37_100_000, "bf16_linear_bytes": 212_300_000}}
    (ckpt / "quant_report.json").write_text(json.dumps(report))
    return ckpt


def test_card_names_base_method_bits_evaluation_and_license(tmp_path: Path):
    ckpt = _ckpt(tmp_path, BUNDLED)
    ev = {"perplexity": 25.57, "reference_perplexity": 21.67, "kl_divergence": 0.188, "top1_agreement": 0.759,
          "windows": 4, "seqlen": 512, "text": "wiki", "tokens": 2044}
    card = write_model_card(ckpt, evaluation=ev).read_text()
    front = card.split("---")[1]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in front and "license: apache-2.0" in front
    assert "- vptq" in front and "- 2-bit" in front
    assert f"# {BUNDLED}: VPTQ 2.80 bits per weight" in card
    assert "| index bits per weight | 2.000 |" in card and "| total bits per weight" in card
    assert "| 25.570 | 21.670 | 0.1880 | 75.9% |" in card and "4 windows × 512 tokens" in card
    assert "37.1 MB (212.3 MB in bf16)" in card and "32 windows × 512 tokens of the bundled Wikipedia text" in card
    assert "Apache License 2.0" in card and '"num_centroids": 4096' in card


def test_card_without_evaluation_or_known_license(tmp_path: Path):
    card = model_card(_ckpt(tmp_path, "someone/model"))
    assert "base_model: someone/model" in card and "license:" not in card.split("---")[1]
    assert "Not evaluated yet" in card and "is not known to this card" in card
    tiny = model_card(_ckpt(tmp_path / "t", TINY) if (tmp_path / "t").mkdir() is None else None)
    assert "random weights built in code for tests" in tiny and "base_model:" not in tiny
