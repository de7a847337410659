"""The learner's passing answers, kept: each check that passes in a notebook writes the code it
passed with to ``your_engine/<check>.py`` beside the notebook; ``your_engine()`` loads them back.

Why a Python file per check: a learner can open it and read exactly what the engine will run,
and it loads with a plain ``exec`` in a fresh namespace — no pickling of notebook objects (a
notebook's function cannot be unpickled anywhere else). A function is kept with what it needs
from the notebook: the helper functions and classes it calls (defined in the notebook too), the
modules and library functions it uses (as ``import`` lines) and plain constants. A function that
reads a notebook *object* (a model, a tokenizer, a tensor) cannot be kept that way; its record
says which name stopped it, and ``your_engine()`` reports it instead of guessing.

The record is written only for code run in a notebook kernel (a test's functions live in
modules and are never recorded), atomically (a half-written file never loads), and replaces the
previous record of that check: the latest passing answer is the one your engine runs.
"""

from __future__ import annotations

import ast
import builtins
import datetime
import linecache
import math
import os
import symtable
import sys
import tempfile
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

FOLDER_NAME = "your_engine"
_LITERALS = (int, float, complex, str, bytes, bool, type(None))


class NotRecordable(ValueError):
    """The function needs something a source file cannot carry (named in the message)."""


def default_folder() -> Path:
    """Where a notebook's records go: ``your_engine/`` in the kernel's working directory, which
    JupyterLab sets to the notebook's own folder (the course folder)."""
    return Path.cwd() / FOLDER_NAME


def in_notebook(fns) -> bool:
    """Is this a learner's code in a notebook kernel: functions defined in ``__main__`` of a running
    IPython kernel (not a test's module, not the grader's fresh process)?"""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return False
    return all(getattr(fn, "__module__", None) == "__main__" for fn in fns if callable(fn))


# ---------------------------------------------------------------------------------------------
# Source of one definition
# ---------------------------------------------------------------------------------------------


def _code_of(obj) -> types.CodeType | None:
    """A code object that lies inside ``obj``'s definition (a function's own, a class's first method's)."""
    if isinstance(obj, types.FunctionType):
        return obj.__code__
    if isinstance(obj, type):
        for value in vars(obj).values():
            fn = getattr(value, "__func__", None) or getattr(value, "fget", None) or value
            if isinstance(fn, types.FunctionType):
                return fn.__code__
    return getattr(getattr(obj, "fn", None), "__code__", None)  # a @triton.jit kernel keeps its function as .fn


def definition_source(obj) -> str:
    """The ``def`` or ``class`` statement that made ``obj``, decorators included, read from the file
    or notebook cell its code came from (IPython keeps every cell's text in ``linecache``)."""
    name = getattr(obj, "__name__", "")
    code = _code_of(obj)
    if code is None or not name.isidentifier():
        raise NotRecordable(f"{obj!r:.60} is not a function or class defined with `def`/`class`")
    if "<locals>" in getattr(obj, "__qualname__", ""):
        raise NotRecordable(f"{name} is defined inside another function: define it at the top of a cell")
    text = "".join(linecache.getlines(code.co_filename))
    if not text:
        raise NotRecordable(f"the source of {name} is not available ({code.co_filename})")
    kinds = (ast.ClassDef,) if isinstance(obj, type) else (ast.FunctionDef, ast.AsyncFunctionDef)
    best = None
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, kinds) and node.name == name:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if first <= code.co_firstlineno <= node.end_lineno and (best is None or first > best[0]):
                best = (first, node)
    if best is None:
        raise NotRecordable(f"no definition of {name} found in {code.co_filename}")
    lines = text.splitlines()[best[0] - 1 : best[1].end_lineno]
    return textwrap.dedent("\n".join(lines)) + "\n"


def _names_read(source: str) -> list[str]:
    """The global names a definition reads (its parameters and locals excluded, whatever their
    names: a notebook's global ``body`` is not what ``def f(body)`` reads), by ``symtable``."""
    top = symtable.symtable(source, "<definition>", "exec")
    found: dict[str, None] = {}
    for sym in top.get_symbols():  # decorators, defaults, bases: read at the definition's own level
        if sym.is_referenced() and not sym.is_assigned():
            found.setdefault(sym.get_name(), None)
    tables = list(top.get_children())
    while tables:
        table = tables.pop(0)
        for sym in table.get_symbols():
            if sym.is_referenced() and sym.is_global():
                found.setdefault(sym.get_name(), None)
        tables.extend(table.get_children())
    return list(found)


def _import_line(name: str, value) -> str | None:
    """How a module-level name that is a module or a library's function/class comes back."""
    if isinstance(value, types.ModuleType):
        return f"import {value.__name__}" if name == value.__name__ else f"import {value.__name__} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname or module not in sys.modules:
        return None
    found = sys.modules[module]
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not value:
        return None
    if "." in qualname:
        return None
    return f"from {module} import {qualname}" + (f" as {name}" if name != qualname else "")


def _literal(value, top: bool = True) -> bool:
    """A constant whose ``repr`` reads back as itself (a non-finite float only on its own)."""
    if isinstance(value, float) and not math.isfinite(value):
        return top
    if isinstance(value, _LITERALS) or isinstance(value, torch.dtype):
        return True
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_literal(v, False) for v in value)
    if isinstance(value, dict):
        return all(_literal(k, False) and _literal(v, False) for k, v in value.items())
    return False


@dataclass
class _Module:
    """A record's text being assembled: imports, constants, then definitions (helpers first)."""

    imports: dict[str, None] = field(default_factory=dict)
    constants: dict[str, str] = field(default_factory=dict)
    definitions: dict[str, str] = field(default_factory=dict)  # name -> source, dependencies first

    def add(self, obj, home: dict, trail: tuple[str, ...] = ()) -> None:
        name = obj.__name__
        if name in self.definitions or name in trail:
            return
        source = definition_source(obj)
        for read in _names_read(source):
            if read == name or read in self.definitions or read in self.constants:
                continue
            if read not in home:
                if hasattr(builtins, read):
                    continue
                continue  # a local variable, a parameter, or a name that is not defined (it fails when run)
            self.add_global(read, home[read], home, (*trail, name))
        self.definitions[name] = source

    def add_global(self, name: str, value, home: dict, trail: tuple[str, ...]) -> None:
        kernel = getattr(value, "fn", None)  # a @triton.jit kernel wraps its function: keep the def, decorator and all
        if isinstance(kernel, types.FunctionType) and kernel.__module__ == home.get("__name__"):
            self.add(kernel, home, trail)
        elif getattr(value, "__module__", None) == home.get("__name__") and isinstance(
            value, (types.FunctionType, type)
        ):
            self.add(value, home, trail)
        elif (line := _import_line(name, value)) is not None:
            self.imports[line] = None
        elif _literal(value):
            if isinstance(value, torch.dtype) or "torch." in repr(value):
                self.imports["import torch"] = None
            text = f"float({str(value)!r})" if isinstance(value, float) and not math.isfinite(value) else repr(value)
            self.constants[name] = f"{name} = {text}"
        else:
            used_by = trail[-1] if trail else "your function"
            raise NotRecordable(
                f"{used_by} reads the notebook's `{name}` (a {type(value).__name__}), which a source file cannot "
                "carry: pass it as an argument, or build it inside the function"
            )

    def text(self) -> str:
        parts = ["\n".join(self.imports), "\n".join(self.constants.values()), *self.definitions.values()]
        return "\n\n".join(p.strip("\n") for p in parts if p.strip()) + "\n"


def snapshot(fns) -> str:
    """The source of a check's functions with everything they need from where they were defined."""
    module = _Module()
    for fn in fns:
        module.add(fn, _globals_of(fn))
    return module.text()


def _globals_of(obj) -> dict:
    if isinstance(obj, types.FunctionType):
        return obj.__globals__
    home = sys.modules.get(getattr(obj, "__module__", ""), None)
    if home is not None:
        return vars(home)
    raise NotRecordable(f"cannot tell where {obj!r:.60} was defined")


# ---------------------------------------------------------------------------------------------
# Writing and reading records
# ---------------------------------------------------------------------------------------------


@dataclass
class Record:
    check: str
    chapter: str
    functions: list[str]
    passed: str
    path: Path
    error: str = ""  # why the code could not be kept (then there is none)

    def load(self) -> list:
        """The recorded functions, defined again in a namespace of their own, in the check's order."""
        if self.error:
            raise NotRecordable(self.error)
        space: dict = {"__name__": f"your_engine.{self.check}"}
        text = self.path.read_text()
        exec(compile(text, str(self.path), "exec"), space)  # the learner's own code, as they passed it
        return [space[name] for name in self.functions]


def record(check: str, chapter: str, fns, folder: Path | None = None) -> Path:
    """Keep check ``check``'s passing functions ``fns`` in ``folder/<check>.py``; returns the path.
    Code that cannot be kept leaves a record saying why (``Record.error``)."""
    folder = Path(folder) if folder is not None else default_folder()
    names = [fn.__name__ for fn in fns]
    meta = {"check": check, "chapter": chapter, "functions": names,
            "passed": datetime.datetime.now().isoformat(timespec="seconds")}  # fmt: skip
    try:
        body = snapshot(fns)
    except (NotRecordable, OSError, SyntaxError) as err:
        meta["error"] = str(err)
        body = ""
    head = (
        f"# Your {check} ({chapter}), as it passed on {meta['passed']}.\n"
        "# minillm.course.your_engine() plugs it into the engine; passing the check again rewrites this file.\n"
        f"RECORD = {meta!r}\n"
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{check}.py"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{check}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(head + ("\n" + body if body else ""))
    os.replace(tmp, path)
    linecache.checkcache(str(path))  # a traceback through the new file shows its new lines
    return path


def read_records(folder: Path | None = None) -> dict[str, Record]:
    """Every record in ``folder`` by check name (files that are not records are skipped)."""
    folder = Path(folder) if folder is not None else default_folder()
    found: dict[str, Record] = {}
    for path in sorted(folder.glob("check_*.py")):
        first = path.read_text(encoding="utf-8").split("\nRECORD = ", 1)
        if len(first) != 2:
            continue
        try:
            meta = ast.literal_eval(first[1].split("\n", 1)[0])
        except (ValueError, SyntaxError):
            continue
        found[meta["check"]] = Record(meta["check"], meta["chapter"], list(meta["functions"]), meta["passed"], path,
                                      meta.get("error", ""))  # fmt: skip
    return found


def record_pass(check: str, fns) -> None:
    """After a pass: keep the learner's code when it runs in a notebook; never fail the check."""
    if not fns or not in_notebook(fns):
        return
    try:
        from minillm.course.exercises import EXERCISES

        chapter = next((e.chapter for e in EXERCISES if e.check == check), "")
        record(check, chapter, fns)
    except Exception:  # noqa: BLE001 — keeping a copy must never turn a pass into a failure
        pass
