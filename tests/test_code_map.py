"""The code map of record is README.md's "Layout" block: every module and package of course_lib
(and every sub-package of course_lib/parallel) is named there, and every course_lib path it names
exists. CONTRIBUTING.md and the package docstring point to it instead of keeping maps of their own."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIB = ROOT / "course_lib"


def layout_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].splitlines()


def entries(lines, indent: int) -> list[str]:
    """The names an indented block lists at exactly `indent` spaces: 'runtime/' or 'data.py'."""
    return [m.group(1) for line in lines if (m := re.match(rf"^ {{{indent}}}([A-Za-z_0-9]+(?:/|\.py))\s", line))]


def sub_block(lines, name: str, indent: int) -> list[str]:
    """The lines under `name` (at `indent`) up to the next entry at that indent or less."""
    start = next(i for i, line in enumerate(lines) if re.match(rf"^ {{{indent}}}{re.escape(name)}\s", line))
    out = []
    for line in lines[start + 1:]:
        if re.match(rf"^ {{0,{indent}}}\S", line):
            break
        out.append(line)
    return out


def children(package: pathlib.Path) -> set[str]:
    names = set()
    for p in package.iterdir():
        if p.name.startswith("__") or p.name.startswith("."):
            continue
        if p.is_dir() and (p / "__init__.py").exists():
            names.add(p.name + "/")
        elif p.suffix == ".py":
            names.add(p.name)
    return names


def test_every_module_and_package_of_course_lib_is_on_the_map():
    listed = set(entries(layout_block(), 2))
    # a line may name several small modules after its first: 'units.py ...;  _validate.py: ...'
    text = "\n".join(layout_block())
    missing = sorted(n for n in children(LIB) if n not in listed and not re.search(rf"\b{re.escape(n)}", text))
    assert not missing, f"README.md's Layout does not name {missing}"
    assert not sorted(listed - children(LIB)), f"README.md's Layout names what does not exist: {sorted(listed - children(LIB))}"


def test_every_parallel_axis_is_on_the_map():
    block = sub_block(layout_block(), "parallel/", 2)
    listed = set(entries(block, 4))
    packages = {n for n in children(LIB / "parallel") if n.endswith("/")}
    assert packages - listed == set(), f"README.md's Layout under parallel/ does not name {sorted(packages - listed)}"
    assert listed - children(LIB / "parallel") == set(), sorted(listed - children(LIB / "parallel"))


def test_the_other_maps_point_to_the_one_of_record():
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    layout = contributing.split("\n## The layout\n", 1)[1].split("\n## ", 1)[0]
    assert "README.md" in layout and "```" not in layout, "CONTRIBUTING's layout section keeps a map of its own"
    import course_lib

    assert "README.md" in course_lib.__doc__ and "runtime/" not in course_lib.__doc__


def test_every_module_of_observe_and_runtime_is_on_the_map():
    """The layers and the runtime's parts are what a contributor looks for first."""
    for package in ("observe/", "runtime/"):
        lines = layout_block()
        first = next(line for line in lines if line.startswith(f"  {package} "))
        block = "\n".join([first, *sub_block(lines, package, 2)])
        here = children(LIB / package.rstrip("/"))
        missing = sorted(n for n in here if not re.search(rf"\b{re.escape(n)}", block))
        assert not missing, f"README.md's Layout under {package} does not name {missing}"
