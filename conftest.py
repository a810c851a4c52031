"""pytest settings: the notebook runs (`--nbval` over notebooks/ and exercises/), and the tests that
NCCL's rules mode leaves out (COURSE_NCCL_RULES=1, the `gloo_only` mark; at the end of this file).

The notebook runs: the kernels nbval starts talk to it over IPC sockets (files in a private directory), not TCP
ports. With TCP, jupyter_client picks five free ports, closes them and hands them to the kernel,
which binds them a second or two later, once ipykernel has imported. Meanwhile the ranks of a
notebook running beside it (`make test-portability` runs two sessions at once, CI runs the
browser tests beside them) open gloo connections on ephemeral ports and can take one of those
five; the kernel then dies before it starts ("Kernel died before replying to kernel_info", seen
once with several sessions side by side). A file path in a directory of its own cannot be taken.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import tempfile

_IPC_DIRS: list[str] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "gloo_only(reason): runs without NCCL's rules: does on purpose what NCCL "
                            "forbids (a gloo-only call, host tensors to a collective), or measures what the rules' "
                            "tracking changes; deselected under COURSE_NCCL_RULES=1 (conftest.py)")
    if os.name != "posix" or not config.getoption("nbval", default=False):
        return
    import nbval.kernel
    from jupyter_client.manager import KernelManager
    from traitlets import default

    class IPCKernelManager(KernelManager):
        """A kernel manager whose five channels are Unix sockets in a fresh directory."""

        @default("transport")
        def _transport_default(self):
            return "ipc"

        @default("ip")
        def _ip_default(self):  # the channels are <dir>/kernel-1 ... <dir>/kernel-5
            _IPC_DIRS.append(tempfile.mkdtemp(prefix="course-kernel-"))
            return os.path.join(_IPC_DIRS[-1], "kernel")

    nbval.kernel.KernelManager = IPCKernelManager


def pytest_unconfigure(config):
    while _IPC_DIRS:
        shutil.rmtree(_IPC_DIRS.pop(), ignore_errors=True)


# ------------------------------------------------------------------ NCCL's rules (COURSE_NCCL_RULES=1)
# With COURSE_NCCL_RULES=1 (course_lib/observe/nccl_rules.py and device_rule.py) every rank call obeys
# NCCL's point-to-point rules, refuses gloo-only calls, and hands communication calls tensors on the
# rank's device only. A test that does on purpose what NCCL forbids, or measures something the
# rules' tracking changes, says so with @pytest.mark.gloo_only("why"), or a file's `pytestmark`, or
# a line of GLOO_ONLY below for a whole file (files whose owners keep them elsewhere): with the
# variable set, those tests are deselected here, and `pytest -m gloo_only` runs them without it.
_GRADER = ("the graders run a learner's code on gloo CPU ranks only (course_lib/grading, backend gloo), with "
           "tensors made as the exercise's notebook makes them, without a device")
GLOO_ONLY = {  # a path relative to the repository, or a glob of them
    "tests/test_batch_grading.py": _GRADER,
    "tests/test_grading_ex*.py": _GRADER,  # ex09's ring keeps NCCL's order (one batch_isend_irecv) all the same
    "tests/test_grading.py": "runs the exercise notebooks, whose learner code runs on gloo CPU ranks with tensors "
                             "made without a device, as the notebooks teach",
    "tests/test_grading_loader.py": "grades exercise notebooks, whose learner code runs on gloo CPU ranks with "
                                    "tensors made without a device, as the notebooks teach",
    "tests/test_torch_memtracker.py": "measures memory with torch's MemTracker, exactly: under the rules the device "
                                      "rule's tensor tracking (a torch function mode on every op) changes the bytes it "
                                      "counts (activations 797,320 against 451,952 at world size 2)",
}


def _gloo_only_reason(item):
    mark = item.get_closest_marker("gloo_only")
    if mark is not None:
        reason = (mark.args[0] if mark.args else mark.kwargs.get("reason", "")).strip()
        if not reason:
            raise ValueError(f"{item.nodeid}: @pytest.mark.gloo_only needs its reason (what NCCL forbids, and why on purpose)")
        return reason
    return None


def pytest_collection_modifyitems(config, items):
    import pytest

    root = config.rootpath
    for item in items:
        rel = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        reason = next((why for path, why in GLOO_ONLY.items() if fnmatch.fnmatchcase(rel, path)), None)
        if reason is not None:
            item.add_marker(pytest.mark.gloo_only(reason))
        _gloo_only_reason(item)  # every mark states its reason
    if os.environ.get("COURSE_NCCL_RULES", "") != "1":
        return
    kept = [i for i in items if i.get_closest_marker("gloo_only") is None]
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("gloo_only") is not None])
        items[:] = kept
