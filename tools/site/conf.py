"""Sphinx configuration of the course's website (`make site`; tools/site/build.py lays out the
sources and runs sphinx-build with this folder as its configuration directory)."""

import os

project = "Distributed Training from First Principles"
# No author line or copyright in the footer: the repository's licence file says who and how.
html_show_copyright = False
author = ""
html_title = project

extensions = ["myst_nb", "sphinx.ext.mathjax"]
exclude_patterns = ["_build", "**.ipynb_checkpoints"]
root_doc = "index"

# The committed notebooks are rendered as they are: their stored outputs, nothing executed.
nb_execution_mode = "off"
# No widget JavaScript from a CDN: the site's notebooks carry no widget state (tools/site/build.py
# keeps each widget's static figure), so nothing would use it.
nb_ipywidgets_js = {}
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3
# A notebook's "## 2. Section" under its "# 00 · Title" is the page's structure; headings that skip a
# level inside <details> answers are not an error worth failing the build for.
suppress_warnings = ["myst.header"]

html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "use_repository_button": False,
    "navigation_with_keys": False,
}
# The theme reads the reader's light/dark choice from localStorage and, on a first visit, logs a
# console error for the empty choice unless a default is set.
html_context = {"default_mode": "auto"}
# build.py lays out _static/ beside the sources (static/ from here, and MathJax); paths in
# html_static_path are relative to this folder, so it names that one by its full path.
html_static_path = [os.path.join(os.environ["COURSE_SITE_SRC"], "_static")]
html_css_files = ["course.css"]
html_show_sourcelink = False
html_use_index = False  # no general index page: the course defines no index entries
# Search lists the pages that match; it does not fetch each page for a snippet, which a browser
# refuses for a site opened from disk (file://) and would log as an error per result.
html_show_search_summary = False
html_last_updated_fmt = None

# MathJax served from the site itself (build.py copies MathJax 3 into _static/mathjax/), so formulas
# render offline. Without the package build.py says so, and the pages load it from its CDN.
if os.environ.get("COURSE_SITE_MATHJAX"):
    mathjax_path = "mathjax/tex-chtml.js"
else:
    mathjax_path = "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"
