"""A small multiple-choice lm-eval task written into a folder (a YAML config over a local JSONL file), and one
whose data lives on the hub, for the tests of standard task evaluation."""

from __future__ import annotations

import json
from pathlib import Path

ITEMS = [("The sky on a clear day is", [" blue", " green", " loud"], 0),
         ("Two plus two is", [" four", " seven", " nine"], 0),
         ("A cat says", [" woof", " meow", " moo"], 1),
         ("Water is", [" dry", " wet", " square"], 1),
         ("Fire is", [" cold", " hot", " blue"], 1),
         ("The opposite of up is", [" down", " left", " red"], 0),
         ("Ice is made of", [" stone", " water", " paper"], 1),
         ("A week has seven", [" days", " hours", " cats"], 0)]
TASK = "vq_local_mc"
REMOTE = "vq_remote_mc"
CONFIG = """task: {task}
dataset_path: {dataset}
{kwargs}test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(root: Path) -> Path:
    """``root`` holding the local task ``TASK`` (its data beside it) and ``REMOTE`` (data on the hub)."""
    data = root / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS),
                    encoding="utf-8")
    kwargs = f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
    (root / f"{TASK}.yaml").write_text(CONFIG.format(task=TASK, dataset="json", kwargs=kwargs), encoding="utf-8")
    (root / f"{REMOTE}.yaml").write_text(CONFIG.format(task=REMOTE, dataset="vptq-core-tests/none", kwargs=""),
                                         encoding="utf-8")
    return root
