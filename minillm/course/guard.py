"""While a check is graded, the package's answers to its exercise refuse the learner's code.

The grader (``isolated.py``) grades each check in a fresh process that runs the learner's
definitions and then the check. Watching calls there (``sys.setprofile``) can be switched off by
the code it watches, and a call made from a thread has no notebook frame above it. So before the
learner's code is loaded, every function that answers the exercise under check
(``Exercise.references``: the package's implementation and every other path that computes the
same answer) has its code object swapped, in place, for a stand-in. The function object stays
the same one — the module's attribute, the hook's default, a ``from ... import`` taken before,
what ``gc.get_objects()`` finds — so no name leads around the stand-in.

The stand-in runs the package's code only for the package: when no learner code is on the
calling thread's stack and some of the package's own code is. A learner's function on the stack
(one called by the check, or plugged into the engine), a learner's thread, a pool worker running
the reference for the learner: each gets ``AnswerUnavailable`` — "the package's X is not
available while grading check_Y" — and the attempt is kept for the grader's report, even when the
learner's code catches the error.

What it does not cover: the process's memory is the learner's too. Code that finds the grader's
private copies (the original code objects, held here), compiles the package's source again, or
writes memory through ``ctypes`` still reaches an answer; the grader's static scan
(``reach.reach_findings``) reports each of those constructs in the learner's code, and the
solved notebooks are out of the process's reach (``sandbox.hide_answers``).
"""

from __future__ import annotations

import builtins
import inspect
import os
import sys
import types
from dataclasses import dataclass, field

from minillm.config import environment
from minillm.course.results import LEARNER_CALLS

#: The name the stand-ins look up (in ``builtins``, which every module's globals fall back to).
DISPATCH = "__minillm_graded_answer__"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NONE = object()


class AnswerUnavailable(RuntimeError):
    """The learner's code called one of the package's answers to the exercise being graded."""


@dataclass
class _Guarded:
    path: str
    function: types.FunctionType
    code: types.CodeType  # the package's own, put back by ``Guard.lift``
    implementation: types.FunctionType  # the same code under another name, for the package's calls
    signature: object  # the function's own __signature__ attribute before (``_NONE``: it had none)
    method: bool  # defined in a class: a learner's subclass inherits it without a frame of its own


@dataclass
class Guard:
    """The stand-ins of one check: ``attempts`` lists what the learner's code tried to call."""

    check: str
    guarded: dict[str, _Guarded] = field(default_factory=dict)
    attempts: list[str] = field(default_factory=list)

    def lift(self) -> None:
        """Put the package's code back (the next check in the same process may need it)."""
        for module, attr, original in self.wrapped:
            setattr(module, attr, original)
        self.wrapped.clear()
        for entry in self.guarded.values():
            entry.function.__code__ = entry.code
            if entry.signature is _NONE:
                vars(entry.function).pop("__signature__", None)
            else:
                entry.function.__signature__ = entry.signature
        self.guarded.clear()
        if getattr(builtins, DISPATCH, None) is self.dispatch:
            delattr(builtins, DISPATCH)

    dispatch = None  # the function the stand-ins call (``_dispatcher``)
    modules: set = field(default_factory=set)  # the modules that define the guarded functions
    wrapped: list = field(default_factory=list)  # (module, attribute, original): the library answers wrapped


def _dispatcher(guard: Guard):
    """The function every stand-in calls: the package's code for the package's calls, else a
    refusal kept in ``guard.attempts``. A plain closure: it exposes no attribute that leads to
    the originals (a learner's code would have to read its ``__closure__``, which the static scan
    reports)."""
    guarded, attempts, check = guard.guarded, guard.attempts, guard.check

    def dispatch(key: str, args: tuple, kwargs: dict):
        entry = guarded[key]
        culprit = _culprit(sys._getframe(2), args if entry.method else None)
        if culprit is None:
            return entry.implementation(*args, **kwargs)
        _keep(attempts, f"{culprit} called the package's {entry.path}")
        raise AnswerUnavailable(f"the package's {entry.path} is not available while grading {check}: "
                                "write it yourself")  # fmt: skip

    return dispatch


def guard_answers(check: str, paths) -> Guard:
    """Swap in the stand-ins for ``paths`` (dotted names of functions, methods or classes — a
    class's own functions each), for grading ``check``, and wrap the library functions that
    compute the same answer (``exercises.LIBRARY_ANSWERS``: built-ins, whose code cannot be
    swapped, are replaced in their module while the check runs). Call before the learner's code
    loads."""
    from minillm.course.exercises import LIBRARY_ANSWERS

    guard = Guard(check)
    for path in paths:
        for name, function in _functions(path):
            if name not in guard.guarded and isinstance(function, types.FunctionType):
                guard.guarded[name] = _stand_in(name, function)
    for module_name, attr in LIBRARY_ANSWERS.get(check, ()):
        module = resolve(module_name)
        original = getattr(module, attr, None)
        if original is not None:
            guard.wrapped.append((module, attr, original))
            setattr(module, attr, _library_stand_in(f"{module_name}.{attr}", original, guard))
    guard.modules = {sys.modules[entry.function.__module__] for entry in guard.guarded.values()
                     if entry.function.__module__ in sys.modules}  # fmt: skip
    guard.dispatch = _dispatcher(guard)
    setattr(builtins, DISPATCH, guard.dispatch)
    return guard


ENVIRONMENT = "MINILLM_GRADING"  # the check being graded, for the processes the learner's code starts


def guard_from_environment() -> Guard | None:
    """In a process started while a check is graded (``MINILLM_GRADING`` names it; the package's
    ``__init__`` calls this on import): the same stand-ins, so a fresh interpreter the learner's
    code starts — to unpickle a reference there, say — finds them too."""
    from minillm.course.exercises import BY_CHECK

    check = environment.get(ENVIRONMENT) or ""
    exercise = BY_CHECK.get(check)
    return guard_answers(check, exercise.references) if exercise else None


def _library_stand_in(path: str, original, guard: Guard):
    """A library function that computes the exercise's answer (a built-in: no code to swap), in
    its module's place while the check runs: the same rule as the package's answers."""
    attempts, check = guard.attempts, guard.check

    def library_answer(*args, **kwargs):
        culprit = _culprit(sys._getframe(1), None)
        if culprit is None:
            return original(*args, **kwargs)
        _keep(attempts, f"{culprit} called {path}")
        raise AnswerUnavailable(f"{path} computes this exercise's whole answer and is not available while grading "
                                f"{check}: write it yourself")  # fmt: skip

    return library_answer


def _functions(path: str):
    """``(dotted name, function)`` for ``path``: the function, or each function a class defines."""
    obj = resolve(path)
    if isinstance(obj, type):
        for attr, member in vars(obj).items():
            member = getattr(member, "__func__", member)  # staticmethod / classmethod
            if isinstance(member, types.FunctionType):
                yield f"{path}.{attr}", member
        return
    obj = getattr(obj, "__func__", obj)
    yield path, getattr(obj, "fn", obj)  # a @triton.jit kernel keeps its Python function as .fn


def resolve(path: str):
    """``a.b.C.f`` → the object, importing the longest module prefix."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _stand_in(path: str, function: types.FunctionType) -> _Guarded:
    """Swap ``function``'s code for one that asks the dispatcher: same free variables (so the
    function's closure still fits), same name, any arguments."""
    code = function.__code__
    implementation = types.FunctionType(code.replace(co_name="_graded", co_qualname="_graded"),
                                        function.__globals__, "_graded", function.__defaults__,
                                        function.__closure__)  # fmt: skip
    implementation.__kwdefaults__ = function.__kwdefaults__
    before = vars(function).get("__signature__", _NONE)
    try:
        function.__signature__ = inspect.signature(function)  # what a reader of the signature still sees
    except (TypeError, ValueError):
        pass
    free, name = code.co_freevars, code.co_name
    lines = ["def _outer():", *(f"    {var} = None" for var in free), f"    def {name}(*args, **kwargs):"]
    if free:  # the stub names the same free variables, so the function's closure still fits it
        lines.append(f"        ({', '.join(free)},)")
    lines += [f"        return {DISPATCH}({path!r}, args, kwargs)", f"    return {name}"]
    namespace: dict = {}
    exec(compile("\n".join(lines) + "\n", code.co_filename, "exec"), namespace)  # noqa: S102 - our own stub
    stub = namespace["_outer"]().__code__.replace(co_firstlineno=code.co_firstlineno, co_qualname=code.co_qualname)
    if stub.co_freevars != free:
        raise RuntimeError(f"internal: the stand-in for {path} does not fit its closure")
    function.__code__ = stub
    method = "." in function.__qualname__ and "<locals>" not in function.__qualname__
    return _Guarded(path, function, code, implementation, before, method)


def _culprit(frame, method_args: tuple | None) -> str | None:
    """Whom a call of an answer from ``frame`` is for: the learner (named), or None (the package).
    ``method_args``: a method's arguments, whose first may be an instance of the learner's class."""
    culprit = _learner_on_stack(frame) or (_learner_class(method_args) if method_args is not None else None)
    if culprit is None and LEARNER_CALLS.depth:  # no frame of theirs, but their call is running
        culprit = "code running for your function (a partial, a finalizer, code renamed as the package's)"
    return culprit


def _keep(attempts: list[str], attempt: str) -> None:
    if attempt not in attempts:
        attempts.append(attempt)


def _learner_on_stack(frame) -> str | None:
    """Who to blame when the package's answer should refuse this call: a learner's cell on the
    stack (``"cell N"``), or — no package code on it at all — the thread that called it (a
    learner's thread, a pool's worker). ``None``: the package's own call."""
    package_seen = False
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith("<cell "):
            return filename[1:-1]
        if filename.startswith(_PACKAGE) and _is_module_code(frame):
            package_seen = True
        frame = frame.f_back
    return None if package_seen else "code on a thread the package did not start"


def _learner_class(args: tuple) -> str | None:
    """A method called on an instance (or class) of a class the learner's code defined — one that
    inherits the package's answer and adds no frame of its own: blamed on that class."""
    if not args:
        return None
    owner = args[0] if isinstance(args[0], type) else type(args[0])
    for cls in getattr(owner, "__mro__", ()):
        if getattr(cls, "__module__", None) == "__main__":  # the grader runs the learner's cells as __main__
            return f"your class {cls.__name__} (it inherits the package's code)"
    return None


def _is_module_code(frame) -> bool:
    """The frame runs a module of the package as loaded: its globals are that module's own
    (code compiled with a package file's name but run elsewhere does not count)."""
    name = frame.f_globals.get("__name__", "")
    module = sys.modules.get(name)
    return module is not None and getattr(module, "__dict__", None) is frame.f_globals and name.startswith("minillm")
