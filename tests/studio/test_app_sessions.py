"""Which browser a page session acts for (``services.Identities``), and the page being built (``ui_page.Page``),
without a server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

gr = pytest.importorskip("gradio")
from vptq_core.studio.services import Identities  # noqa: E402
from vptq_core.studio.ui_page import Page  # noqa: E402


def test_a_page_acts_for_its_browser_until_it_is_forgotten():
    identities = Identities()
    page = SimpleNamespace(session_hash="page-1")
    assert identities.owner(page) == "page-1"  # an API session owns its runs by its session id
    identities.bind("page-1", "identity-A")
    assert identities.owner(page) == "identity-A" and sorted(identities.hidden()) == ["identity-A", "page-1"]
    assert identities.unload("page-2") is None  # never attached
    assert identities.unload("page-1") == "identity-A"
    assert identities.owner(page) == "identity-A"  # the page may still be there after an unload
    assert identities.forget_pages(3600) == 0 and identities.forget_pages(0) == 1
    assert identities.owner(page) == "page-1" and identities.hidden() == []
    identities.bind("page-1", "identity-A")  # attaching again: no longer unloaded
    identities.unload("page-1")
    identities.bind("page-1", "identity-A")
    assert identities.forget_pages(0) == 0
    for request in (None, SimpleNamespace(session_hash="")):
        with pytest.raises(gr.Error, match="this action needs a browser session"):
            identities.owner(request)


def test_a_page_names_each_component_once():
    page = Page(settings=None, studio=None, small=True)
    page.update(model="dropdown", method="radio")
    assert (page.model, page.method, page.small) == ("dropdown", "radio", True)
    with pytest.raises(ValueError, match=r"the page already has a component named 'model'"):
        page.update(model="another dropdown")
