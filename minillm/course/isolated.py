"""Graded checks in a fresh process, from the learner's source: a notebook cannot reach them.

In a notebook the learner's code and the checks share one Python process, so a cell can
redefine a check, write a verdict into the results table, or import the package's own answer
and return it. Four lines did exactly that and read "pass 2/2 | forged". So the grader (``grade.py``)
grades every check again **in a new Python process that receives the learner's code only as
text** (forked from a server that has imported torch and the course and has run no learner code:
``_Checker``), the way ``check_tp_mlp`` already runs the learner's function on its ranks:

1. *What runs.* The notebook's code cells before the check cell (check cells excluded), each
   reduced to its imports, ``def``/``class`` statements and constant assignments
   (``BLOCK = 16``). Statements that compute things — loading a model, running an experiment,
   and anything written to tamper — are not repeated. A function that needs a value an earlier
   cell computed is told so, naming the cell.
2. *What cannot happen there.* The check is the package's own function, taken before any
   learner code runs, and its verdict is what that function returns or raises — not a table
   the learner's code can write. The verdict goes to the grader through a pipe, exactly once;
   a second message on it marks the check as tampered.
3. *What is out of reach.* Before the learner's code loads, the package's answers to the
   exercise have their code swapped for stand-ins that refuse the learner's calls however they
   arrive (``guard.py``), and the process runs in a mount namespace of its own in which the solved
   notebooks and those answers' source files are empty (``sandbox.hide_answers``; each verdict
   says whether that held on this machine).
4. *What is detected.* Before anything runs, the grader reads every code cell of the notebook
   for the usual forgeries (``tamper_findings``: redefining a course check, touching the
   results table, writing a verdict) and for code that reaches around a grader
   (``reach.reach_findings``). In the fresh process, after the check: any library module
   whose functions were replaced (by learner code, or by other library functions), each call
   the stand-ins refused, and any call the learner's code made to a course-private reference —
   reported as "the package's own answer".

What it cannot prevent: the learner's functions still run inside the check's process (they
must: the check calls them), so code that digs the answers' original code out of the
process's memory, or rewrites the interpreter's state with native tools (``ctypes``), could
still fake a verdict; each needs a construct the scan names. The report names every finding;
an instructor should read a submission whose findings or grades surprise them.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from minillm.config import environment
from minillm.course.results import CHECK_ERROR, FAIL, NOT_ATTEMPTED, PASS, CheckResult

CHECK_TIMEOUT_S = 300  # one check, fresh process included: the slowest (TP ranks) takes ~60 s
TAMPERED = "graded as tampered"
#: The results machinery a notebook has no business touching (``results.py``).
_GRADING_NAMES = {"_record", "_latest", "graded", "VERDICT_MIME", "require_pass", "_failed", "CheckResult"}
_VERDICT_TEXT = "vnd.minillm.verdict"


@dataclass(frozen=True)
class LearnerCell:
    number: int  # 1-based, as the learner sees it (markdown cells counted)
    source: str


# ---------------------------------------------------------------------------------------------
# In the grader: what to send, and what to refuse before anything runs
# ---------------------------------------------------------------------------------------------


def python_of(source: str) -> str:
    """A cell's source as plain Python: IPython's magics (``%time``, ``!pip``) become calls,
    as IPython itself transforms them before running a cell."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def learner_cells(nb, before: int, check_cells) -> list[LearnerCell]:
    """The code cells above index ``before`` that are not check cells."""
    return [
        LearnerCell(i + 1, cell.source)
        for i, cell in enumerate(nb.cells[:before])
        if cell.cell_type == "code" and i not in check_cells and cell.source.strip()
    ]


def tamper_findings(cells: list[LearnerCell]) -> list[str]:
    """The forgeries a reader would spot in the learner's code: a course check (or the results
    machinery) defined, assigned or deleted; the results machinery read or written; a verdict's
    MIME type written out; a course module's attribute assigned. One line each, with the cell."""
    from minillm.course import CHECK_CALLS

    guarded = set(CHECK_CALLS) | _GRADING_NAMES
    findings = []
    for cell in cells:
        try:
            tree = ast.parse(python_of(cell.source))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            found = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in guarded:
                found = f"defines `{node.name}`, which the grader owns"
            elif isinstance(node, ast.Name) and node.id in guarded and not isinstance(node.ctx, ast.Load):
                found = f"assigns `{node.id}`, which the grader owns"
            elif isinstance(node, ast.Attribute) and node.attr in guarded:
                if node.attr in CHECK_CALLS and isinstance(node.ctx, ast.Load):
                    continue  # minillm.course.check_x(fn): calling a check is what a check cell does
                found = f"uses `.{node.attr}`, the grader's own record of verdicts"
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _VERDICT_TEXT in node.value:
                found = "writes out a verdict in the grader's own format"
            elif isinstance(node, ast.alias) and node.name.split(".")[-1] in _GRADING_NAMES - {"CheckResult"}:
                found = f"imports `{node.name}`, the grader's own record of verdicts"
            if found and f"cell {cell.number}: {found}" not in findings:
                findings.append(f"cell {cell.number}: {found}")
    return findings


def definitions(source: str) -> tuple[str, list[tuple[ast.stmt, bool]], dict[str, str]]:
    """``source`` as Python, the statements of it the fresh process runs (module docstring, step 1),
    each with whether it is a constant assignment (which may fail quietly: ``tok = llm.tokenizer``
    names a model no statement here loads), and the names the dropped statements would have
    assigned (name → the kind of statement)."""
    python = python_of(source)
    kept, dropped = [], {}
    for node in ast.parse(python).body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            kept.append((node, False))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and _constant(node.value):
            kept.append((node, True))
        else:
            for target in _targets(node):
                dropped[target] = type(node).__name__
    return python, kept, dropped


def _constant(value) -> bool:
    """A value worth keeping: literals, names and arithmetic on them — nothing that calls code."""
    if value is None:
        return False
    allowed = (ast.Constant, ast.Name, ast.Load, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.BinOp, ast.UnaryOp,
               ast.operator, ast.unaryop, ast.Attribute)  # fmt: skip
    return all(isinstance(node, allowed) for node in ast.walk(value))


def _targets(node) -> list[str]:
    names = []
    for target in getattr(node, "targets", None) or [getattr(node, "target", None)]:
        if target is not None:
            names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


def run_check(check: str, cells: list[LearnerCell], cwd: str | None = None,
              timeout: float = CHECK_TIMEOUT_S) -> CheckResult:  # fmt: skip
    """Grade ``check`` on ``cells`` in a fresh Python process (module docstring)."""
    return run_checks([(check, cells)], cwd, timeout)[check]


def run_checks(jobs: list[tuple[str, list[LearnerCell]]], cwd: str | None = None,
               timeout: float = CHECK_TIMEOUT_S) -> dict[str, CheckResult]:  # fmt: skip
    """Grade a notebook's checks, each on its own learner cells, in one fresh Python process (a
    model the checks load is loaded once), each within ``timeout`` seconds. A check that runs
    past it is stopped with its process; the checks after it get a new one."""
    results: dict[str, CheckResult] = {}
    pending = list(jobs)
    while pending:
        done = _run_some(pending, cwd, timeout)
        results.update(done)
        pending = [job for job in pending if job[0] not in results]
    return results


@contextlib.contextmanager
def _sigint_deferred():
    """Hold back Ctrl-C (SIGINT) inside the ``with``; the list it yields is non-empty if one came.

    Starting the checker takes seconds under load (the fork server may still be importing torch);
    a KeyboardInterrupt raised in the middle would leave a started checker that nobody stops — in
    CI one ran a learner's endless loop on a core for the whole suite. Elsewhere than the main
    thread signal handlers cannot change, and nothing is held back."""
    pressed: list[bool] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(True))
    except ValueError:  # not the main thread
        yield pressed
        return
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def _run_some(jobs, cwd, timeout) -> dict[str, CheckResult]:
    """One process for ``jobs``, in order, until the end or the first check that runs too long
    (that one gets its verdict here too; the rest are left for another process)."""
    import selectors
    import time

    with _sigint_deferred() as pressed:  # a Ctrl-C while it starts must not leave it running unowned
        child = _Checker({"jobs": [[name, [[c.number, c.source] for c in cells]] for name, cells in jobs]}, cwd)
    read = child.verdicts
    output = bytearray()
    lines: dict[str, list[str]] = {}
    names = [name for name, _ in jobs]
    buffer = b""
    selector = selectors.DefaultSelector()
    selector.register(read, selectors.EVENT_READ, "verdicts")
    selector.register(child.output, selectors.EVENT_READ, "output")
    current, deadline, timed_out, interrupted = 0, time.monotonic() + timeout, False, False
    try:
        if pressed:  # delivered now, where the finally below stops the checker
            signal.raise_signal(signal.SIGINT)
        open_streams = 2
        while open_streams:
            wait = deadline - time.monotonic()
            if wait <= 0:
                timed_out = True
                break
            for key, _ in selector.select(timeout=wait):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                if key.data == "output":
                    output += chunk
                    del output[: max(0, len(output) - 8192)]  # the tail is what a report shows
                    continue
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for line in complete:
                    if not line.strip():
                        continue
                    name = _check_of(line)
                    lines.setdefault(name, []).append(line.decode("utf-8", errors="replace"))
                    while current < len(names) and names[current] in lines:  # the next check's clock starts
                        current += 1
                        deadline = time.monotonic() + timeout
    except BaseException:  # Ctrl-C while waiting: the checker goes too (the grader would wait for it at exit)
        interrupted = True
        raise
    finally:
        selector.close()
        if timed_out or interrupted:
            child.kill_group()
        child.wait()
    results = {}
    for index, name in enumerate(names):
        got = lines.get(name, [])
        if len(got) > 1:
            results[name] = CheckResult(name, FAIL, f"{TAMPERED}: the check's process reported {len(got)} verdicts "
                                                    "for it, not one")  # fmt: skip
        elif got:
            results[name] = _verdict(name, got[0])
        elif index == current:  # the check that was running when the process stopped
            if timed_out:
                results[name] = CheckResult(name, FAIL, f"the check did not finish within {timeout:g} s when run on "
                                                        f"its own (a loop that never ends?){_tail(bytes(output))}")  # fmt: skip
            else:
                results[name] = CheckResult(name, FAIL, f"the check's process ended without a verdict (exit code "
                                                        f"{child.returncode}){_tail(bytes(output))}")  # fmt: skip
    for name in lines:
        if name not in names:  # a verdict for a check nobody asked about: only forged ones look like that
            for other in names:
                results[other] = CheckResult(other, FAIL, f"{TAMPERED}: the check's process reported a verdict "
                                                          "for a check it was not running")  # fmt: skip
    return results


def _check_of(line: bytes) -> str:
    try:
        verdict = json.loads(line)
        return str(verdict["check"]) if isinstance(verdict, dict) else "?"
    except (ValueError, KeyError):
        return "?"


def _verdict(name: str, line: str) -> CheckResult:
    try:
        verdict = json.loads(line)
        exposed = verdict.get("exposed")
        sandbox = "answers hidden" if exposed is None else f"answers NOT hidden: {exposed}"
        return CheckResult(name, str(verdict["status"]), str(verdict["message"]), sandbox)
    except (ValueError, KeyError, TypeError):
        return CheckResult(name, FAIL, f"{TAMPERED}: the check's process reported something that is not a verdict")


class _Checker:
    """The fresh process that grades: forked from the fork server (``parallel/start_method.py``),
    which has imported torch and the course and nothing else — no learner code has run in it, so
    its copies start as clean as a new interpreter, without one's 4-6 s of imports per notebook
    graded. It runs in a session of its own (its stray children are stopped with it), in the
    notebook's folder, with its output and its verdicts on two pipes of their own."""

    def __init__(self, payload: dict, cwd: str | None):
        from minillm.parallel import start_method

        ctx = start_method.context()
        verdicts, verdicts_w = ctx.Pipe(duplex=False)
        output, output_w = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_forked_main,
            args=(json.dumps(payload), verdicts_w, output_w, cwd, start_method.environment()),
            daemon=False,  # a check may start processes of its own (a daemon may not)
            name="minillm-grader",
        )
        with start_method.without_main_script():
            self.process.start()
        verdicts_w.close()  # the child holds the write ends: reading them ends at its exit
        output_w.close()
        self._ends = (verdicts, output)
        self.verdicts, self.output = verdicts.fileno(), output.fileno()

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def kill_group(self) -> None:
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            self.process.kill()

    def wait(self) -> None:
        self.process.join()
        for end in self._ends:
            end.close()


def _forked_main(payload: str, verdicts, output, cwd: str | None, env: dict) -> None:
    """The checker's first lines (``_Checker``): its own session and folder, its output on the
    pipe, then ``main``."""
    from minillm.parallel import start_method

    os.setsid()
    start_method.adopt_environment(env)
    if cwd is not None:
        os.chdir(cwd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(output.fileno(), 1)
    os.dup2(output.fileno(), 2)
    run(json.loads(payload), os.dup(verdicts.fileno()))  # multiprocessing flushes the output as the process ends


def _tail(output: bytes | None, chars: int = 400) -> str:
    text = (output or b"").decode("utf-8", errors="replace").strip()
    return f"; its last output: {text[-chars:]!r}" if text else ""


# ---------------------------------------------------------------------------------------------
# In the fresh process
# ---------------------------------------------------------------------------------------------


class _Integrity:
    """Which functions and classes the library modules hold, to see what the learner's code
    replaced: in the package, any replacement (nothing of it re-points its own functions
    except the hooks, checked apart); in torch and the other libraries, which do re-point some
    of theirs (``torch.manual_seed`` while a check runs), a function that came from a learner
    cell. Modules imported later are checked for the latter too."""

    PREFIXES = ("minillm", "torch", "triton", "numpy", "math", "builtins", "functools", "operator", "random")

    def __init__(self):
        import minillm.hooks as hooks

        self.before = {name: self._members(module) for name, module in self._modules()}
        self.hook_defaults = {name: id(point.default) for name, point in hooks.points().items()}

    def _modules(self):
        for name, module in list(sys.modules.items()):
            # minillm.hooks re-points its globals as checks override hooks: its points are checked instead
            if module is not None and name.split(".")[0] in self.PREFIXES and name != "minillm.hooks":
                yield name, module

    def _hook_changes(self) -> list[str]:
        """A hook's reference is what checks compare with: it must be the package's, and no
        override may outlive the check that installed it."""
        import minillm.hooks as hooks

        found = []
        for name, point in hooks.points().items():
            for fn in [point.default, *point.overrides]:
                code = getattr(fn, "__code__", None)
                if isinstance(code, types.CodeType) and code.co_filename.startswith("<cell "):
                    found.append(f"{code.co_filename[1:-1]} made its own function the hook {name!r}")
            if self.hook_defaults.get(name) not in (None, id(None), id(point.default)):
                found.append(f"the reference of hook {name!r} was replaced")
        return found

    @staticmethod
    def _members(module) -> dict[str, int]:
        try:
            items = list(vars(module).items())
        except TypeError:
            return {}
        return {k: id(v) for k, v in items if callable(v) and not k.startswith("__")}

    def changes(self) -> list[str]:
        found = []
        for name, module in self._modules():
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            old = self.before.get(name)
            for attr, value in items:
                if not callable(value) or attr.startswith("__"):
                    continue
                code = getattr(value, "__code__", None)
                if isinstance(code, types.CodeType) and code.co_filename.startswith("<cell "):
                    found.append(f"{code.co_filename[1:-1]} put its own `{attr}` into {name}")
                elif old is not None and attr in old and old[attr] != id(value) and name.startswith("minillm"):
                    found.append(f"{name}.{attr} was replaced")  # (torch re-points some of its own: learner code only)
        return sorted(set(found + self._hook_changes()))[:5]


def _reference_codes(check: str) -> dict:
    """Code object → dotted path, for the package's own answers to ``check``'s exercise."""
    from minillm.course.exercises import BY_CHECK
    from minillm.course.guard import resolve

    codes = {}
    exercise = BY_CHECK.get(check)
    for path in exercise.references if exercise else ():
        obj = resolve(path)
        obj = getattr(obj, "__init__", obj) if isinstance(obj, type) else obj
        obj = getattr(obj, "fn", obj)  # a @triton.jit kernel keeps its Python function as .fn
        code = getattr(obj, "__code__", None)
        if code is not None:
            codes[code] = path
    return codes


class _ShortcutWatch:
    """Sees a call of one of ``codes`` whose nearest caller outside the libraries is the
    learner's code (a learner cell), not the check (``minillm/course``)."""

    def __init__(self, codes: dict):
        self.codes, self.found = codes, []
        self.course_dir = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code not in self.codes:
            private = code.co_name.startswith("_") and not code.co_name.endswith("__") and "." not in code.co_qualname
            if private and code.co_filename.startswith(self.course_dir):  # a module-level _function, not a method
                caller = frame.f_back  # the course's private references answer exercises too
                if caller is not None and caller.f_code.co_filename.startswith("<cell "):
                    where = caller.f_code.co_filename[1:-1]
                    self.found.append(f"{where} calls the course's own {code.co_qualname} (minillm/course)")
            return
        caller = frame.f_back
        while caller is not None:
            filename = caller.f_code.co_filename
            if filename.startswith("<cell "):
                self.found.append(f"{filename[1:-1]} calls {self.codes[frame.f_code]}")
                return
            if filename.startswith(self.course_dir):
                return
            caller = caller.f_back

    def __enter__(self):
        import threading

        sys.setprofile(self)  # always: the course's private references are watched for every exercise
        threading.setprofile(self)
        return self

    def __exit__(self, *exc):
        import threading

        sys.setprofile(None)
        threading.setprofile(None)


def _grade_in_this_process(job: dict) -> dict:
    import minillm.course as course
    from minillm.course.exercises import BY_CHECK
    from minillm.course.guard import ENVIRONMENT, guard_answers
    from minillm.course.sandbox import hide_sources

    check_name = job["check"]
    check_fn = getattr(course, check_name)  # the package's check, taken before any learner code runs
    exercise = BY_CHECK[check_name]
    guard = guard_answers(check_name, exercise.references)  # the package's answers refuse learner code
    unhidden = hide_sources(guard.modules)  # their source cannot be read back (in this process's own mounts)
    try:
        with environment.scoped(ENVIRONMENT, check_name):  # a process the learner's code starts guards them too
            verdict = _graded(job, check_fn, exercise, guard)
        return verdict if unhidden is None else {**verdict, "exposed": unhidden}
    finally:
        guard.lift()


def _graded(job: dict, check_fn, exercise, guard) -> dict:
    """``_grade_in_this_process`` once the stand-ins are in: the learner's definitions, the check,
    and what was found."""
    import builtins
    import linecache

    from minillm.course.results import CheckError, CheckFailed

    check_name = job["check"]
    codes = _reference_codes(check_name)
    integrity = _Integrity()
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    dropped: dict[str, int] = {}
    broken = []
    written: dict = {}  # id → every code object compiled from the learner's cells (by identity: code objects
    # compare equal by content, file name aside, so a copy renamed as the package's file would match)
    for number, source in job["cells"]:
        filename = f"<cell {number}>"
        try:
            python, statements, cell_dropped = definitions(source)
        except SyntaxError as err:
            broken.append(f"cell {number} has a syntax error ({err.msg}, line {err.lineno})")
            continue
        dropped.update({name: number for name in cell_dropped})
        linecache.cache[filename] = (len(python), None, python.splitlines(True), filename)  # for inspect.getsource
        for node, quiet in statements:
            try:  # the learner's definitions, nothing else
                code = compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")
                written.update((id(c), c) for c in _code_objects(code))
                exec(code, namespace)
            except Exception as err:  # noqa: BLE001 - an import that fails, a bad default value: their cell
                if quiet:
                    dropped.update({name: number for name in _targets(node)})
                else:
                    broken.append(f"cell {number} raised {type(err).__name__}: {err} when its definitions ran")
    missing = [name for name in exercise.functions if name not in namespace]
    if missing:
        why = "; ".join(broken) or "no cell above the check cell defines it"
        return {"status": FAIL, "message": f"no `{missing[0]}` is defined before the check cell ({why})"}
    for name in exercise.functions:
        not_written = _not_written(namespace[name], written)
        if not_written:
            return {"status": FAIL, "message": f"`{name}` is {not_written}, not a function written in your cells: the "
                                               "check grades the code you wrote"}  # fmt: skip
    with _ShortcutWatch(codes) as watch:
        try:
            result = check_fn(*(namespace[name] for name in exercise.functions))
            status, message = result.status, result.message
        except CheckError as err:
            status, message = CHECK_ERROR, str(err)
        except CheckFailed as err:
            status, message = FAIL, str(err)
        except Exception as err:  # noqa: BLE001 - what the check cell itself would have raised
            status, message = FAIL, f"the check raised {type(err).__name__}: {err}"
    tampering = integrity.changes()
    if tampering:
        return {"status": FAIL, "message": f"{TAMPERED}: {'; '.join(tampering)}"}
    if guard.attempts:  # refused, whatever the learner's code made of the refusal
        return {"status": FAIL, "message": f"{'; '.join(guard.attempts[:3])}, which is not available while grading "
                                           f"{check_name} — an answer to this exercise that is not yours (the package's "
                                           "own, or a library's): write it yourself"}  # fmt: skip
    if watch.found:
        shortcut = watch.found[0]
        return {"status": FAIL, "message": f"{shortcut} — the package's own answer to this exercise: write it yourself"}
    if status == FAIL and "NameError" in message:
        name = message.split("name '", 1)[-1].split("'", 1)[0]
        if name in dropped:
            message += (f" — graded in a fresh process, which runs your imports and definitions but not cell "
                        f"{dropped[name]}'s computation of `{name}`: pass it to your function, or compute it inside")  # fmt: skip
    if status == PASS and broken:
        message += f" (note: {'; '.join(broken)})"
    return {"status": status, "message": message}


def _code_objects(code: types.CodeType) -> list:
    """``code`` and every code object nested in it (functions, classes, comprehensions)."""
    found = [code]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found += _code_objects(const)
    return found


def _not_written(obj, written: dict) -> str | None:
    """Why ``obj`` — what the learner's cells bound to an exercise's name — is not code they
    wrote (``written``: the code objects compiled from their cells), or None. A function must run
    one of those code objects (not a ``functools.partial``, a built-in, or a function whose code
    was swapped or renamed); a class must have been defined in the cells (its inherited methods
    are the stand-ins' business, ``guard._learner_class``)."""
    for _ in range(8):  # through decorators (functools.wraps's __wrapped__, a @triton.jit kernel's .fn):
        if isinstance(obj, type) or (isinstance(obj, types.FunctionType) and written.get(id(obj.__code__)) is obj.__code__):
            break  # (what a decorator's wrapper then calls is refused at run time, if it is an answer)
        inner = getattr(obj, "__wrapped__", None) or getattr(obj, "fn", None)
        if not callable(inner):
            break
        obj = inner
    if isinstance(obj, types.FunctionType):
        mine = written.get(id(obj.__code__)) is obj.__code__
        return None if mine else f"the function {obj.__module__}.{obj.__qualname__} (its code is not your cells')"
    if isinstance(obj, type):
        return None if obj.__module__ == "__main__" else f"the class {obj.__module__}.{obj.__qualname__}"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def main() -> int:
    """``python -m minillm.course.isolated``: the payload on stdin, the verdicts to its ``fd``."""
    payload = json.loads(sys.stdin.read())
    return run(payload, payload["fd"])


def run(payload: dict, fd: int) -> int:
    """Grade ``payload``'s jobs in this process, one verdict line per check to ``fd``; first the
    solved notebooks are hidden from it (``sandbox.hide_answers``), and each verdict says whether
    they were (``exposed``: None, or why not)."""
    from minillm.course.sandbox import answer_folders, hide_answers

    exposed = hide_answers(answer_folders() + [Path(p) for p in payload.get("hide", [])])
    with os.fdopen(fd, "w", encoding="utf-8") as channel:
        tampered = None
        for name, cells in payload["jobs"]:
            if tampered:  # the learner's code of an earlier check changed this process: nothing here is trusted
                verdict = {"status": FAIL, "message": tampered}
            else:
                try:
                    verdict = _grade_in_this_process({"check": name, "cells": cells})
                except Exception as err:  # noqa: BLE001 - the grader's own failure, said as such
                    verdict = {"status": CHECK_ERROR,
                               "message": f"grading in a fresh process failed: {type(err).__name__}: {err}"}  # fmt: skip
                if verdict["status"] not in (PASS, FAIL, NOT_ATTEMPTED, CHECK_ERROR):
                    verdict = {"status": FAIL, "message": f"{TAMPERED}: an unknown status {verdict['status']!r}"}
                if verdict["message"].startswith(TAMPERED):
                    tampered = (
                        f"{TAMPERED} (by the code of an earlier check): {verdict['message'][len(TAMPERED) + 2 :]}"
                    )
            said = verdict.pop("exposed", None)  # a source file this check's answers are in stayed readable
            channel.write(json.dumps({"check": name, **verdict, "exposed": exposed or said}) + "\n")
            channel.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
