"""Fixtures of the browser test (`make test-browser`): one JupyterLab and one Chromium per session.

The test needs Chromium and playwright, so a plain `pytest tests` (make test) does not collect
it: `make test-browser` sets COURSE_BROWSER_TEST=1. Screenshots go to COURSE_BROWSER_ARTIFACTS
(default build/browser-artifacts/), which CI keeps. COURSE_BROWSER_SLICE=1 (CI) runs only the code
cells each widget needs (slice.py): `make test` has just run every notebook whole.
"""

import os
import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent.parent
# The notebooks under test (default: the repository's; another folder checks a variant, e.g. a broken one).
NOTEBOOKS = pathlib.Path(os.environ.get("COURSE_BROWSER_NOTEBOOKS", REPO / "notebooks")).resolve()
if not os.environ.get("COURSE_BROWSER_TEST"):
    collect_ignore_glob = ["test_*.py"]
sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def artifacts() -> pathlib.Path:
    path = pathlib.Path(os.environ.get("COURSE_BROWSER_ARTIFACTS", REPO / "build" / "browser-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    import lab as L

    L.install_signal_handlers()
    L.find_chromium()  # a clear message before anything starts
    notebooks = NOTEBOOKS
    if os.environ.get("COURSE_BROWSER_SLICE"):  # CI: the widgets' cells only (slice.py says why)
        import slice as S
        from registry import WIDGETS

        notebooks = tmp_path_factory.mktemp("sliced") / "notebooks"
        for name, (kept, total) in S.slice_folder(NOTEBOOKS, notebooks, WIDGETS).items():
            print(f"{name}: {kept} of {total} code cells run (the widgets' own and what they read)")
    try:
        with L.Lab(REPO, notebooks=notebooks) as server:
            yield server
    finally:
        L.stop_all()


@pytest.fixture(scope="session")
def browser():
    import lab as L

    with L.Browser() as b:
        yield b


@pytest.fixture
def page(browser):
    """A fresh tab that records console errors and uncaught page errors."""
    p = browser.new_page()
    p.console_errors = []
    p.on("console", lambda m: p.console_errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    p.on("pageerror", lambda e: p.console_errors.append(f"pageerror: {e}"))
    yield p
    p.close()


@pytest.fixture
def lab_page(lab, page):
    """A tab on JupyterLab; afterwards its kernels are shut down (their rank processes with them),
    so that notebooks tested later do not share the cores with idle kernels."""
    yield page
    lab.shutdown_kernels()
