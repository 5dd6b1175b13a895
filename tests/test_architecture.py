"""What may import what, read from the source with ``ast`` (nothing of the project is imported here).

The rules (docs/architecture.md, ## What may import what):

- ``vptq_core.quant`` is pure tensor code: it imports only ``vptq_core.quant`` and ``kernels``;
- ``kernels`` imports nothing of ``vptq_core``, and its modules reach each other only by relative imports (the
  folder is installed as ``vptq_core.kernels`` and also runs as the top-level ``kernels`` in a checkout);
- ``vptq_core.storage`` never imports ``vptq_core.studio`` nor the entry points (``api``, ``cli``, ``__main__``);
- no import cycle inside ``vptq_core.quant``, nor in the project as a whole;
- the test files mirror the packages (switched on once ``tests/`` has its subfolders).

Every import counts: at module level, inside functions and under ``if TYPE_CHECKING:``; absolute and relative;
``from package import name`` counts as importing the submodule ``package.name`` when there is one, else the
package. ``vptq_core.kernels`` and ``kernels`` name the same modules and are counted as ``kernels``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def _repo_root() -> Path:
    """The folder holding pyproject.toml above this file (found by walking up: the tests may live in subfolders)."""
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    raise FileNotFoundError(f"no pyproject.toml above {__file__}")


ROOT = _repo_root()
PACKAGES = ("vptq_core", "kernels")  # the top-level folders whose modules make the graph
KERNELS_INSTALLED_NAME = "vptq_core.kernels"

# Modules of vptq_core.storage may not import these (nor their submodules).
STORAGE_FORBIDDEN = ("vptq_core.studio", "vptq_core.api", "vptq_core.cli", "vptq_core.__main__")


@dataclass(frozen=True)
class Import:
    """One project import: ``source`` imports module ``target`` at ``line`` with the statement ``text``."""

    source: str
    target: str
    line: int
    text: str
    relative: bool

    def __str__(self) -> str:
        return f"{self.source} imports {self.target} (line {self.line}: `{self.text}`)"


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the project packages (a package is its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def canonical(name: str) -> str:
    """``vptq_core.kernels[.x]`` -> ``kernels[.x]``: the installed and the checkout name of the same module."""
    if name == KERNELS_INSTALLED_NAME or name.startswith(KERNELS_INSTALLED_NAME + "."):
        return name[len("vptq_core."):]
    return name


def _nearest_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a project module; None for imports from outside the project."""
    parts = canonical(name).split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _base_of_relative(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <dots><node.module>`` refers to inside ``module``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    up = node.level - 1
    if up > len(package) - 1:
        raise ValueError(f"{module}: relative import beyond the top-level package at line {node.lineno}")
    base = package[: len(package) - up]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> Iterator[Import]:
    """Every import of a project module in one file, wherever it stands in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _nearest_module(alias.name, modules)
                if target is not None:
                    yield Import(module, target, node.lineno, ast.unparse(node), relative=False)
        elif isinstance(node, ast.ImportFrom):
            relative = node.level > 0
            base = _base_of_relative(module, is_package, node) if relative else node.module
            for alias in node.names:
                submodule = canonical(f"{base}.{alias.name}")
                target = submodule if submodule in modules else _nearest_module(base, modules)
                if target is not None:
                    yield Import(module, target, node.lineno, ast.unparse(node), relative)


def project_imports(root: Path = ROOT) -> list[Import]:
    """All imports between project modules, deduplicated per (source, target, line)."""
    modules = module_files(root)
    found = {}
    for module, path in modules.items():
        for imp in imports_of(module, path, modules):
            found.setdefault((imp.source, imp.target, imp.line), imp)
    return sorted(found.values(), key=lambda imp: (imp.source, imp.line, imp.target))


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted, sorted by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(edges.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(components)


def cycles_report(imports: list[Import], keep) -> list[str]:
    """One line per import cycle among the imports ``keep`` accepts: its modules, then the imports that close it."""
    edges: dict[str, set[str]] = {}
    for imp in imports:
        if keep(imp) and imp.source != imp.target:
            edges.setdefault(imp.source, set()).add(imp.target)
    lines = []
    for component in strongly_connected(edges):
        members = set(component)
        inside = [str(imp) for imp in imports if keep(imp) and imp.source in members and imp.target in members
                  and imp.source != imp.target]
        lines.append("cycle among " + ", ".join(component) + ":\n    " + "\n    ".join(inside))
    return lines


def _fail_with(violations: list, what: str) -> None:
    if violations:
        pytest.fail(f"{len(violations)} {what}:\n" + "\n".join(str(v) for v in violations), pytrace=False)


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return project_imports()


def test_the_graph_sees_every_kind_of_import(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("from .ops import run\n")
    (tmp_path / "kernels" / "ops.py").write_text("def run():\n    from vptq_core.kernels import spec\n")
    (tmp_path / "kernels" / "spec.py").write_text("")
    (tmp_path / "vptq_core" / "quant").mkdir(parents=True)
    (tmp_path / "vptq_core" / "__init__.py").write_text("")
    (tmp_path / "vptq_core" / "data.py").write_text("")
    (tmp_path / "vptq_core" / "quant" / "__init__.py").write_text("")
    (tmp_path / "vptq_core" / "quant" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nimport torch\nif TYPE_CHECKING:\n    from .. import data\n"
        "from . import b\nimport vptq_core.kernels.spec\nfrom vptq_core import nothing_module\n"
    )
    (tmp_path / "vptq_core" / "quant" / "b.py").write_text("from .a import x\n")
    edges = {(imp.source, imp.target) for imp in project_imports(tmp_path)}
    assert edges == {
        ("kernels", "kernels.ops"), ("kernels.ops", "kernels.spec"), ("vptq_core.quant.a", "vptq_core.data"),
        ("vptq_core.quant.a", "vptq_core.quant.b"), ("vptq_core.quant.a", "kernels.spec"),
        ("vptq_core.quant.a", "vptq_core"), ("vptq_core.quant.b", "vptq_core.quant.a"),
    }
    cycles = cycles_report(project_imports(tmp_path), lambda imp: True)
    assert len(cycles) == 1 and cycles[0].startswith("cycle among vptq_core.quant.a, vptq_core.quant.b:")


def test_quant_imports_only_quant_and_kernels(imports):
    violations = [imp for imp in imports if in_package(imp.source, "vptq_core.quant")
                  and not (in_package(imp.target, "vptq_core.quant") or in_package(imp.target, "kernels"))]
    _fail_with(violations, "imports out of vptq_core.quant (it may import only vptq_core.quant and kernels)")


def test_kernels_import_nothing_of_vptq_core(imports):
    violations = [imp for imp in imports if in_package(imp.source, "kernels") and in_package(imp.target, "vptq_core")]
    _fail_with(violations, "imports of vptq_core from kernels")


def test_kernels_reach_each_other_by_relative_imports_only(imports):
    violations = [imp for imp in imports if in_package(imp.source, "kernels") and in_package(imp.target, "kernels")
                  and not imp.relative]
    _fail_with(violations, "absolute imports inside kernels (they break one of its two names; use `from . import`)")


def test_storage_imports_neither_studio_nor_entry_points(imports):
    violations = [imp for imp in imports if in_package(imp.source, "vptq_core.storage")
                  and any(in_package(imp.target, forbidden) for forbidden in STORAGE_FORBIDDEN)]
    _fail_with(violations, f"imports of {', '.join(STORAGE_FORBIDDEN)} from vptq_core.storage")


def test_no_import_cycle_in_quant(imports):
    cycles = cycles_report(imports, lambda imp: in_package(imp.source, "vptq_core.quant")
                           and in_package(imp.target, "vptq_core.quant"))
    _fail_with(cycles, "import cycles in vptq_core.quant")


def test_no_import_cycle_in_the_project(imports):
    _fail_with(cycles_report(imports, lambda imp: True), "import cycles in vptq_core + kernels")


# --- the tests mirror the packages ---------------------------------------------------------------------------

# The tests/ subfolder for the tests of each package (the longest matching package wins).
TEST_FOLDERS = {
    "kernels": "kernels",
    "vptq_core.quant": "quant",
    "vptq_core.storage": "storage",
    "vptq_core.studio": "studio",
    "vptq_core": "core",
}
# Test files whose name names no single module, with the folder of what they test.
TEST_HOMES = {
    "test_app.py": "studio",
    "test_browser.py": "studio",
    "test_jobs.py": "studio",
    "test_native_kernels.py": "kernels",
    "test_lean_decoder_fused.py": "quant",
    "test_quantized_linear.py": "storage",
    "test_head_bits.py": "storage",
    "test_vptq_compat.py": "storage",
    "test_codebook_bits_checkpoint.py": "storage",
    "test_eval_bos.py": "core",
    "test_app_chat.py": "studio",
    "test_app_runs.py": "studio",
    "test_app_uploads.py": "studio",
    "test_app_compare.py": "studio",
    "test_browser_compare.py": "studio",
    "test_app_quotas.py": "studio",
    "test_app_restart.py": "studio",
    "test_browser_restart.py": "studio",
    "test_app_divergence.py": "studio",
    "test_browser_divergence.py": "studio",
    "test_app_upload_safety.py": "studio",
}
# Tests that exercise several packages together (a model family or a model source end to end, the embedding from
# quantization to checkpoint, streaming, the project's layout, docs and benchmarks): they live directly in tests/.
CROSS_CUTTING_TESTS = frozenset({
    "test_architecture.py", "test_packaging.py", "test_docs.py", "test_bench.py",
    "test_families.py", "test_gguf.py", "test_embedding.py", "test_streaming.py", "test_device_presets.py",
    "test_presets.py",
})


def _folder_of_module(module: str) -> str:
    package = max((p for p in TEST_FOLDERS if in_package(module, p)), key=len)
    return TEST_FOLDERS[package]


def expected_test_folder(test_file: Path, modules: dict[str, Path]) -> str | None:
    """The tests/ subfolder a test file belongs in: its entry in ``TEST_HOMES``, else that of the module its
    name names (``test_vptq.py`` -> ``vptq_core.quant.vptq`` -> ``quant``), else that of the one package it
    imports; None when that is not one folder (the file must then be in ``CROSS_CUTTING_TESTS``)."""
    if test_file.name in TEST_HOMES:
        return TEST_HOMES[test_file.name]
    stem = test_file.stem.removeprefix("test_")
    named = [m for m in modules if m.rsplit(".", 1)[-1] == stem]
    if len(named) == 1:
        return _folder_of_module(named[0])
    folders = {_folder_of_module(imp.target) for imp in _test_file_imports(test_file, modules)}
    return folders.pop() if len(folders) == 1 else None


def _test_file_imports(test_file: Path, modules: dict[str, Path]) -> list[Import]:
    return [imp for imp in imports_of("tests." + test_file.stem, test_file, modules) if not imp.relative]


def layout_mismatches(root: Path = ROOT) -> list[str]:
    """Test files that are not in the subfolder of the package they test (nor cross-cutting in tests/)."""
    modules = module_files(root)
    mismatches = []
    for test_file in sorted((root / "tests").rglob("test_*.py")):
        where = test_file.parent.relative_to(root / "tests").as_posix()
        shown = test_file.relative_to(root).as_posix()
        if test_file.name in CROSS_CUTTING_TESTS:
            if where != ".":
                mismatches.append(f"{shown}: cross-cutting, belongs directly in tests/")
            continue
        expected = expected_test_folder(test_file, modules)
        if expected is None:
            mismatches.append(f"{shown}: tests several packages; move it to a package folder or add it to "
                              "CROSS_CUTTING_TESTS")
        elif where != expected:
            mismatches.append(f"{shown}: belongs in tests/{expected}/")
    return mismatches


def _tests_are_flat(root: Path = ROOT) -> bool:
    return not any(path.parent != root / "tests" for path in (root / "tests").rglob("test_*.py"))


@pytest.mark.skipif(_tests_are_flat(), reason="tests not yet moved")
def test_tests_mirror_the_packages():
    _fail_with(layout_mismatches(), "test files outside the folder of the package they test")


def test_layout_check_names_the_folder(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "kernels" / "packing.py").write_text("")
    (tmp_path / "vptq_core" / "quant").mkdir(parents=True)
    (tmp_path / "vptq_core" / "__init__.py").write_text("")
    (tmp_path / "vptq_core" / "quant" / "__init__.py").write_text("")
    (tmp_path / "vptq_core" / "quant" / "vptq.py").write_text("")
    (tmp_path / "tests" / "quant").mkdir(parents=True)
    (tmp_path / "tests" / "quant" / "test_vptq.py").write_text("from vptq_core.quant import vptq\n")
    (tmp_path / "tests" / "test_packing.py").write_text("")
    (tmp_path / "tests" / "test_mixed.py").write_text("import kernels\nimport vptq_core.quant.vptq\n")
    (tmp_path / "tests" / "test_ops.py").write_text("from vptq_core.kernels import packing\n")
    assert layout_mismatches(tmp_path) == [
        "tests/test_mixed.py: tests several packages; move it to a package folder or add it to CROSS_CUTTING_TESTS",
        "tests/test_ops.py: belongs in tests/kernels/",
        "tests/test_packing.py: belongs in tests/kernels/",
    ]
