"""Names a package exports without importing the modules behind them (PEP 562): they load on
first use. `import course_lib.estimate` (pure formulas) must work where torch is not installed,
and Python imports every package above a module first, so the packages on that path
(course_lib, course_lib.model, course_lib.comm) name their torch-using exports here."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, where: dict[str, str], namespace: dict):
    """(__getattr__, __dir__) for `package`: `where` maps each exported name to the module it lives
    in, imported on first use; the value is then kept in `namespace` (the package's globals), so
    the module is looked up once."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__
