"""Asynchronous checkpointing: the copy to host memory blocks training, the write does not.

    step k   | stage (copy GPU -> host, exchange boxes) | write file (background thread) ...........|
    step k+1 |                                          | forward / backward / optimizer ...         |
    next save or wait():                                       join the thread, metadata, rename

A synchronous save stalls training for copy + serialise + write; an async one only for the
copy (the tensors must be frozen before the next optimizer step changes them). The write then
overlaps the following steps, and the checkpoint becomes complete (metadata written, directory
renamed) at the next `wait()`, which every rank calls (it is collective). A failure in between
leaves only a .partial directory: recovery falls back to the previous complete checkpoint, so
an async checkpoint is "one behind" until it is committed. The cost: host memory for one more
copy of the state, and the background write competing with training for CPU and I/O.
"""

from __future__ import annotations

import threading
import time

from course_lib.checkpoint.format import finish, stage, write_staged


class AsyncCheckpointer:
    def __init__(self, group=None):
        self.group = group
        self._thread = None
        self._staged = None
        self._error = None
        self.blocking_seconds: list[float] = []  # per save: what training waited for

    def save(self, final, pieces, objects=None, rank_objects=None, group=None, extra=None) -> float:
        """Collective. Commit the previous save, stage this one, start writing; returns the seconds
        this call blocked (the previous commit + the copy to host)."""
        start = time.perf_counter()
        self.wait()
        group = group if group is not None else self.group
        self._staged = stage(final, pieces, objects, rank_objects, group, extra)
        self._error = None

        def write():
            try:
                write_staged(self._staged)
            except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                self._error = e
        self._thread = threading.Thread(target=write, name="checkpoint-writer", daemon=True)
        self._thread.start()
        seconds = time.perf_counter() - start
        self.blocking_seconds.append(seconds)
        return seconds

    def wait(self):
        """Collective. Finish the pending save (join the writer, metadata, rename); returns its path."""
        if self._staged is None:
            return None
        self._thread.join()
        staged, self._staged, self._thread = self._staged, None, None
        if self._error is not None:
            staged.file_info = None  # finish() refuses to commit and names the checkpoint
        return finish(staged, self.group)

    @property
    def pending(self) -> bool:
        return self._staged is not None
