"""The `gloo_only` mark of the root conftest.py: under COURSE_NCCL_RULES=1 the tests that do on
purpose what NCCL forbids are deselected (and `pytest -m gloo_only` runs them without the rules);
every mark states its reason; GLOO_ONLY marks whole files, by path or glob."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _conftest():
    spec = importlib.util.spec_from_file_location("root_conftest_under_test", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Item:
    def __init__(self, path, *marks):
        self.path, self.nodeid, self.marks = ROOT / path, f"{path}::t", [m.mark for m in marks]

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)

    def add_marker(self, mark):
        self.marks.append(mark.mark)


class _Config:
    rootpath = ROOT

    def __init__(self):
        self.deselected = []
        self.hook = self

    def pytest_deselected(self, items):
        self.deselected.extend(items)


def _items():
    return [_Item("tests/test_a.py"), _Item("tests/test_a.py", pytest.mark.gloo_only("a gloo-only call")),
            _Item("tests/test_batch_grading.py"), _Item("tests/test_grading_ex42.py")]


def test_under_the_rules_the_marked_tests_and_files_are_deselected(monkeypatch):
    conftest, config, items = _conftest(), _Config(), _items()
    assert "tests/test_batch_grading.py" in conftest.GLOO_ONLY
    monkeypatch.setenv("COURSE_NCCL_RULES", "1")
    conftest.pytest_collection_modifyitems(config, items)
    assert [i.marks for i in items] == [[]] and len(config.deselected) == 3  # by mark, file, glob


def test_without_the_rules_nothing_is_deselected(monkeypatch):
    conftest, config, items = _conftest(), _Config(), _items()
    monkeypatch.delenv("COURSE_NCCL_RULES", raising=False)
    conftest.pytest_collection_modifyitems(config, items)
    assert len(items) == 4 and config.deselected == []
    assert items[2].get_closest_marker("gloo_only").args[0] == conftest.GLOO_ONLY["tests/test_batch_grading.py"]


def test_a_mark_without_its_reason_is_refused(monkeypatch):
    monkeypatch.delenv("COURSE_NCCL_RULES", raising=False)
    with pytest.raises(ValueError, match="needs its reason"):
        _conftest().pytest_collection_modifyitems(_Config(), [_Item("tests/test_a.py", pytest.mark.gloo_only())])
