"""The documentation holds together: every relative link and anchor resolves, the front page stays a short
landing page with the Space front matter and the test command, docs/results.md is what bench/make_results.py
writes, and every docs page a code comment points at exists (with its heading)."""

from __future__ import annotations

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
