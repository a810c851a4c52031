"""The Colab set-up (course_lib/colab.py, tools/colab.py): the cell does nothing outside Colab; in a
clean virtual environment standing in for Colab it installs the course from a clone and says what
differs; every notebook that has the link and the cell has the current ones; the tool's edits keep
every stored output and are the cells tools/nb.py builds from the edited source."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

import nbformat
import pytest

from course_lib import colab

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import colab as colab_tool  # noqa: E402  (tools/colab.py)
from nb import percent_to_notebook  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "exercises").glob("*.ipynb"))


# ------------------------------------------------------------------------------ outside Colab

def test_outside_colab_the_cell_does_nothing(monkeypatch, capsys):
    assert "google.colab" not in sys.modules
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: ran.append(a))
    path, cwd = list(sys.path), os.getcwd()
    for folder in ("notebooks", "exercises"):
        exec(compile(colab.setup_cell(folder), "setup-cell", "exec"), {})
    assert ran == [] and sys.path == path and os.getcwd() == cwd
    assert capsys.readouterr() == ("", "")


def test_the_cell_is_short_and_names_its_pins_once():
    cell = colab.setup_cell("notebooks")
    assert len(cell.splitlines()) <= 8
    assert cell.count(colab.REVISION) == 1 and cell.count(colab.REPOSITORY) == 1
    assert colab.is_setup_cell(cell) and not colab.is_setup_cell("import torch\n" + cell)


def test_links_open_the_committed_notebook_at_the_pinned_revision(monkeypatch):
    monkeypatch.setattr(colab, "REPOSITORY", "https://github.com/someone/course.git")
    assert colab.badge("notebooks/02_collectives.ipynb") == (
        f"[**Open in Colab**](https://colab.research.google.com/github/someone/course/blob/{colab.REVISION}"
        "/notebooks/02_collectives.ipynb)")
    monkeypatch.setattr(colab, "REPOSITORY", "https://gitlab.com/someone/course")
    with pytest.raises(ValueError, match="must be https://github.com/OWNER/NAME"):
        colab.badge("notebooks/02_collectives.ipynb")


def test_the_line_says_what_differs():
    line = colab.describe("v1", "0123456789abcdef", "2.9.1+cu126", "2.13.0", 2, 1, [])
    assert line == ("Colab: the course at v1 (0123456); torch 2.9.1+cu126 is Colab's own (the course was tested "
                    "with 2.13.0: a low-precision result may print other digits); 2 CPU cores (the course is tuned "
                    "for 2); 1 GPU present: the notebooks' ranks still run on the CPU (gloo)")
    same = colab.describe("v1", "0123456", "2.13.0+cpu", "2.13.0", 8, 0, ["tqdm>=4.60"])
    assert "torch 2.13.0+cpu, the version the course was tested with" in same
    assert "8 CPU cores" in same and "GPU" not in same and same.endswith("installed: tqdm>=4.60")
    assert "torch is missing" in colab.describe("v1", "0123456", None, "2.13.0", 1, 0, [])


def test_missing_requirements_leave_torch_and_jupyterlab_to_colab():
    have = {"numpy": "2.1.0", "torch": "2.5.0", "tqdm": "4.50.0"}.get
    reqs = ["torch>=2.8", "numpy>=1.24", "tqdm>=4.60", "jupyterlab>=4.0", "cloudpickle>=2.2",
            'tomli>=2.0; python_version < "3.0"', 'pytest>=7.4; extra == "dev"']
    assert colab.missing_requirements(reqs, have) == ["tqdm>=4.60", "cloudpickle>=2.2"]


def test_gpus_are_counted_from_nvidia_smi(monkeypatch):
    monkeypatch.setattr(colab.shutil, "which", lambda name: None)
    assert colab.nvidia_gpus() == 0
    listed = "GPU 0: Tesla T4 (UUID: GPU-1)\nGPU 1: Tesla T4 (UUID: GPU-2)\n"
    monkeypatch.setattr(colab.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(colab.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, listed, ""))
    assert colab.nvidia_gpus() == 2


def test_pinned_torch_is_read_from_the_constraints():
    assert colab.pinned_torch(ROOT) == next(l.split("==")[1] for l in (ROOT / "constraints.txt").read_text().splitlines()
                                            if l.startswith("torch=="))


# ------------------------------------------------------------------------ the committed notebooks

def _cells(path):
    return nbformat.read(path, as_version=4).cells


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_has_the_current_colab_cells(path):
    cells = _cells(path)
    badges = [i for i, c in enumerate(cells) if colab_tool._is_badge(c.cell_type, c.source)]
    setups = [i for i, c in enumerate(cells) if colab_tool._is_setup(c.cell_type, c.source)]
    if not badges and not setups:
        pytest.fail(f"{path.name} has no Colab link and set-up cell: run tools/colab.py --apply")
    folder = path.parent.name
    assert badges == [0] and cells[0].source == colab.badge(f"{folder}/{path.name}")
    first_code = next(i for i, c in enumerate(cells) if c.cell_type == "code")
    assert setups == [first_code] and cells[first_code].source == colab.setup_cell(folder)
    assert cells[first_code].outputs == []  # it printed nothing where the notebook was built


# ------------------------------------------------------------------------------- tools/colab.py

@pytest.fixture
def copy(tmp_path):
    """A notebook folder with one source and its committed notebook (no Colab cells)."""
    src = ROOT / "notebooks" / "src" / "01_memory_and_flops.py"
    text = "".join(chunk for chunk in colab_tool._chunks(src.read_text())[1]
                   if not (colab_tool._is_badge(*colab_tool._chunk_cell(chunk))
                           or colab_tool._is_setup(*colab_tool._chunk_cell(chunk))))
    nb = nbformat.read(ROOT / "notebooks" / "01_memory_and_flops.ipynb", as_version=4)
    nb.cells = [c for c in nb.cells if not (colab_tool._is_badge(c.cell_type, c.source)
                                            or colab_tool._is_setup(c.cell_type, c.source))]
    (tmp_path / "notebooks" / "src").mkdir(parents=True)
    (tmp_path / "notebooks" / "src" / src.name).write_text(text)
    nbformat.write(nb, tmp_path / "notebooks" / "01_memory_and_flops.ipynb")
    return tmp_path / "notebooks" / "src" / src.name, tmp_path / "notebooks" / "01_memory_and_flops.ipynb"


def _key(cells):
    return [(c.cell_type, c.source, sorted(c.get("metadata", {}).get("tags", []))) for c in cells]


def test_apply_inserts_both_keeps_every_output_and_is_idempotent(copy, monkeypatch):
    src, ipynb = copy
    before = nbformat.read(ipynb, as_version=4)
    assert colab_tool.apply(src) == "updated"
    after = nbformat.read(ipynb, as_version=4)
    built = percent_to_notebook(src.read_text())
    assert _key(after.cells) == _key(built.cells) and [c.id for c in after.cells] == [c.id for c in built.cells]
    assert after.cells[0].source == colab.badge("notebooks/01_memory_and_flops.ipynb")
    setup = next(c for c in after.cells if c.cell_type == "code")
    assert setup.source == colab.setup_cell("notebooks") and setup.outputs == [] and setup.execution_count is None
    rest = [c for c in after.cells[1:] if c is not setup]
    assert [(c.source, c.get("outputs"), c.get("execution_count")) for c in rest] == \
           [(c.source, c.get("outputs"), c.get("execution_count")) for c in before.cells]
    assert after.metadata == before.metadata
    text, stored = src.read_text(), ipynb.read_text()
    assert colab_tool.apply(src) == "current" and src.read_text() == text and ipynb.read_text() == stored
    # a new pin replaces the cells, never adds a second pair
    monkeypatch.setattr(colab, "REVISION", "v9.9.9")
    assert colab_tool.apply(src, write=False) == "out of date" and src.read_text() == text
    assert colab_tool.apply(src) == "updated"
    cells = nbformat.read(ipynb, as_version=4).cells
    assert [c.source.count("v9.9.9") for c in cells if "Colab" in c.source] == [1, 1] and len(cells) == len(after.cells)


def test_apply_leaves_a_stale_notebook_alone(copy):
    src, ipynb = copy
    src.write_text(src.read_text().replace("# %%\n", "# %%\nx = 1\n", 1))  # edited, not rebuilt
    stored = ipynb.read_text()
    assert colab_tool.apply(src).startswith("left alone: the .ipynb is not built from its current source")
    assert ipynb.read_text() == stored
    assert colab_tool.main(["--apply", str(src)]) == 1


def test_apply_to_a_new_source_edits_the_source_only(copy):
    src, ipynb = copy
    ipynb.unlink()
    assert colab_tool.apply(src) == "updated (the source; build its notebook)" and not ipynb.exists()
    cells = percent_to_notebook(src.read_text()).cells
    assert cells[0].source == colab.badge("notebooks/01_memory_and_flops.ipynb")
    assert colab_tool.apply(src) == "current"


# ------------------------------------------------------------ the cell in a stand-in for Colab

def _snapshot(dest: pathlib.Path):
    """A git repository holding this checkout's files as they are now (tracked and new), with the
    pinned revision as a tag on its one commit: what the cell clones."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost", "-C", str(dest)]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "snapshot"], check=True)
    subprocess.run(git + ["tag", colab.REVISION], check=True)


def test_the_cell_installs_the_course_in_a_clean_environment(tmp_path):
    """A virtual environment with no course_lib, whose .pth shows it this environment's packages
    (Colab's preinstalled torch, numpy, ...); the cell runs there as Colab would run it (google.colab
    imported), offline: it clones a local snapshot of this checkout and installs it without
    dependencies or build isolation."""
    from importlib import metadata

    start, cpu = time.monotonic(), os.times()
    repo, home, work, venv = (tmp_path / n for n in ("repo", "home", "work", "venv"))
    for d in (repo, work):
        d.mkdir()
    _snapshot(repo)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    pathlib.Path(site, "colab_preinstalled.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "COURSE_EXERCISES_DIR")}
    env.update({colab.REPOSITORY_ENV: str(repo), colab.HOME_ENV: str(home)})
    before = subprocess.run([python, "-c", "import course_lib"], cwd=work, env=env, capture_output=True, text=True)
    assert before.returncode != 0 and "No module named 'course_lib'" in before.stderr  # a clean environment

    def run_cell(folder):
        cell = work / f"cell_{folder}.py"
        cell.write_text(colab.setup_cell(folder))
        code = ("import os, sys, types\n"
                "sys.modules['google.colab'] = types.ModuleType('google.colab')  # what Colab's kernel imports\n"
                f"exec(compile(open({str(cell)!r}).read(), 'setup-cell', 'exec'))\n"
                "print('cwd:', os.getcwd())\n")
        return subprocess.run([python, "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=300)

    # a notebook's, then an exercise's: the course is there already, nothing is cloned or installed again
    runs = [run_cell("notebooks"), run_cell("exercises")]
    for done, folder in zip(runs, ("notebooks", "exercises")):
        assert done.returncode == 0, done.stderr
        line, cwd = done.stdout.splitlines()
        assert line.startswith(f"Colab: the course at {colab.REVISION} (")
        assert f"torch {metadata.version('torch')}" in line and f"{len(os.sched_getaffinity(0))} CPU core" in line
        assert cwd == f"cwd: {home / folder}"
    assert runs[1].stdout.splitlines()[0].endswith(f"write your code in {home}/exercises/<exercise>/student.py "
                                                   "(Colab's Files panel)")
    assert "student.py" not in runs[0].stdout
    after = subprocess.run([python, "-c", "import course_lib.colab, course_lib.platform; print(course_lib.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert after.returncode == 0, after.stderr
    assert after.stdout.strip() == str(home / "course_lib" / "__init__.py")  # the clone, installed
    head = subprocess.run(["git", "-C", str(home), "rev-parse", "HEAD", colab.REVISION + "^{commit}"],
                          capture_output=True, text=True, check=True).stdout.split()
    assert head[0] == head[1] and f"({head[0][:7]})" in runs[0].stdout
    used = os.times()
    print(f"set-up cell in a clean environment: {time.monotonic() - start:.1f} s, "
          f"{used.children_user + used.children_system - cpu.children_user - cpu.children_system:.1f} s of CPU")


# ------------------------------------------------------------------ the website and the browser lane

def _load(name, path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_colab_cells(folder="notebooks", name="02_collectives.ipynb"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(colab.badge(f"{folder}/{name}")),
                nbformat.v4.new_markdown_cell("# 02 · Title"),
                nbformat.v4.new_code_cell(colab.setup_cell(folder)),
                nbformat.v4.new_code_cell("%matplotlib inline\nimport math"),
                nbformat.v4.new_code_cell("x = 1"),
                nbformat.v4.new_code_cell("print(math.pi)")]
    return nb


def test_a_site_page_has_the_colab_link_in_its_box_and_not_the_cells(tmp_path):
    build = _load("site_build_colab", ROOT / "tools" / "site" / "build.py")
    here = "notebooks/02_collectives.ipynb"
    linker = build.Linker({("notebook", "02"): here})
    box = build.run_box("notebook", here, None, None, here, linker)
    assert f"[open `{here}` in Colab]({colab.colab_url(here)})" in box
    assert "Colab" in build.run_box("index", "", None, None, "index.md", linker)
    nbformat.write(_with_colab_cells(), tmp_path / "in.ipynb")
    build.prepare_page("notebook", tmp_path / "in.ipynb", here, None, linker, tmp_path / "out")
    page = nbformat.read(tmp_path / "out" / here, as_version=4)
    sources = [c.source for c in page.cells]
    assert colab.badge(here) not in sources and colab.setup_cell("notebooks") not in sources
    assert sources[0] == "# 02 · Title" and "Run it yourself" in sources[1]  # the box right under the title


def test_the_browser_lane_keeps_the_notebook_set_up_after_the_colab_cell():
    slicer = _load("slice_colab", ROOT / "tests" / "browser" / "slice.py")
    nb = json.loads(nbformat.writes(_with_colab_cells()))
    assert slicer.needed_cells(nb) == [2, 3]  # both set-up cells; the others feed no widget
    del nb["cells"][2]
    assert slicer.needed_cells(nb) == [2]
