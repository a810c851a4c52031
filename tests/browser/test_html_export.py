"""`make html`'s export read offline in Chromium: every widget cell shows its static figure and
the one line, with every network request refused."""

import pytest

from conftest import NOTEBOOKS, REPO
from course_lib.widgets import RUN_TO_INTERACT
from registry import WIDGETS


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import export_html

    out = tmp_path_factory.mktemp("html")
    export_html.main(["--out", str(out)] + [str(NOTEBOOKS / f"{n}.ipynb") for n in sorted(WIDGETS)])
    return out


@pytest.mark.parametrize("name", sorted(WIDGETS))
def test_exported_html_reads_offline(name, exported, page, artifacts):
    refused = []
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
               else (refused.append(route.request.url), route.abort()))
    page.goto((exported / f"{name}.html").as_uri(), wait_until="load")
    statics = page.locator(".course-static")
    assert statics.count() == len(WIDGETS[name])
    for i in range(statics.count()):
        root = statics.nth(i)
        assert root.locator("img").evaluate("img => img.complete && img.naturalWidth > 0")
        assert RUN_TO_INTERACT in root.inner_text()
        root.scroll_into_view_if_needed()
        root.screenshot(path=artifacts / f"{name}_html_export_w{i}.png")
    assert page.locator("script[type='application/vnd.jupyter.widget-view+json']").count() == 0
    assert all("mathjax" in url or "require.js" in url for url in refused), refused  # nothing else is fetched
