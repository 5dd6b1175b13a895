"""The documentation holds together: every relative link and anchor resolves, the front page stays a short
landing page with the Space front matter and the test command, docs/results.md is what bench/make_results.py
writes, and every docs page a code comment points at exists (with its heading)."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOC_FILES = sorted([README, *(ROOT / "docs").rglob("*.md")])
TEST_COMMAND = ("pip install -r requirements-dev.txt && pip install --no-deps -r requirements-nodeps.txt && "
                "python -m pytest -q")
BANNED_PHRASES = ("this round", "this session", "last round")
CODE_ROOTS = ("vptq_core", "kernels", "bench")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DOCS_REFERENCE = re.compile(r"(?<![\w/.-])(docs/[\w./-]+\.md)(#[\w-]+)?")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: markup dropped, lowercase, punctuation but '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"[`*]", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 ... suffixes for repeated headings."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[str]:
    """Targets of the inline links and images outside code (inline code spans removed first)."""
    found = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        found += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return found


def broken_link(source: Path, target: str, root: Path = ROOT) -> str | None:
    """Why ``target`` (a link in ``source``, a file of the repository at ``root``) does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto: ...
        return None
    path_part, _, anchor = target.partition("#")
    destination = (source.parent / path_part).resolve() if path_part else source
    if not destination.exists():
        return f"{target}: no such file"
    if root.resolve() not in destination.parents:
        return f"{target}: outside the repository"
    if anchor:
        if destination.suffix != ".md":
            return f"{target}: an anchor into a file that is not Markdown"
        if anchor not in anchors(destination):
            return f"{target}: no heading with the anchor #{anchor} in {destination.name}"
    return None


# ---------------------------------------------------------------------------------------------- the helpers
def test_slug_follows_github():
    assert slug("Large models: streaming, resume, GPUs") == "large-models-streaming-resume-gpus"
    assert slug("GPTQ and RTN") == "gptq-and-rtn"
    assert slug("The LM head at run time") == "the-lm-head-at-run-time"
    assert slug("transformers' `from_pretrained`") == "transformers-from_pretrained"
    assert slug("One run, stage by stage") == "one-run-stage-by-stage"


def test_link_checker_finds_what_is_broken(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "elsewhere.md").write_text("# Elsewhere\n", encoding="utf-8")
    page = repo / "page.md"
    page.write_text("# Title\n\n## A section\n\n```\n## Not a heading\n```\n\n## A section\n", encoding="utf-8")
    assert anchors(page) == {"title", "a-section", "a-section-1"}
    assert broken_link(page, "#a-section-1", repo) is None
    assert broken_link(page, "page.md#title", repo) is None
    assert broken_link(page, "https://example.org/x#y", repo) is None
    assert "no heading" in broken_link(page, "#not-a-heading", repo)
    assert "no heading" in broken_link(page, "#not-a-heading-1", repo)
    assert "no such file" in broken_link(page, "missing.md", repo)
    assert "outside the repository" in broken_link(page, "../elsewhere.md", repo)


# ------------------------------------------------------------------------------------------------ (a) links
def test_there_are_docs_pages():
    names = {p.relative_to(ROOT).as_posix() for p in DOC_FILES}
    assert {"README.md", "docs/README.md", "docs/usage.md", "docs/methods.md", "docs/results.md"} <= names


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(path):
    problems = [why for target in links(path) if (why := broken_link(path, target))]
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


def test_docs_index_links_every_page():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in links(index)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md")} - {index.resolve()}
    assert not pages - linked, f"docs/README.md does not link {sorted(p.name for p in pages - linked)}"


# ------------------------------------------------------------------------------------------ (b, c) the front page
def test_readme_is_a_short_landing_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    front = re.match(r"^---\n(.*?)\n---\n", text, re.DOTALL)
    assert front, "README.md must open with the Hugging Face Space front matter"
    assert "app_file: app.py" in front.group(1).splitlines()
    assert "sdk: gradio" in front.group(1).splitlines()
    assert TEST_COMMAND in text


def test_readme_says_nothing_of_rounds_or_sessions():
    text = README.read_text(encoding="utf-8").lower()
    found = [phrase for phrase in BANNED_PHRASES if phrase in text]
    assert not found, f"README.md mentions {found}"


# ----------------------------------------------------------------------------------------- (d) results.md
def test_results_page_is_what_make_results_writes():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "make_results.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_results_page_says_it_is_generated():
    text = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    assert "generated by bench/make_results.py from bench/results/ — do not edit by hand" in text.splitlines()[2]


# ----------------------------------------------------------------------- (e) docs pages named in the code
def code_references() -> list[tuple[str, str, str]]:
    """(file, docs path, anchor or '') for every docs/...md mentioned in the code (comments and strings alike)."""
    files = [ROOT / "app.py"] + [p for root in CODE_ROOTS for p in sorted((ROOT / root).rglob("*.py"))]
    found = []
    for path in files:
        for match in DOCS_REFERENCE.finditer(path.read_text(encoding="utf-8")):
            found.append((path.relative_to(ROOT).as_posix(), match.group(1), (match.group(2) or "").lstrip("#")))
    return found


def test_docs_references_in_the_code_resolve():
    problems = []
    for source, page, anchor in code_references():
        target = ROOT / page
        if not target.is_file():
            problems.append(f"{source}: {page} does not exist")
        elif anchor and anchor not in anchors(target):
            problems.append(f"{source}: {page} has no heading with the anchor #{anchor}")
    assert not problems, "; ".join(problems)


def test_code_reference_scan_sees_this_repository():
    refs = {(page, anchor) for _, page, anchor in code_references()}
    assert ("docs/results.md", "") in refs  # bench/make_results.py names its output


@functools.cache
def load_make_results():
    """bench/make_results.py as a module (bench/ is scripts, not a package: imported from its file)."""
    spec = importlib.util.spec_from_file_location("make_results", ROOT / "bench" / "make_results.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_make_results_skips_what_it_cannot_read(tmp_path):
    make_results = load_make_results()
    row = {"row": "rtn-4", "label": "RTN 4-bit", "perplexity": 30.0, "bf16_perplexity": 24.0, "index_bits": 4.0,
           "total_bits": 4.5, "kl": 0.3, "top1": 0.7, "quant_seconds": 60.0, "threads": 2,
           "calib": {"samples": 16, "seqlen": 512}, "ood_perplexity": 18.0, "ood_bf16_perplexity": 15.0}
    (tmp_path / "quality_x.jsonl").write_text(json.dumps(row) + "\n", encoding="utf-8")
    (tmp_path / "quality_broken.jsonl").write_text('{"row": "cut off', encoding="utf-8")
    (tmp_path / "other.jsonl").write_text('{"something": 1}\n', encoding="utf-8")
    (tmp_path / "kernels_x.txt").write_text("protocol line\n| a | b |\n|---|---|\n| 1 | 2 |\ntail\n", encoding="utf-8")
    (tmp_path / "notes.txt").write_text("no table here\n", encoding="utf-8")
    (tmp_path / "blob.txt").write_bytes(b"\xff\xfe\x00garbage")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    page, shown, not_shown = make_results.build(tmp_path)
    assert shown == ["kernels_x.txt", "quality_x.jsonl"]
    reasons = dict(not_shown)
    assert set(reasons) == {"quality_broken.jsonl", "other.jsonl", "notes.txt", "blob.txt", "image.png"}
    assert "not JSON" in reasons["quality_broken.jsonl"] and "no Markdown table" in reasons["notes.txt"]
    assert "| rtn-4 | RTN 4-bit | 4.00 / 4.50 | 30.00 | 1.25× |" in page
    assert ("python bench/quality.py --calib-samples 16 --threads 2 --rows rtn-4 "
            "--results bench/results/quality_x.jsonl") in page
    assert "| 1 | 2 |" in page and "## Files not shown" in page
    assert page.splitlines()[2] == make_results.HEADER + "."


def test_make_results_reads_a_presets_log(tmp_path):
    make_results = load_make_results()
    (tmp_path / "presets_cli_x.txt").write_text(
        "== machine X, 2 vCPUs\n   quantize: python -m vptq_core quantize ...\n"
        "-- the code of some commit\n"
        "== 2026-12-04 15:08:07 s25f: --preset 2.5\n"
        "  wall 6:26.83, peak RSS 4.06 GB; pipeline 378.98 s; 2.49990 total / 2.3391 index bits\n"
        "  distillation 48 of 48 steps, check KL 0.7069 -> 0.5322 (best 48); teacher 13.2 s\n"
        "  wiki   45.410 (bf16 23.443) = 1.937x, KL 0.7264, top-1 57.12%\n"
        "  pydocs 28.498 (bf16 14.820) = 1.923x, KL 0.6648, top-1 59.66%\n"
        "== 2026-12-04 15:08:07 s25f: --preset 2.5\n  wall 1:00.00\n", encoding="utf-8")
    page, shown, _ = make_results.build(tmp_path)
    assert shown == ["presets_cli_x.txt"]
    assert ("| 2026-12-04 15:08:07 | s25f | `--preset 2.5` | 2.49990 / 2.3391 | 1.937×, KL 0.7264 | 1.923×, KL 0.6648 "
            "| 48 of 48, 0.7069 → 0.5322 (48) | 378.98 | 6:26.83 | 4.06 GB |") in page
    assert "machine X, 2 vCPUs" in page and "the code of some commit" in page
    assert page.count("| s25f |") == 1  # a block logged twice is shown once


def test_make_results_shows_seeds_on_the_test_split_and_marks_the_old_protocol(tmp_path):
    make_results = load_make_results()

    def scores(ratio: float) -> dict:
        one = {"perplexity": 20.0 * ratio, "reference_perplexity": 20.0, "kl_divergence": ratio - 1, "kl_median": 0.1,
               "kl_p99": 2.0, "delta_p_mean": -0.02, "top1_agreement": 0.8}
        return {f"{text}/{split}": one for text in ("wiki", "pydocs") for split in ("test", "dev")}

    rows = [{"row": "gptq-3", "label": "GPTQ 3-bit", "seed": seed, "scores": scores(ratio), "perplexity": 1.0,
             "bf16_perplexity": 1.0, "index_bits": 3.0, "total_bits": 3.5, "quant_seconds": 100.0 + seed,
             "threads": 2, "calib": {"samples": 32}, "calib_perplexity": None, "windows": 16}
            for seed, ratio in ((0, 1.2), (1, 1.4))]
    (tmp_path / "quality_new.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    old = {"row": "rtn-4", "perplexity": 30.0, "bf16_perplexity": 24.0, "index_bits": 4.0, "total_bits": 4.5}
    (tmp_path / "quality_old.jsonl").write_text(json.dumps(old) + "\n", encoding="utf-8")
    page, shown, _ = make_results.build(tmp_path)
    assert shown == ["quality_new.jsonl", "quality_old.jsonl"]
    assert ("| gptq-3 | GPTQ 3-bit | 0 1 | 3.50 | 1.300 (1.200–1.400)× | 0.300 (0.200–0.400) | 0.1000 | 2.00 | -2.00% "
            "| 80.0% | 1.300 (1.200–1.400)× |") in page
    assert ("python bench/quality.py --threads 2 --seeds 0 1 --skip-calib-eval --rows gptq-3 "
            "--results bench/results/quality_new.jsonl") in page
    new, old_part = page.split("### quality_old.jsonl")
    assert "Old protocol" not in new.split("### quality_new.jsonl")[1] and "**Old protocol**" in old_part
