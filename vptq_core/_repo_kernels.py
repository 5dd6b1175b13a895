"""``vptq_core.kernels`` in a repository checkout, and one copy of the kernels whatever name imports them.

An installed wheel holds the kernels as the subpackage ``vptq_core.kernels``: pyproject.toml maps the repository's
top-level ``kernels/`` folder there, so the project never takes the import name ``kernels``, which belongs to
Hugging Face's ``kernels`` distribution (transformers probes it). A checkout run in place (``python app.py``,
``python -m pytest``) has no ``vptq_core/kernels/``; ``register()`` loads the ``kernels/`` folder under that name.

In a checkout the folder is also importable as the top-level ``kernels``. Two names must not mean two copies (the
native extension loaded twice, two sets of caches), so whichever name is imported first owns the modules and the
other one is an alias: ``AliasFinder`` answers imports of the alias with the owner's modules.
This module imports nothing of the project (it runs first in ``vptq_core/__init__``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

INSTALLED_NAME = "vptq_core.kernels"
CHECKOUT_NAME = "kernels"


class AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``alias`` and ``alias.<sub>`` give the module objects ``target`` and ``target.<sub>``."""

    def __init__(self, alias: str, target: str) -> None:
        self.alias = alias
        self.target = target
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}

    def __repr__(self) -> str:
        return f"AliasFinder({self.alias!r} -> {self.target!r})"

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.alias and not fullname.startswith(self.alias + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target + spec.name[len(self.alias):])
        # The import machinery stamps the alias spec on the module it gets back; exec_module puts the module's
        # own spec back, so the module keeps one name whichever name reached it.
        self._own_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._own_specs.pop(module.__name__, module.__spec__)


def alias_modules(alias: str, target: str) -> None:
    """Make ``alias`` and ``alias.<sub>`` the modules ``target`` and ``target.<sub>``: those loaded now at once,
    the others when first imported under either name."""
    for name, module in list(sys.modules.items()):
        if name == target or name.startswith(target + "."):
            sys.modules.setdefault(alias + name[len(target):], module)
    parent, _, child = alias.rpartition(".")
    if parent in sys.modules and alias in sys.modules:
        setattr(sys.modules[parent], child, sys.modules[alias])
    if not any(isinstance(f, AliasFinder) and f.alias == alias for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder(alias, target))


def _is_folder(module: ModuleType | importlib.machinery.ModuleSpec | None, folder: Path) -> bool:
    """True when ``module`` (a module or a spec) is the package in ``folder``."""
    spec = module if isinstance(module, importlib.machinery.ModuleSpec) else getattr(module, "__spec__", None)
    locations = list(getattr(spec, "submodule_search_locations", None) or [])
    return any(Path(location).resolve() == folder.resolve() for location in locations)


def register(package_dir: Path) -> None:
    """Give ``vptq_core.kernels`` to a checkout (``package_dir`` is the ``vptq_core`` folder); nothing when the
    kernels are a real subpackage (an installed wheel) or the checkout has no ``kernels/`` folder."""
    folder = package_dir.parent / CHECKOUT_NAME
    if (package_dir / "kernels" / "__init__.py").is_file() or not (folder / "__init__.py").is_file():
        return
    if INSTALLED_NAME in sys.modules:
        return
    if _is_folder(sys.modules.get(CHECKOUT_NAME), folder):
        alias_modules(INSTALLED_NAME, CHECKOUT_NAME)
        return
    spec = importlib.util.spec_from_file_location(
        INSTALLED_NAME, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[INSTALLED_NAME] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(INSTALLED_NAME, None)
        raise
    sys.modules[INSTALLED_NAME.rpartition(".")[0]].kernels = module
    # The top-level name is aliased only when it would find this very folder (not another `kernels` distribution).
    if CHECKOUT_NAME not in sys.modules and _is_folder(importlib.machinery.PathFinder.find_spec(CHECKOUT_NAME), folder):
        alias_modules(CHECKOUT_NAME, INSTALLED_NAME)
