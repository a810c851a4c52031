# The two commands of the README:
#   make lab    set up .venv (if needed) and open JupyterLab on notebooks/
#   make test   set up .venv (if needed) and run the whole suite
# Set-up is idempotent: it reinstalls only when pyproject.toml changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.course-installed
# The CPU build of torch; the library itself supports torch >= 2.8 (see pyproject.toml).
TORCH  ?= torch==2.13.0
NBVAL  := --nbval --nbval-sanitize-with tools/nbval_sanitize.cfg --nbval-cell-timeout=300

.PHONY: lab test setup notebooks exercises bench clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# JupyterLab opens on notebooks/; the file browser's root is the repo, so exercises/ is reachable.
# Containers often run as root, which JupyterLab refuses without --allow-root.
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks $(LAB_FLAGS)

# pytest for course_lib, then nbval over every notebook and every graded exercise notebook
# (graded with the reference solutions; tests/test_grading.py proves the stubs fail).
# The notebooks are re-executed on another CPU code path than the one that stored their outputs:
# PyTorch's AVX2 kernels instead of AVX-512 ones, one thread in the kernel process instead of all
# cores. A stored output that depends on the CPU then fails here, not on a learner's machine
# (see CONTRIBUTING.md, "Notebooks"; tests/test_portability.py checks the switch is effective).
PORTABLE := ATEN_CPU_CAPABILITY=avx2 OMP_NUM_THREADS=1
test: $(STAMP)
	$(PORTABLE) COURSE_GRADE_WITH=solutions $(PY) -m pytest -p no:cacheprovider -q tests notebooks exercises $(NBVAL)

# Re-execute every notebook from its source (after editing notebooks/src or exercises/src).
notebooks: $(STAMP)
	$(PY) tools/nb.py build notebooks/src/*.py
	COURSE_GRADE_WITH=solutions $(PY) tools/nb.py build exercises/src/*.py

bench: $(STAMP)
	@$(PY) benchmarks/summary.py --reset
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
	@$(PY) benchmarks/summary.py

clean-venv:
	rm -rf $(VENV)

# The widgets and the exercises' check cells in JupyterLab in headless Chromium (tests/browser/,
# CONTRIBUTING.md "Widgets"). Installs what it needs: Debian's chromium through apt-get when no
# Chromium is on PATH, and playwright into .venv, pointed at that Chromium (no browser download).
# Screenshots of every state: build/browser-artifacts/ (kept by CI).
BROWSER_ARTIFACTS ?= build/browser-artifacts
.PHONY: test-browser html
test-browser: $(STAMP)
	@bash tools/ensure_chromium.sh
	@$(PY) -c "import playwright" 2>/dev/null || $(PY) -m pip install --quiet --disable-pip-version-check "playwright>=1.40,<2"
	@rm -rf $(BROWSER_ARTIFACTS)
	COURSE_BROWSER_TEST=1 COURSE_BROWSER_ARTIFACTS=$(BROWSER_ARTIFACTS) timeout -k 30 1800 \
		$(PY) -m pytest -p no:cacheprovider -q -o timeout=480 tests/browser

# Standalone HTML of every notebook, readable offline (widgets as their static figures): build/html/.
html: $(STAMP)
	$(PY) tools/export_html.py --out build/html
