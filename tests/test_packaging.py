"""How the project is packaged and imported: the wheel installs the kernels as ``vptq_core.kernels`` (never as the
top-level ``kernels``, Hugging Face's import name), a checkout gives the ``kernels/`` folder the same name with one
copy of each module whichever name imports it first, and ``import vptq_core`` stays light but still makes
transformers load our checkpoints."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from vptq_core import _repo_kernels

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")


from test_architecture import ROOT  # noqa: E402 (the checkout's root, found the same way)


def _run_python(*code: str) -> str:
    """Run the ``code`` blocks in a fresh interpreter from the repository root (a checkout, nothing installed)."""
    result = subprocess.run([sys.executable, "-c", "".join(map(textwrap.dedent, code))], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _subpackages(folder: Path, name: str) -> set[str]:
    """``name`` and the dotted names of the folders under ``folder`` that hold Python or C++ files."""
    found = {name}
    for sub in folder.rglob("*"):
        if sub.is_dir() and sub.name != "__pycache__" and (any(sub.glob("*.py")) or any(sub.glob("*.cpp"))):
            found.add(".".join((name, *sub.relative_to(folder).parts)))
    return found


def test_pyproject_installs_every_subpackage_and_no_top_level_kernels():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    expected = _subpackages(ROOT / "vptq_core", "vptq_core") | _subpackages(ROOT / "kernels", "vptq_core.kernels")
    assert sorted(setuptools["packages"]) == sorted(expected)
    assert setuptools["package-dir"] == {"vptq_core.kernels": "kernels"}
    assert set(setuptools["package-data"]["vptq_core.kernels.csrc"]) >= {"*.cpp", "*.h"}


@pytest.fixture
def target_package(tmp_path, monkeypatch):
    """A throwaway package ``arch_target`` (``a`` imported by its __init__, ``b`` not), removed afterwards with
    every name that points at it and every finder added meanwhile."""
    package = tmp_path / "arch_target"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import VALUE\n")
    (package / "a.py").write_text("VALUE = object()\n")
    (package / "b.py").write_text("from .a import VALUE\nSAME = VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    yield "arch_target"
    for name in [n for n in sys.modules if n.split(".")[0] in ("arch_target", "arch_alias")]:
        del sys.modules[name]


def test_alias_gives_the_loaded_and_the_later_modules_of_the_target(target_package):
    target = importlib.import_module(target_package)
    _repo_kernels.alias_modules("arch_alias", target_package)
    alias = importlib.import_module("arch_alias")
    assert alias is target and importlib.import_module("arch_alias.a") is target.a
    later = importlib.import_module("arch_alias.b")  # first import of b, through the alias
    assert later is importlib.import_module(f"{target_package}.b") and later.SAME is target.VALUE
    assert later.__name__ == later.__spec__.name == f"{target_package}.b"  # the module keeps its own name


def test_alias_of_a_subpackage_name_sets_the_parent_attribute(target_package):
    target = importlib.import_module(target_package)
    importlib.import_module(f"{target_package}.a")
    _repo_kernels.alias_modules(f"{target_package}.again", target_package)
    assert target.again is target and importlib.import_module(f"{target_package}.again.b").SAME is target.VALUE
    _repo_kernels.alias_modules(f"{target_package}.again", target_package)  # once is enough
    assert [f.alias for f in sys.meta_path if isinstance(f, _repo_kernels.AliasFinder)].count("arch_target.again") == 1


def test_alias_finder_ignores_other_names(target_package):
    finder = _repo_kernels.AliasFinder("arch_alias", target_package)
    assert finder.find_spec("arch_aliased") is None and finder.find_spec("json") is None
    assert finder.find_spec("arch_alias.x").name == "arch_alias.x"


def test_public_api_is_lazy_but_complete():
    import vptq_core
    from vptq_core.quant import pipeline

    assert vptq_core.quantize_model is pipeline.quantize_model
    assert set(vptq_core.__all__) <= set(dir(vptq_core))
    assert all(getattr(vptq_core, name) is not None for name in vptq_core.__all__)
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        vptq_core.not_a_name  # noqa: B018


# The same check in each import order: every kernels file is one module object, under both names.
_ONE_COPY = """
    import sys
    import kernels, vptq_core.kernels
    assert kernels is vptq_core.kernels and vptq_core.kernels is sys.modules["vptq_core"].kernels
    assert kernels.synthetic is vptq_core.kernels.synthetic and kernels.native is vptq_core.kernels.native
    assert kernels.VQSpec is vptq_core.kernels.VQSpec
    by_file = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "kernels" or name.startswith("vptq_core.kernels"):
            by_file.setdefault(module.__file__, set()).add(id(module))
    assert len(by_file) >= 8 and all(len(ids) == 1 for ids in by_file.values()), by_file
    print(kernels.__name__, kernels.native.__spec__.name)
"""


@pytest.mark.slow
def test_top_level_kernels_first_then_vptq_core_kernels_is_one_copy():
    out = _run_python("""
        import kernels.native
        import vptq_core
        import vptq_core.kernels.synthetic
    """, _ONE_COPY)
    assert out.split() == ["kernels", "kernels.native"]


@pytest.mark.slow
def test_vptq_core_kernels_first_then_top_level_kernels_is_one_copy():
    out = _run_python("""
        import vptq_core.kernels
        import kernels.synthetic
        import vptq_core.kernels.native
    """, _ONE_COPY)
    assert out.split() == ["vptq_core.kernels", "vptq_core.kernels.native"]


@pytest.mark.slow
def test_import_vptq_core_installs_the_transformers_integration_and_nothing_heavy():
    out = _run_python("""
        import sys
        import vptq_core
        from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING
        from vptq_core.storage import hf_integration
        assert hf_integration.installed()
        assert AUTO_QUANTIZER_MAPPING["vptq"] is hf_integration.VptqCoreHfQuantizer
        print(sorted(m for m in ("vptq_core.quant.pipeline", "vptq_core.eval", "vptq_core.studio") if m in sys.modules))
    """)
    assert out.strip() == "[]"


@pytest.mark.slow
def test_wheel_holds_vptq_core_kernels_with_its_sources_and_no_top_level_kernels(tmp_path):
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools in this venv")
    source = tmp_path / "src"  # a copy, so the build leaves no build/ or egg-info in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("vptq_core", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("vptq_core-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "vptq_core/kernels/__init__.py" in names and "vptq_core/kernels/native.py" in names
    csrc = sorted(p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".cpp", ".h"))
    assert sorted(n.rpartition("/")[2] for n in names if n.startswith("vptq_core/kernels/csrc/")) == csrc
    assert not [n for n in names if n.startswith("kernels/")]
    (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["vptq_core"]
