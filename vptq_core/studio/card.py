"""The model card (``README.md``) packed with every checkpoint archive and pushed to the hub with it.

What it says: the base model (its hub id where known), the method and its settings, bits per weight, the
calibration data, the evaluation results when the run was evaluated, how to load the checkpoint, and the base
model's license where it is known (SmolLM2: Apache-2.0; Gemma 3: the Gemma Terms of Use, whose notice a
redistribution must carry). A quantized checkpoint is a modification of the base model's weights, so it stays
under the base model's license; where that license is unknown the card says so instead of guessing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..models import BUNDLED, GEMMA3, TINY_MODELS
from ..quant import methods
from .bit_plan import card_lines
from .views import eval_protocol, scrub_absolute

CARD_NAME = "README.md"
REPORT_NAME = "quant_report.json"


@dataclass(frozen=True)
class BaseModel:
    """What the card knows about the model a checkpoint was made from."""

    name: str  # as given to the app: a built-in name, a hub id or a local directory
    hub_id: str | None  # for ``base_model:`` in the card's metadata
    license: str | None  # the hub's license identifier (apache-2.0, gemma, ...); None: unknown
    license_text: str  # one paragraph for the card's License section


_APACHE = ("The base model is released under the **Apache License 2.0** "
           "(https://www.apache.org/licenses/LICENSE-2.0); this quantized checkpoint is a modified version of its "
           "weights and is distributed under the same license.")
_GEMMA = ("Gemma is provided under and subject to the **Gemma Terms of Use** found at "
          "https://ai.google.dev/gemma/terms. This quantized checkpoint is a modification of Gemma 3 and is "
          "distributed under the same terms, including the Gemma Prohibited Use Policy "
          "(https://ai.google.dev/gemma/prohibited_use_policy); whoever uses or redistributes it must accept them.")
KNOWN_BASES = {
    BUNDLED: BaseModel(BUNDLED, "HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0", _APACHE),
    GEMMA3: BaseModel(GEMMA3, "google/gemma-3-270m", "gemma", _GEMMA),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_FRONT_LICENSE = re.compile(r"^license:\s*['\"]?([A-Za-z0-9._-]+)['\"]?\s*$", re.MULTILINE)


def base_model(name: str | None) -> BaseModel:
    """The base model of a run, with its license where it can be known without the hub."""
    name = (name or "").strip()
    if name in KNOWN_BASES:
        return KNOWN_BASES[name]
    if name in TINY_MODELS:
        return BaseModel(name, None, None, "The base model is a tiny model with random weights built in code for "
                                           "tests; it has no license and no use beyond testing.")
    local = Path(name).expanduser() if name else None
    if local is not None and local.is_dir():
        license_id = _license_of_card(local / CARD_NAME)
        if license_id:
            return BaseModel(name, None, license_id, f"The base model's card (in its directory) gives the license "
                                                     f"`{license_id}`; this quantized checkpoint is a modification "
                                                     "of its weights and stays under it.")
        return BaseModel(name, None, None, "The base model came from a local directory whose license is unknown to "
                                           "this card: check it before sharing this checkpoint.")
    if _HUB_ID.match(name):
        return BaseModel(name, name, None, f"The license of the base model `{name}` is not known to this card: see "
                                           f"https://huggingface.co/{name} before sharing this checkpoint.")
    return BaseModel(name or "unknown", None, None, "The base model is unknown, and so is its license.")


def _license_of_card(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith("---"):
        return None
    end = text.find("\n---", 3)
    match = _FRONT_LICENSE.search(text[3:end if end > 0 else len(text)])
    return match.group(1) if match else None


def _read_report(ckpt: Path) -> dict:
    try:
        report = json.loads((ckpt / REPORT_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return report if isinstance(report, dict) else {}


def _fmt(value, digits: int = 3) -> str:
    return "?" if value is None else f"{float(value):.{digits}f}"


def model_card(ckpt: str | Path, source: str | None = None, evaluation: Mapping | None = None) -> str:
    """The model card of the checkpoint directory ``ckpt`` (settings and bits from its ``quant_report.json``;
    ``source``: the base model's name when the report does not say; ``evaluation``: an ``EvalResult.to_dict()``)."""
    ckpt = Path(ckpt)
    report = _read_report(ckpt)
    source = (report.get("model") or {}).get("source") or source
    base = base_model(source)
    method = str(report.get("method") or "?")
    known = method in methods.names()
    label = methods.get(method).label if known else method.upper()
    settings = report.get("settings") or {}
    described = methods.get(method).describe(settings) if known and settings else ""
    summary = report.get("summary") or {}
    sizes = report.get("sizes") or {}
    calib = report.get("calibration") or {}
    evaluation = evaluation or report.get("eval")
    index_bits, total_bits = summary.get("index_bits_per_weight"), summary.get("total_bits_per_weight")
    bit_tag = f"{round(index_bits)}-bit" if index_bits else None

    meta = []
    if base.hub_id:
        meta += [f"base_model: {base.hub_id}", "base_model_relation: quantized"]
    if base.license:
        meta.append(f"license: {base.license}")
    meta += ["library_name: transformers", "pipeline_tag: text-generation", "tags:"]
    meta += [f"- {t}" for t in ("vptq-core", "quantized", method.lower(), bit_tag) if t]

    lines = ["---", *meta, "---", "", f"# {base.name}: {label} {_fmt(total_bits, 2)} bits per weight", "",
             f"A quantized copy of **{base.name}**" + (f" ([{base.hub_id}](https://huggingface.co/{base.hub_id}))"
                                                        if base.hub_id else "")
             + f", made with vptq_core {__version__} (the VPTQ Studio app).", "",
             "| | |", "|---|---|",
             f"| base model | `{base.name}` |",
             f"| method | {label}" + (f" ({methods.get(method).description})" if known else "") + " |"]
    if described:
        lines.append(f"| settings | {described} |")
    lines += [f"| index bits per weight | {_fmt(index_bits)} |",
              f"| total bits per weight (with codebooks, scales, permutations) | {_fmt(total_bits)} |"]
    if sizes.get("quantized_linear_bytes") is not None:
        lines.append(f"| quantized linears on disk | {sizes['quantized_linear_bytes'] / 1e6:.1f} MB "
                     f"({sizes.get('bf16_linear_bytes', 0) / 1e6:.1f} MB in bf16) |")
    if calib:
        text = calib.get("text")
        text = "the bundled Wikipedia text" if text == "wiki" else "an uploaded text file" if text else "?"
        lines.append(f"| calibration | {calib.get('samples', '?')} windows × {calib.get('seqlen', '?')} tokens of "
                     f"{text}, seed {calib.get('seed', '?')} |")
    lines += ["", "## Evaluation", ""]
    if evaluation:
        lines += ["| perplexity | original's perplexity | KL to the original (nats/token) | top-1 agreement |",
                  "|---|---|---|---|",
                  f"| {_fmt(evaluation.get('perplexity'))} | {_fmt(evaluation.get('reference_perplexity'))} | "
                  f"{_fmt(evaluation.get('kl_divergence'), 4)} | "
                  + (f"{100 * evaluation['top1_agreement']:.1f}%" if evaluation.get("top1_agreement") is not None
                     else "?") + " |", "",
                  f"{eval_protocol(evaluation)} ({evaluation.get('tokens', '?')} predicted tokens)."]
    else:
        lines.append("Not evaluated yet (the app's *Evaluate vs the original* adds perplexity, KL and top-1 "
                     "agreement here).")
    plan = card_lines(report)
    if plan:
        lines += ["", *plan[:-1]]
    if settings:
        lines += ["", "## All settings", "", "```json", json.dumps(settings, indent=2, sort_keys=True), "```"]
    lines += ["", "## How to load", "", "```python",
              "import vptq_core  # also registers the checkpoint format with transformers",
              "model, tokenizer = vptq_core.load_quantized(\"path/to/this/folder\")",
              "# or: transformers.AutoModelForCausalLM.from_pretrained(\"path/to/this/folder\") after import vptq_core",
              "```", "", "## License", "", base.license_text, ""]
    return "\n".join(lines)


def write_model_card(ckpt: str | Path, source: str | None = None, evaluation: Mapping | None = None) -> Path:
    """Write ``README.md`` into the checkpoint directory (replacing an older card) and return its path."""
    path = Path(ckpt) / CARD_NAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(scrub_absolute(model_card(ckpt, source, evaluation)), encoding="utf-8")  # no server paths
    tmp.replace(path)
    return path
