"""pytest settings for the notebook runs (`--nbval` over notebooks/ and exercises/).

The kernels nbval starts talk to it over IPC sockets (files in a private directory), not TCP
ports. With TCP, jupyter_client picks five free ports, closes them and hands them to the kernel,
which binds them a second or two later, once ipykernel has imported. Meanwhile the ranks of a
notebook running beside it (`make test-portability` runs two sessions at once, CI runs the
browser tests beside them) open gloo connections on ephemeral ports and can take one of those
five; the kernel then dies before it starts ("Kernel died before replying to kernel_info", seen
once with several sessions side by side). A file path in a directory of its own cannot be taken.
"""

from __future__ import annotations

import os
import shutil
import tempfile

_IPC_DIRS: list[str] = []


def pytest_configure(config):
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
