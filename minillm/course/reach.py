"""Code that reaches around a grader from inside its process, named before anything runs.

The learner's code (the cells that differ from the shipped student notebook) is read for the
constructs no exercise of the course needs and only reaching around a grader does: the
interpreter's own machinery (``gc``, ``ctypes``, ``sys.setprofile``, ``sys.modules``,
``importlib``, frames, ``__code__``/``__globals__``), code built at run time (``exec``, ``eval``,
``compile``), files (``open``, ``__file__``), pickling, and processes of its own. Each is
reported, and the notebook gets no points (``grade.py``). A name hidden in a string
(``getattr(sys, "setprofile")``) is found as well; one assembled at run time from pieces is not —
the stand-ins in the grading process (``guard.py``) and the hidden files (``sandbox.py``) are the
other lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

from minillm.course.isolated import definitions

#: Modules whose import reaches around a grader, with what they are for.
MODULES = {
    "gc": "the interpreter's object graph",
    "ctypes": "raw memory",
    "importlib": "imports by computed name",
    "pickle": "pickling",
    "marshal": "code objects as bytes",
    "dill": "pickling",
    "cloudpickle": "pickling",
    "subprocess": "a process of its own",
    "multiprocessing": "a process of its own",
    "concurrent": None,  # a pool's worker runs no package code above a reference: guard.py refuses it
    "threading": None,  # a lock for a cache is everyday (chapter 10); a thread of its own: as above
    "_thread": "threads of its own",
    "inspect": "frames and source",
    "runpy": "running files as code",
    "code": "an interpreter of its own",
    "sys": None,  # everyday: only its attributes below are findings
    "os": None,
    "builtins": "the built-in names",
    "types": None,
}
#: Attributes (of any object) and built-in calls that reach around a grader.
ATTRIBUTES = {
    "setprofile", "settrace", "_getframe", "f_back", "f_globals", "f_locals", "f_code", "__code__",
    "__closure__", "__globals__", "__builtins__", "__subclasses__", "__file__", "__loader__", "__spec__",
    "modules", "meta_path", "path_hooks", "get_objects", "get_referrers", "get_referents", "getsource",
    "getsourcefile", "system", "popen", "fork", "forkpty", "execv", "execve", "execvp", "spawnv", "posix_spawn",
    "FunctionType", "CodeType", "read_text", "read_bytes",
}  # fmt: skip
CALLS = {"exec", "eval", "compile", "__import__", "open", "globals", "breakpoint"}
#: Under these, ``modules`` and friends are ordinary names: ``torch.nn.Module.modules()``.
_EVERYDAY_OWNERS = {"model", "self", "module", "layer", "nn"}


def reach_findings(cells, shipped: set[str] | None = None) -> list[str]:
    """One line per construct that reaches around the grader, in the cells (``LearnerCell``s)
    whose source is not one of the shipped student notebook's (``shipped``: their stripped
    sources; None: read every cell).

    Only the code the grading process runs is read — each cell's imports, ``def``s, ``class``es
    and constant assignments (``isolated.definitions``) — so a scratch cell's ``gc.collect()`` or
    ``inspect.signature(f)`` at the top level, which the grader never runs, costs nothing. An
    import of one of ``MODULES`` is a finding once a definition uses the name it bound."""
    kept = []
    for cell in cells:
        if shipped is not None and cell.source.strip() in shipped:
            continue
        try:
            kept.append((cell.number, [node for node, _ in definitions(cell.source)[1]]))
        except SyntaxError:
            continue
    bound = {}  # a name an import of a reaching module bound → what it is
    for _, statements in kept:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                bound.update(_reaching_names(node))
    findings: list[str] = []
    for number, statements in kept:
        for statement in statements:
            top_import = isinstance(statement, (ast.Import, ast.ImportFrom))
            for node in ast.walk(statement):
                if top_import and node is statement:
                    found = _imported_attribute(node)  # `from sys import setprofile`; a module alone waits for its use
                elif isinstance(node, ast.Name) and node.id in bound and not top_import:
                    found = f"uses `{node.id}` ({bound[node.id]})"
                else:
                    found = _finding(node)
                if found and f"cell {number}: {found}" not in findings:
                    findings.append(f"cell {number}: {found}")
    return findings


def _reaching_names(node) -> dict[str, str]:
    """The names an import statement binds to a reaching module (or to something from one)."""
    if isinstance(node, ast.ImportFrom):
        why = MODULES.get((node.module or "").split(".")[0])
        return {alias.asname or alias.name: why for alias in node.names} if why else {}
    return {(alias.asname or alias.name.split(".")[0]): MODULES[alias.name.split(".")[0]]
            for alias in node.names if MODULES.get(alias.name.split(".")[0])}  # fmt: skip


def _imported_attribute(node) -> str | None:
    if isinstance(node, ast.ImportFrom):
        for alias in node.names:
            if alias.name in ATTRIBUTES or alias.name in CALLS:
                return f"imports `{alias.name}` from `{node.module}`"
    return None


def _finding(node) -> str | None:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
        for name in names:
            why = MODULES.get(name.split(".")[0])
            if why:
                return f"imports `{name}` ({why})"
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name in ATTRIBUTES or alias.name in CALLS:
                    return f"imports `{alias.name}` from `{node.module}`"
    elif isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES:
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        if node.attr == "modules" and owner != "sys":
            return None
        if owner in _EVERYDAY_OWNERS and node.attr in {"modules", "system"}:
            return None
        return f"uses `.{node.attr}`"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in CALLS:
        return f"calls `{node.func.id}`"
    elif isinstance(node, ast.Name) and node.id in {"__builtins__", "__loader__", "__spec__"}:
        return f"uses `{node.id}`"
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        word = node.value.strip()
        if word in ATTRIBUTES - {"modules", "system", "fork"} or word in CALLS - {"open", "compile"} \
                or MODULES.get(word):  # fmt: skip
            return f"names `{word}` in a string"
        if "solutions" in node.value or node.value.endswith(".ipynb"):
            return "names a notebook file or the solutions folder"
    return None


def shipped_sources(chapter: str | None) -> set[str] | None:
    """The stripped sources of the shipped student notebook's code cells, or None when it is not
    at hand (then every cell is read)."""
    if chapter is None:
        return None
    path = Path(__file__).resolve().parents[2] / "notebooks" / f"{chapter}.ipynb"
    try:
        import nbformat

        nb = nbformat.read(path, as_version=4)
    except Exception:  # noqa: BLE001 - no student notebook at hand: read every cell
        return None
    return {cell.source.strip() for cell in nb.cells if cell.cell_type == "code"}
