"""The page being built (``Page``): what every layout and wiring function of the app's UI shares."""

from __future__ import annotations

from types import SimpleNamespace


class Page(SimpleNamespace):
    """The app's settings (``settings``), its handlers (``studio``), whether the tiny test model is the default
    (``small``), the Blocks (``demo``), then every component by name: the layout functions add theirs
    (``update``), the wiring functions read them."""

    def update(self, **components) -> None:
        for name, component in components.items():
            if hasattr(self, name):
                raise ValueError(f"the page already has a component named {name!r}")
            setattr(self, name, component)
