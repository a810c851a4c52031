"""Refuse a student module that reaches an exercise's answer by any route, derived, not listed.

Each exercise's checker module names once where its answer lives (`REFUSE`: the library modules
and functions that hold it). `reached_answers(module, refuse)` then follows what the learner's
module can reach after it has been loaded, before any check runs:

* every name its code loads or imports, resolved to the object it is (a re-export such as
  `course_lib.parallel.mesh_groups` is the same function as `course_lib.parallel.mesh.mesh_groups`,
  so it is caught by identity, and so is anything defined in an answer module);
* every attribute chain on such a name (`dp.training.step`), resolved the same way;
* every value bound in the module's namespace (a `getattr(m, "pl" + "an")` at module level);
* and, recursively, the code of every function and class it reaches that is not part of an
  installed package: the learner's own helpers, sibling modules in the learner's folder, and the
  library's own helpers (a helper that wraps the answer reaches it, so it is refused too).

The walk reads bytecode (`dis`), so an import inside a function body counts as well as one at
the top. What it cannot see is a name computed at run time inside a function (`getattr` on a
string built from pieces): an exercise that must rule that out too replaces its answer's entry
points while the checks run (see ex15_capstone.ask).
"""

from __future__ import annotations

import ast
import dis
import functools
import importlib
import importlib.util
import inspect
import sys
import sysconfig
import types

_INSTALLED = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def resolve(names: tuple[str, ...]) -> tuple[set[str], dict[int, str]]:
    """(answer module names, {id(object): dotted name}) for `names`: a dotted name that imports is a
    module (everything defined in it or below it is the answer); otherwise the last part is an
    attribute of the module before it. A name that resolves to nothing raises ValueError: the
    checker must name where its answer really lives."""
    modules: set[str] = set()
    objects: dict[int, str] = {}
    for name in names:
        try:
            importlib.import_module(name)
            modules.add(name)
            continue
        except ImportError:
            pass
        parent, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(parent), attr)
        except (ImportError, AttributeError):
            raise ValueError(f"{name!r} names no module or object: name where the answer lives") from None
        objects[id(obj)] = name
        if isinstance(obj, types.ModuleType):
            modules.add(obj.__name__)
    for name in modules:  # the tables an answer module defines (a re-exported LAYOUTS is the same tuple)
        module = sys.modules[name]
        for attr in _assigned(module):
            value = getattr(module, attr, None)
            if isinstance(value, (tuple, list, dict, set, frozenset)) and value:
                objects.setdefault(id(value), f"{name}.{attr}")
    return modules, objects


def _assigned(module) -> set[str]:
    """The names `module`'s own top-level statements assign (not the ones it imports)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _below(name, modules) -> str | None:
    if not isinstance(name, str):
        return None
    return next((m for m in modules if name == m or name.startswith(m + ".")), None)


def _walkable(obj) -> bool:
    """Code the walk follows: the learner's and the course's, not an installed package's."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if module is None or path is None:
        return False
    return not any(path.startswith(p) for p in _INSTALLED)


class _Walk:
    def __init__(self, refuse: tuple[str, ...]):
        self.modules, self.objects = resolve(refuse)
        self.memo: dict[int, str | None] = {}

    def hit(self, obj) -> str | None:
        """The answer `obj` is or reaches, named, or None."""
        key = id(obj)
        if key in self.objects:
            return self.objects[key]
        if isinstance(obj, types.ModuleType):
            return _below(obj.__name__, self.modules)
        if isinstance(obj, (functools.partial, types.MethodType)):
            return self.hit(getattr(obj, "func", None) or obj.__func__)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            return None
        home = _below(getattr(obj, "__module__", None), self.modules)
        if home:
            return f"{obj.__module__}.{getattr(obj, '__qualname__', '?')}"
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = None  # a cycle reaches nothing new
        found = None
        if _walkable(obj):
            if inspect.isfunction(obj):
                found = self.code(obj.__code__, obj.__globals__, obj.__module__)
                found = found or next(filter(None, map(self.hit, obj.__defaults__ or ())), None)
            else:
                for value in list(vars(obj).values()) + list(obj.__bases__):
                    for part in (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                                 getattr(value, "fset", None)):
                        found = found or (self.hit(part) if part is not None and part is not obj else None)
        self.memo[key] = found
        return found

    def code(self, code, namespace: dict, module_name: str, lines: list | None = None) -> str | None:
        """The first answer `code` (and the code nested in it) reaches; each hit with its line
        appended to `lines` when given."""
        first = None
        current, imported, recent, last = None, None, [0, None], None
        local: dict[str, object] = {}  # names this code bound to an import or an attribute chain
        builtins = namespace.get("__builtins__", {})
        for ins in dis.get_instructions(code):
            op, hit, obj = ins.opname, None, None
            if op in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE") and ins.argval in local:
                obj = current = local[ins.argval]
            elif op in ("LOAD_GLOBAL", "LOAD_NAME"):
                name = ins.argval
                obj = local.get(name) if name in local else namespace.get(
                    name, getattr(builtins, name, None) if not isinstance(builtins, dict) else builtins.get(name))
                current = obj
            elif op.startswith("STORE_") and isinstance(ins.argval, str) and last is not None:
                local[ins.argval] = last
                current = None
            elif op in ("LOAD_ATTR", "LOAD_METHOD") and current is not None:
                try:
                    obj = current = getattr(current, ins.argval)
                except Exception:  # noqa: BLE001 - an attribute that does not resolve reaches nothing
                    current = None
            elif op == "IMPORT_NAME":  # the two constants before it are its level and fromlist
                obj = self._import(ins.argval, module_name, recent[-2])
                hit = self.hit(obj) if obj is not None else None  # `import a.b.c` imports a.b.c ...
                if obj is not None and recent[-1] is None:  # ... and binds a
                    obj = sys.modules.get(obj.__name__.partition(".")[0], obj)
                imported = [obj] if obj is not None else []
                current = obj
            elif op == "IMPORT_FROM" and imported:
                # `from m import x, y` takes both from m; `import a.b.c as x` takes b from a, c from a.b
                for base in reversed(imported):
                    obj = getattr(base, ins.argval, None) or sys.modules.get(f"{base.__name__}.{ins.argval}")
                    if obj is not None:
                        break
                if isinstance(obj, types.ModuleType):
                    imported.append(obj)
            else:
                current = None
            if op == "LOAD_CONST":
                recent = [*recent[-1:], ins.argval]
            last = obj
            if obj is not None and not hit:
                hit = self.hit(obj)
            if hit:
                first = first or hit
                if lines is None:
                    return first
                lines.append((ins.positions.lineno if ins.positions else 0, hit))
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found = self.code(const, namespace, module_name, lines)
                first = first or found
                if found and lines is None:
                    return first
        return first

    @staticmethod
    def _import(name, module_name, level):
        try:
            package = sys.modules[module_name].__package__ if module_name in sys.modules else None
            level = level if isinstance(level, int) and not isinstance(level, bool) else 0
            full = importlib.util.resolve_name("." * level + (name or ""), package) if level else name
            return importlib.import_module(full)
        except Exception:  # noqa: BLE001 - a module the walk cannot import is one the learner could not either
            return None


def reached_answers(module: types.ModuleType, source: str, refuse: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, answer) for every place the loaded `module` (its `source`) reaches an answer in
    `refuse`, directly or through anything it calls (see the module docstring). Line 0: a value
    in the namespace that no line names."""
    if not refuse:
        return []
    walk = _Walk(tuple(refuse))
    lines: list[tuple[int, str]] = []
    walk.code(compile(source, module.__file__, "exec"), vars(module), module.__name__, lines)
    for name, value in vars(module).items():
        if not name.startswith("__"):
            hit = walk.hit(value)
            if hit and not any(h == hit for _, h in lines):
                lines.append((0, hit))
    return sorted(set(lines))
