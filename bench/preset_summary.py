"""Summary of one `bench/preset_run.sh` run: wall time and peak memory, bits, phase timings, the sensitivity plan,
the distillation's check KL, and perplexity against bf16 on the held-out split `eval` used (test by default) of
both texts, with the KL statistics (mean, median, p99) and Δp of the original's top token.

usage: python bench/preset_summary.py NAME [NAME ...]   (env OUT, default /tmp/presets, and SPLIT, default test, as
       for preset_run.sh)
"""
import json
import os
import re
import sys
from pathlib import Path


def summary(root: Path, name: str) -> str:
    report = json.loads((root / name / "quant_report.json").read_text())
    s = report["summary"]
    metrics = s.get("model_metrics", {})  # absent in a run without a bit plan or distillation
    log = (root / f"{name}.log").read_text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", log).group(1)
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1))
    lines = [log.splitlines()[0],
             f"  wall {wall}, peak RSS {rss_kb / 1e6:.2f} GB; pipeline {s['seconds']} s; "
             f"{s['total_bits_per_weight']:.5f} total / {s['index_bits_per_weight']:.4f} index bits",
             "  timings: " + ", ".join(f"{k} {v}" for k, v in s["timings"].items())]
    if "allocation" in metrics:
        a = metrics["allocation"]
        plan = dict(sorted(a["settings"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  allocation: measure {a['measure_seconds']:.1f} s, distortion {a['distortion_seconds']:.1f} s; "
                     f"predicted loss {a['predicted_loss']:.3g} (cap {a['predicted_loss_cap']:.3g}); plan {plan}")
    c = metrics.get("calibration")  # the writing of the self-written windows cut short by the budget, or a loop kept
    if c:
        lines.append("  calibration: " + "; ".join(f"{k} {v}" for k, v in c.items()))
    d = metrics.get("distill")
    if d:
        lines.append(f"  distillation {d['steps']} of {d.get('planned_steps')} steps, check KL {d['kl_before']:.4f} -> "
                     f"{d['kl_after']:.4f} (best {d['best_step']}); teacher {d['teacher_seconds']:.1f} s")
    tag = "" if os.environ.get("SPLIT", "test") == "test" else f"_{os.environ['SPLIT']}"
    for text in ("wiki", "pydocs"):
        e = json.loads((root / f"{name}{tag}_{text}.json").read_text())
        ratio = e["perplexity"] / e["reference_perplexity"]
        split = f"{e['split']} " if e.get("split") else ""  # the held-out split `eval` used (test by default)
        stats = (f", KL median {e['kl_median']:.4f}, p99 {e['kl_p99']:.3f}, Δp {100 * e['delta_p_mean']:+.2f}%"
                 if e.get("kl_median") is not None else "")
        lines.append(f"  {text:6s} {split}{e['perplexity']:.3f} (bf16 {e['reference_perplexity']:.3f}) = "
                     f"{ratio:.3f}x, KL {e['kl_divergence']:.4f}, top-1 {100 * e['top1_agreement']:.2f}%{stats}")
    return "\n".join(lines)


if __name__ == "__main__":
    root = Path(os.environ.get("OUT", "/tmp/presets"))
    for name in sys.argv[1:]:
        print(summary(root, name))
