# The two commands of the README:
#   make lab    set up .venv (if needed) and open JupyterLab on notebooks/
#   make test   set up .venv (if needed) and run the whole suite
# Set-up is idempotent: it reinstalls only when pyproject.toml changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.course-installed
# torch's version: the one place it is pinned (tools/lock.py copies it into constraints.txt); the
# library itself supports torch >= 2.8 (see pyproject.toml). Which build (tools/install_torch.py):
# TORCH=auto, the CPU build from PyTorch's CPU index without an NVIDIA GPU and the CUDA build with
# one; TORCH=cpu or TORCH=cuda forces it. The CUDA build's own wheels are pinned in constraints-cuda.txt.
TORCH_VERSION ?= 2.13.0
TORCH  ?= auto
NBVAL  := --nbval --nbval-sanitize-with tools/nbval_sanitize.cfg --nbval-cell-timeout=300
# The versions the suite last passed with (tools/lock.py writes it). Every install goes through it,
# so a fresh clone next year installs what was tested, not whatever was released since.
# `make test-latest` empties it to try the newest releases.
CONSTRAINTS ?= constraints.txt
# --no-compile: pip would byte-compile every installed file (all of torch, jax and scipy: 63 s of a
# fresh set-up here); Python compiles what is imported, once, on first import, and reuses the
# bytecode after. Unless PYTHONDONTWRITEBYTECODE is set, as it is on the machine CI ran on: then every
# process compiles torch's modules again on import (5.4 s of CPU instead of 2.6 s here), and the
# suite starts hundreds of them (ranks, kernels, torchrun). Nothing make runs inherits it.
unexport PYTHONDONTWRITEBYTECODE
PIP     = $(PY) -m pip install --quiet --disable-pip-version-check --no-compile $(if $(CONSTRAINTS),-c $(CONSTRAINTS),--upgrade --upgrade-strategy eager)

.PHONY: portable-paths python-path browser-deps lab test test-under-load setup notebooks exercises bench bench-quick clean-venv test-portability test-latest lock

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) tools/install_torch.py --torch $(TORCH) --version $(TORCH_VERSION) $(if $(CONSTRAINTS),--cuda-constraints constraints-cuda.txt,) -- $(PIP)
	$(PIP) -e ".[dev]"
	@touch $(STAMP)

setup: $(STAMP)

# JupyterLab opens on notebooks/; the file browser's root is the repo, so exercises/ is reachable.
# Containers often run as root, which JupyterLab refuses without --allow-root.
LAB_FLAGS ?= $(if $(filter 0,$(shell id -u)),--allow-root,)
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks $(LAB_FLAGS)

# The tests start many processes on few cores at once (ranks, kernels, servers).
# OpenMP's idle threads spin by default, burning the cores the other processes wait for: on the
# 2-core CI machine, notebook 00's 200-step training cell took 85 s beside the tests instead of
# 7 s alone. PASSIVE lets idle threads sleep; no result changes (the same threads split the same
# work in the same chunks). A learner's own kernel (make lab) keeps OpenMP's default.
test test-under-load test-portability test-browser: export OMP_WAIT_POLICY = PASSIVE

# The portable paths, and this machine's own as CAPABILITY:THREADS, for .ci/run.
portable-paths:
	@echo $(PORTABLE_PATHS)
python-path:
	@$(PY) -c "import torch; print(f'{torch.backends.cpu.get_cpu_capability().lower()}:{torch.get_num_threads()}')"

# pytest for course_lib, and nbval over every notebook and every graded exercise notebook
# (graded with the reference solutions; tests/test_grading.py proves the stubs fail), on this
# machine's own CPU path, as a learner's kernel runs them. The sessions run one after the other
# (side by side on 2 cores, before OMP_WAIT_POLICY=PASSIVE above, they took 1667 s against
# 680 s + 567 s), and within each session PYTEST_WORKERS test files (notebooks) run at a time
# (pytest-xdist, --dist loadfile: a file's module fixtures and rank pools stay in one worker).
# Why 2 on a 2-core machine: one file alone keeps the cores busy about 57% of its time (ranks
# wait in rendezvous, stores, timeouts and process start); measured here at 3169716, nbval of every
# notebook and exercise 308 s with 2 workers against 561 s with one (CI at c19200a), six of the
# slowest test files 152 s against 210 s. Results do not depend on it: each rank pool still
# splits its own share of the cores. PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)
# NOTEBOOK_PATH=CAPABILITY:THREADS runs the notebooks on that CPU path instead, NOTEBOOK_DIRS
# picks the folders (CI: one portable path; .ci/run).
NOTEBOOK_PATH ?=
NOTEBOOK_DIRS ?= notebooks exercises
NOTEBOOK_PATH_ENV = $(if $(NOTEBOOK_PATH),ATEN_CPU_CAPABILITY=$(firstword $(subst :, ,$(NOTEBOOK_PATH))) OMP_NUM_THREADS=$(lastword $(subst :, ,$(NOTEBOOK_PATH))),)
test: $(STAMP)
	@echo "== pytest tests under NCCL's rules (COURSE_NCCL_RULES=1; gloo_only tests deselected, conftest.py)"; \
	COURSE_NCCL_RULES=1 OMP_WAIT_POLICY=PASSIVE COURSE_GRADE_WITH=solutions $(PY) -m pytest -p no:cacheprovider -q $(XDIST) --durations=15 tests; status=$$?; \
	echo "== pytest tests marked gloo_only, without NCCL's rules"; \
	COURSE_GRADE_WITH=solutions $(PY) -m pytest -p no:cacheprovider -q $(XDIST) --durations=5 -m gloo_only tests || status=1; \
	echo "== nbval $(NOTEBOOK_DIRS)$(if $(NOTEBOOK_PATH), on CPU path $(NOTEBOOK_PATH),)"; \
	$(NOTEBOOK_PATH_ENV) COURSE_GRADE_WITH=solutions $(PY) -m pytest -p no:cacheprovider -q $(XDIST) --durations=10 \
		$(NOTEBOOK_DIRS) $(NBVAL) || status=1; \
	exit $$status

# The library's tests beside LOAD_PROCS CPU-bound processes for the whole run
# (tools/under_load.py): a learner's laptop is rarely idle, and neither is a CI machine. A test
# that fails here and not alone waits on a time or races another process: fix that cause
# (CONTRIBUTING.md, "Flakes are bugs"), never a longer timeout or a retry.
LOAD_PROCS ?= 2
test-under-load: $(STAMP)
	@echo "== pytest tests beside $(LOAD_PROCS) CPU-bound processes"
	@COURSE_GRADE_WITH=solutions $(PY) tools/under_load.py --procs $(LOAD_PROCS) -- \
		$(PY) -m pytest -p no:cacheprovider -q --durations=15 tests

# NCCL's rules on the gloo ranks (observe/nccl_rules.py and device_rule.py, CONTRIBUTING.md "NCCL's
# rules on CPU ranks"): `make test` runs the library's tests with COURSE_NCCL_RULES=1, which every rank
# pool and torchrun demo of the session inherits, then the tests marked gloo_only (conftest.py) without
# it. test-nccl-rules is the quick subset: the rules' own tests and the point-to-point code.
NCCL_RULES_TESTS ?= tests/test_nccl_rules.py tests/test_nccl_rules_marker.py tests/test_device_rule.py \
	tests/test_comm.py tests/test_pipeline.py tests/test_pp_v_schedules.py tests/test_async_tp.py
.PHONY: test-nccl-rules gpu-check
test-nccl-rules: $(STAMP)
	@echo "== pytest under NCCL's rules: $(NCCL_RULES_TESTS)"
	@COURSE_NCCL_RULES=1 OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -p no:cacheprovider -q --durations=10 $(NCCL_RULES_TESTS)

# A learner's copy: the tracked files without exercises/solutions/ and exercises/hidden/ (tools/release.py)
.PHONY: release
release:
	@test -n "$(DEST)" || { echo "usage: make release DEST=dir"; exit 1; }
	$(PY) tools/release.py $(DEST)

# Each notebook's peak memory, kernel and every rank together (PSS), and the machines it fits
# (tools/notebook_memory.py): writes tools/notebook_memory.json and prints README's table.
# About 25 min on 2 busy cores, nice'd: memory does not depend on load, time does.
.PHONY: notebook-memory
notebook-memory: $(STAMP)
	nice -n 10 $(PY) tools/notebook_memory.py server
	nice -n 10 $(PY) tools/notebook_memory.py measure notebooks/*.ipynb
	$(PY) tools/notebook_memory.py table

# On a machine with CUDA GPUs: every torchrun demo at the largest world size it allows, with its
# check, then benchmarks/gpu_check.py; one JSON report (build/gpu-check.json) within 8 minutes.
# Refuses without a GPU (tools/gpu_check.py).
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py --out build/gpu-check.json

# nbval again over every notebook and exercise on the CPU paths a learner may have that differ
# most from the one that stored the outputs (AVX-512, all cores): PyTorch's scalar kernels
# (ATEN_CPU_CAPABILITY=default) on one thread, and its AVX2 kernels on two. A stored output that
# depends on the CPU fails here, not on a learner's machine (CONTRIBUTING.md, "Notebooks";
# tests/test_portability.py checks that the paths cover both kernels and both thread counts and
# that they change low-precision results here). Each entry is CAPABILITY:THREADS. The paths run
# one after the other, for the reason `make test`'s sessions do (each with PYTEST_WORKERS notebooks at a time).
PORTABLE_PATHS ?= default:1 avx2:2
PORTABLE_DIRS ?= notebooks exercises
test-portability: $(STAMP)
	@status=0; for p in $(PORTABLE_PATHS); do \
		echo "== nbval with ATEN_CPU_CAPABILITY=$${p%:*} OMP_NUM_THREADS=$${p#*:}"; \
		ATEN_CPU_CAPABILITY=$${p%:*} OMP_NUM_THREADS=$${p#*:} COURSE_GRADE_WITH=solutions \
			$(PY) -m pytest -p no:cacheprovider -q $(XDIST) $(PORTABLE_DIRS) $(NBVAL) || status=1; \
	done; exit $$status

# For maintainers: the whole suite against the newest releases of every dependency (torch stays
# at TORCH_VERSION: a newer one is a separate decision), in its own .venv-latest. When it is green,
# `make lock` takes those versions into constraints.txt; when it is red, its failures say what
# a bump would break.
test-latest:
	@rm -f .venv-latest/.course-installed
	$(MAKE) test test-portability VENV=.venv-latest CONSTRAINTS=

# Re-resolve constraints.txt for every Python 3.10-3.13 found here (tools/lock.py).
lock: $(STAMP)
	$(PY) tools/lock.py

# Re-execute every notebook from its source (after editing notebooks/src or exercises/src).
notebooks: $(STAMP)
	$(PY) tools/nb.py build notebooks/src/*.py
	COURSE_GRADE_WITH=solutions $(PY) tools/nb.py build exercises/src/*.py

bench: $(STAMP)
	@$(PY) benchmarks/summary.py --reset
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done
	@$(PY) benchmarks/summary.py

# Every benchmark at its smallest size (seconds each, no targets, nothing recorded): run it before
# a change to a benchmark or the APIs it calls lands (CI only imports each one, for time:
# tests/test_benchmarks_import.py).
bench-quick: $(STAMP)
	@for b in benchmarks/bench_*.py; do echo "== $$b --quick"; $(PY) $$b --quick || exit 1; done

clean-venv:
	rm -rf $(VENV)

# What test-browser needs beyond .venv: Chromium, and playwright installed into .venv (CI runs
# this first, so that nothing is installed into .venv while other targets run from it).
browser-deps: $(STAMP)
	@bash tools/ensure_chromium.sh
	@$(PY) -c "import playwright" 2>/dev/null || $(PIP) -e ".[dev,browser]"

# The widgets and the exercises' check cells in JupyterLab in headless Chromium (tests/browser/,
# CONTRIBUTING.md "Widgets"). browser-deps installs what it needs: Debian's chromium through apt-get when no
# Chromium is on PATH, and playwright into .venv, pointed at that Chromium (no browser download).
# Screenshots of every state: build/browser-artifacts/ (kept by CI).
BROWSER_ARTIFACTS ?= build/browser-artifacts
.PHONY: test-browser html
test-browser: browser-deps
	@rm -rf $(BROWSER_ARTIFACTS)
	COURSE_BROWSER_TEST=1 COURSE_BROWSER_ARTIFACTS=$(BROWSER_ARTIFACTS) timeout -k 30 1800 \
		$(PY) -m pytest -p no:cacheprovider -q --durations=12 -o timeout=480 tests/browser \
		--ignore=tests/browser/test_site.py

# The course as a website (tools/site/): every notebook and exercise a page in the map's order, from
# the committed notebooks (nothing executed), with their figures, a table of contents, search and
# MathJax shipped in the site, so it reads offline: open build/site/index.html. site-deps installs
# Sphinx, myst-nb, the theme and MathJax (the `site` extra) into .venv when they are missing.
# `make html` is the same thing (it used to export each notebook to standalone HTML).
SITE ?= build/site
.PHONY: site-deps site test-site
site-deps: $(STAMP)
	@$(PY) -c "import sphinx, myst_nb, sphinx_book_theme, mathjax" 2>/dev/null || $(PIP) -e ".[dev,site]"
site html: site-deps
	$(PY) tools/site/build.py --out $(SITE)

# The built site in headless Chromium with every network request refused (tests/browser/test_site.py):
# each page loads without console errors, its formulas typeset by the shipped MathJax, its stored
# figures there, no widget repr, every internal link resolving; search finds "ring all-reduce".
test-site: site browser-deps
	COURSE_BROWSER_TEST=1 COURSE_SITE=$(SITE) COURSE_BROWSER_ARTIFACTS=$(BROWSER_ARTIFACTS) timeout -k 30 600 \
		$(PY) -m pytest -p no:cacheprovider -q --durations=5 -o timeout=120 tests/browser/test_site.py
