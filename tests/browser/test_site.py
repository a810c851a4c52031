"""The course's website (`make site`, tools/site/) read in Chromium with the network off (`make test-site`).

Every page is opened from disk with every request that is not a file refused: it loads without a
console error and fetches nothing from the network, every formula is typeset by the MathJax the
site ships (no raw `$...$` left in the text, no TeX error), every figure stored in the notebook
is on the page and loaded, no widget shows a repr, every link inside the site resolves (file and
anchor), and the page has its "Run it yourself" box. The index lists the pages in the map's order;
search finds "ring all-reduce" (and nothing for a word the course never uses).

The site is the one `make site` built (COURSE_SITE, default build/site/): the test reads it, it
does not build it.
"""

import functools
import importlib.util
import os
import pathlib
import re
import urllib.parse

import nbformat
import pytest

from conftest import REPO
from course_lib.widgets import RUN_TO_INTERACT

SITE = pathlib.Path(os.environ.get("COURSE_SITE", REPO / "build" / "site")).resolve()
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _build_module():
    spec = importlib.util.spec_from_file_location("site_build", REPO / "tools" / "site" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILD = _build_module()
ORDER = [(kind, p.relative_to(REPO).as_posix()) for kind, p in BUILD.map_order(REPO / "notebooks", REPO / "exercises")]
PAGES = ["index.html"] + [here[:-len(".ipynb")] + ".html" for _, here in ORDER]
SOURCE = {here[:-len(".ipynb")] + ".html": (kind, here) for kind, here in ORDER}

# What a widget looks like when it is shown as its repr instead of a view or a figure.
WIDGET_REPR = re.compile(r"\b(HBox|VBox|Box|Tab|Accordion|Output|IntProgress|FloatProgress|IntSlider|FloatSlider|"
                         r"SelectionSlider|Dropdown|Text|Button|Label|HTML|Image|interactive)\("
                         r"(children|value|layout|description|outputs|options)=")
# TeX left as text: $...$ (no space inside the delimiters, as MyST's dollarmath reads it), $$, \( or \[.
RAW_MATH = re.compile(r"\$\$|\$[^$\s](?:[^$\n]*[^$\s])?\$|\\\(|\\\[")

# The page's text without code, outputs printed as text, scripts and typeset math.
TEXT_JS = """() => {
    const main = document.querySelector('main') || document.body;
    const copy = main.cloneNode(true);
    copy.querySelectorAll('pre, code, script, style, mjx-container, .highlight').forEach(e => e.remove());
    return copy.textContent;
}"""


@pytest.fixture(scope="module")
def site():
    if not (SITE / "index.html").is_file():
        pytest.fail(f"no site at {SITE}: run `make site` first (make test-site does)")
    return SITE


def offline(page) -> list[str]:
    """Refuse every request that is not a file of the site; return the list of refused URLs."""
    refused = []
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
               else (refused.append(route.request.url), route.abort()))
    return refused


def open_page(page, url: str) -> None:
    page.goto(url, wait_until="load")
    # MathJax typesets after load; its startup promise settles when the page's math is done.
    page.evaluate("() => window.MathJax && MathJax.startup && MathJax.startup.promise")


@functools.lru_cache(maxsize=None)
def ids_in(path: pathlib.Path) -> frozenset:
    return frozenset(re.findall(r'\bid="([^"]+)"', path.read_text(encoding="utf-8")))


def stored_outputs(here: str):
    nb = nbformat.read(REPO / here, as_version=4)
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def test_the_site_has_every_page_and_nothing_else(site):
    built = {p.relative_to(site).as_posix() for p in site.rglob("*.html")}
    built = {p for p in built if not p.startswith("_")}  # _static/ holds the theme's template pieces
    assert built == set(PAGES) | {"search.html"}


@pytest.mark.parametrize("name", PAGES)
def test_page_reads_offline(name, site, page, artifacts):
    refused = offline(page)
    open_page(page, (site / name).as_uri())

    assert page.console_errors == []
    assert refused == []  # nothing asked of the network: MathJax, fonts and scripts are the site's own

    # Every formula typeset by MathJax, none left as TeX, none a TeX error.
    math = page.locator("main .math")
    typeset = page.locator("main .math mjx-container")
    assert typeset.count() == math.count()
    assert page.locator("mjx-merror").count() == 0
    text = page.evaluate(TEXT_JS)
    assert not RAW_MATH.findall(text), RAW_MATH.findall(text)[:5]

    # The "Run it yourself" box, once, with the three ways.
    box = page.locator(".admonition.course-run")
    assert box.count() == 1
    box_text = box.inner_text()
    assert "make lab" in box_text and ".devcontainer/" in box_text and "Colab" in box_text

    # Every link inside the site resolves: the file exists and so does the anchor.
    for href in page.eval_on_selector_all("a[href]", "links => links.map(a => a.href)"):
        url = urllib.parse.urlsplit(href)
        if url.scheme != "file":
            continue
        target = pathlib.Path(urllib.parse.unquote(url.path))
        assert target.is_file(), f"{name}: link to {href}, no such file"
        if url.fragment and target.suffix == ".html":
            assert urllib.parse.unquote(url.fragment) in ids_in(target), f"{name}: link to {href}, no such anchor"

    if name in SOURCE:
        kind, here = SOURCE[name]
        outputs = stored_outputs(here)
        # Every stored figure is on the page and loaded: one image per output that stored a PNG
        # (a widget's static form is its PNG in the HTML beside the view).
        figures = page.locator("main .cell_output img")
        assert figures.count() == sum("image/png" in o.get("data", {}) for o in outputs)
        for i in range(figures.count()):
            assert figures.nth(i).evaluate("img => img.complete && img.naturalWidth > 0"), f"{name}: figure {i}"
        # Widgets: the static form with its line, never the repr (a widget's text/plain) or a view.
        widgets = [o for o in outputs if WIDGET_VIEW in o.get("data", {})]
        static = [o for o in widgets if "image/png" in o["data"]]
        assert page.locator(".course-static").count() == len(static)
        assert text.count(RUN_TO_INTERACT) == len(static)
        page_text = page.locator("main").inner_text()
        for o in widgets:
            assert o["data"]["text/plain"] not in page_text
        assert not WIDGET_REPR.search(page_text)
        assert page.locator(f"script[type='{WIDGET_VIEW}']").count() == 0
        # A notebook ends with its references, in the page's contents.
        if kind == "notebook":
            assert page.locator("main section#references li").count() > 0
            assert page.locator(".bd-sidebar-secondary a[href='#references']").count() == 1

    if name in ("index.html", "notebooks/02_collectives.html"):
        page.screenshot(path=artifacts / f"site_{name.replace('/', '_')}.png", full_page=False)


def test_the_index_lists_every_page_in_map_order(site, page):
    offline(page)
    open_page(page, (site / "index.html").as_uri())
    hrefs = page.eval_on_selector_all("main .toctree-wrapper a.reference.internal",
                                      "links => links.map(a => a.getAttribute('href'))")
    assert hrefs == PAGES[1:]


def test_notebooks_and_exercises_link_to_each_other(site, page):
    offline(page)
    open_page(page, (site / "notebooks/02_collectives.html").as_uri())
    # the box links the notebook to its exercise; the prose's "notebook 03" links to notebook 03
    assert page.locator(".course-run a[href='../exercises/ex02_ring_all_reduce.html']").count() == 1
    prose = page.locator("main a[href='03_data_parallel.html']")
    assert prose.count() >= 1 and prose.first.inner_text() == "03"
    open_page(page, (site / "exercises/ex02_ring_all_reduce.html").as_uri())
    assert page.locator(".course-run a[href='../notebooks/02_collectives.html']").count() == 1
    assert page.locator("main a[href='../notebooks/02_collectives.html']").count() >= 2  # the box and the prose


@pytest.mark.parametrize("query, found", [("ring all-reduce", True), ("xylophone", False)])
def test_search(query, found, site, page):
    refused = offline(page)
    page.goto((site / "search.html").as_uri() + "?q=" + urllib.parse.quote(query), wait_until="load")
    page.wait_for_function("() => document.querySelector('#search-results .search-summary')", timeout=30_000)
    hits = page.eval_on_selector_all("#search-results ul.search li a", "links => links.map(a => a.href)")
    assert page.console_errors == [] and refused == []
    if found:
        assert any(h.endswith("notebooks/02_collectives.html") for h in hits), hits
    else:
        assert hits == []
