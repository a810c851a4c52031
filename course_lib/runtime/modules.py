"""Modules loaded from a file (a learner's `student.py`) and shared with the ranks by their source.

A rank cannot `import` a module the parent loaded from a file path, so its functions must
travel some other way. Sending each function by value (cloudpickle's pickle-by-value) works,
but the function then runs from a copy of its code object whose file name is whatever the
pickler chose to write (cloudpickle 3.1.3 writes "<dynamic-code>"): a traceback from the rank
no longer says "student.py, line 33", and the learner cannot find their bug.

So the parent registers the module (`share_with_ranks`); every call to `run_on_ranks` sends the
registered modules' (name, path, source) ahead of the function, each rank executes that source
compiled under its real path (`install`) before unpickling the call, and the functions travel
by reference (module name + qualified name), as any installed module's do. Tracebacks on the
ranks then name the file and line the learner wrote, whatever the pickler does with code.
"""

from __future__ import annotations

import pathlib
import sys
import types

# name -> (path, source), in the parent. Re-sharing a name replaces it (a learner who edits
# student.py and reloads it gets the new version on the ranks too).
_SHARED: dict[str, tuple[str, str]] = {}


def share_with_ranks(module: types.ModuleType) -> None:
    """Make `module` (loaded from a file, registered in sys.modules) importable on every rank."""
    path = getattr(module, "__file__", None)
    if not path or sys.modules.get(module.__name__) is not module:
        raise ValueError(f"module {module.__name__!r} must be loaded from a file and registered in "
                         f"sys.modules under its name to be shared with the ranks")
    _SHARED[module.__name__] = (str(path), pathlib.Path(path).read_text())


def shared_modules() -> tuple[tuple[str, str, str], ...]:
    """What the parent sends ahead of each call: (name, path, source) per shared module."""
    return tuple((name, path, source) for name, (path, source) in _SHARED.items())


def install(shared: tuple[tuple[str, str, str], ...]) -> None:
    """On a rank: (re-)create each shared module from its source, under its real file name."""
    for name, path, source in shared:
        current = sys.modules.get(name)
        if current is not None and getattr(current, "__course_source__", None) == source:
            continue  # the same version is already installed on this rank
        module = types.ModuleType(name)
        module.__file__ = path
        module.__course_source__ = source
        sys.modules[name] = module
        exec(compile(source, path, "exec"), module.__dict__)  # noqa: S102 - the learner's own file
