"""The website's source rules (tools/site/build.py), without Sphinx or a browser: the map's order,
which mentions become links, and which widget outputs keep their static form. `make test-site`
checks the built site itself in Chromium (tests/browser/test_site.py)."""

import importlib.util
import pathlib

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("site_build", ROOT / "tools" / "site" / "build.py")
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)

PAGES = {("notebook", "02"): "notebooks/02_collectives.ipynb", ("notebook", "03"): "notebooks/03_data_parallel.ipynb",
         ("exercise", "02"): "exercises/ex02_ring_all_reduce.ipynb"}
LINKER = build.Linker(PAGES)


def test_map_order_puts_each_exercise_after_its_notebook_and_the_appendix_last():
    order = [(kind, p.name) for kind, p in build.map_order(ROOT / "notebooks", ROOT / "exercises")]
    names = [n for _, n in order]
    assert names.index("ex02_ring_all_reduce.ipynb") == names.index("02_collectives.ipynb") + 1
    assert names.index("03_data_parallel.ipynb") == names.index("ex02_ring_all_reduce.ipynb") + 1
    assert order[-1] == ("notebook", "A1_sharding_as_a_type.ipynb")
    assert sum(kind == "exercise" for kind, _ in order) == len(list((ROOT / "exercises").glob("ex[0-9][0-9]_*.ipynb")))


def test_map_order_refuses_an_exercise_without_its_notebook(tmp_path):
    (tmp_path / "nb").mkdir(), (tmp_path / "ex").mkdir()
    (tmp_path / "nb" / "00_a.ipynb").write_text("{}")
    (tmp_path / "ex" / "ex01_b.ipynb").write_text("{}")
    with pytest.raises(ValueError, match=r"\['01'\] have no notebook"):
        build.map_order(tmp_path / "nb", tmp_path / "ex")


@pytest.mark.parametrize("source, expected", [
    ("as in notebook 02, then", "as in notebook [02](02_collectives.ipynb), then"),
    ("notebooks 02 and 03", "notebooks [02](02_collectives.ipynb) and [03](03_data_parallel.ipynb)"),
    ("Next: exercise 02", "Next: exercise [02](../exercises/ex02_ring_all_reduce.ipynb)"),
    ("(`exercises/ex02_ring_all_reduce.ipynb`)",
     "([`exercises/ex02_ring_all_reduce.ipynb`](../exercises/ex02_ring_all_reduce.ipynb))"),
    ("notebook 07", "notebook 07"),                          # no such page: left as text
    ("`notebook 02`", "`notebook 02`"),                      # code
    ("$notebook 02$", "$notebook 02$"),                      # math
    ("## 3. Back to notebook 02", "## 3. Back to notebook 02"),  # a heading
    ("[notebook 02](elsewhere.ipynb)", "[notebook 02](elsewhere.ipynb)"),  # a link already
    ("```\nnotebook 02\n```", "```\nnotebook 02\n```"),      # a code block
])
def test_mentions_become_relative_links_outside_code_math_headings_and_links(source, expected):
    assert LINKER.rewrite("notebooks/05_x.ipynb", source) == expected


def test_widget_outputs_keep_their_static_form_and_a_bare_widget_is_left_out():
    view = {"application/vnd.jupyter.widget-view+json": {"model_id": "m", "version_major": 2, "version_minor": 0}}
    static = nbformat.v4.new_output("display_data", data={**view, "image/png": "iVBOR", "text/html": "<img>",
                                                          "text/plain": "HBox(children=...)"})
    bare = nbformat.v4.new_output("display_data", data={**view, "text/plain": "train:   0%|"})
    text = nbformat.v4.new_output("stream", name="stdout", text="done\n")
    cell = nbformat.v4.new_code_cell(outputs=[static, bare, text])
    assert build.static_outputs(cell) == (1, 1)
    assert [o.output_type for o in cell.outputs] == ["display_data", "stream"]
    assert sorted(cell.outputs[0].data) == ["image/png", "text/html", "text/plain"]


def test_every_page_gets_the_run_box_linking_its_partner():
    box = build.run_box("notebook", "notebooks/02_collectives.ipynb", "exercises/ex02_ring_all_reduce.ipynb",
                        "Exercise 02", "notebooks/02_collectives.ipynb", LINKER)
    assert box.startswith("```{admonition} Run it yourself") and box.endswith("```")
    for needed in ("make lab", ".devcontainer/", "Colab", "[Exercise 02](../exercises/ex02_ring_all_reduce.ipynb)"):
        assert needed in box
