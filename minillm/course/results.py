"""How checks report: a printed verdict for the learner, a JSON line for the grader.

Each check ends in one of three states. *pass*: a sentence saying what now works.
*fail*: a ``CheckFailed`` (an ``AssertionError``) whose message says what is wrong, where, and
a hint — raised, so the cell turns red, but shown as one short red line (and, when the learner's
code raised, only the learner's own frames) rather than a traceback through the package.
*not attempted*: the learner's function still raises ``NotImplementedError``; we say so quietly
and the notebook carries on.

A check must never blame the learner for its own bug. The learner's functions are wrapped as
they enter a check (``LearnerRaised`` marks an exception that came out of them); any other
exception inside a check is the check's fault and is reported as "the check itself failed —
please report", with the exception.

When ``MINILLM_GRADE_LOG`` names a file, every verdict is also appended to it as a JSON line
(a record for the learner's own tools). The grader does not trust that file: notebook code can
write to it. It reads verdicts from the check cells it restored and ran itself (``graded``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NoReturn

from minillm.config import environment
from minillm.course.records import record_pass

GRADE_LOG_ENV = "MINILLM_GRADE_LOG"
PASS, FAIL, NOT_ATTEMPTED, CHECK_ERROR = "pass", "fail", "not attempted", "check error"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RED, _RESET = "\x1b[31m", "\x1b[0m"


class CheckFailed(AssertionError):
    """The learner's code ran but produced the wrong thing; the message says what and where.

    In a notebook it renders as one red line (``_render_traceback_`` is IPython's hook for
    that), then the ``diagram`` — the spec drawn against the learner's answer, as visual puzzle
    courses show a failed test — when the check drew one, then the learner's own frames when
    their code raised. The diagram is for the learner's eyes: the grade records the message."""

    check: str = ""
    learner_frames: list[str] | tuple = ()

    def __init__(self, message: str = "", diagram: str = ""):
        super().__init__(message)
        self.diagram = diagram

    def _render_traceback_(self) -> list[str]:
        head = f"{_RED}❌ {self.check or 'check'}: {self}{_RESET}"
        return [head, *self.diagram.splitlines(), *self.learner_frames]


class CheckError(CheckFailed):
    """The check itself crashed: not the learner's fault, reported as such."""


class LearnerRaised(Exception):
    """An exception that came out of the learner's function (its ``__cause__``)."""


def _is_learner_frame(filename: str) -> bool:
    """A frame of code the learner wrote: not this package, not an installed library."""
    path = os.path.abspath(filename)
    if path.startswith(_PACKAGE_DIR + os.sep) or "site-packages" in path:
        return False
    libs = {os.path.dirname(os.__file__), sys.prefix, sys.base_prefix}
    return not any(path.startswith(lib + os.sep) for lib in libs if lib)


def learner_frames_of(err: BaseException) -> list[str]:
    """The learner's own frames of ``err``'s traceback (the last 5), formatted: what a failure
    caused by the learner's exception shows under its one red line — never the package's."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if _is_learner_frame(f.filename)]
    return traceback.format_list(frames[-5:])


class _LearnerCalls(threading.local):
    """How many of the learner's functions are running on this thread (``learner_function``): while
    one is, even code with no frame of the learner's on the stack — a ``functools.partial``, a
    finalizer firing as the learner's frame ends — runs for the learner (``guard.py`` reads it)."""

    depth = 0


LEARNER_CALLS = _LearnerCalls()


def learner_function(fn: Callable) -> Callable:
    """Wrap one of the learner's functions so that what it raises is known to be theirs (and,
    while it runs, the thread counts as running the learner's code: ``LEARNER_CALLS``)."""
    if getattr(fn, "minillm_learner", False) or not callable(fn):
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        LEARNER_CALLS.depth += 1
        try:
            return fn(*args, **kwargs)
        except (CheckFailed, LearnerRaised):
            raise
        except Exception as err:
            raise LearnerRaised(f"{type(err).__name__}: {err}") from err
        finally:
            LEARNER_CALLS.depth -= 1

    call.minillm_learner = True  # marks the wrapper, so a check handed it again does not wrap it twice
    return call


@contextlib.contextmanager
def time_limit(seconds: float, message: str):
    """Fail with ``message`` when the code inside runs longer than ``seconds`` — a learner's loop
    that never ends would otherwise hang the check (and the notebook). It uses the process's
    real-time timer (SIGALRM), so it works in the main thread of a Unix process (a notebook
    cell, the grader) and limits nothing elsewhere. A timer already running outside is resumed
    with what was left of it."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def stop(signum, frame):
        raise CheckFailed(message)

    outer, _ = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer) if outer else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 0.001))


def learner_cause(err: BaseException) -> BaseException | None:
    """The learner's original exception if ``err`` came out of their code (possibly re-wrapped
    by the engine or Triton's interpreter on the way out), else None."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, LearnerRaised):
            return err.__cause__
        err = err.__cause__ or err.__context__
    return None


@dataclass
class CheckResult:
    check: str
    status: str
    message: str
    #: Set by the grader for a check graded in its fresh process: ``"answers hidden"``, or
    #: ``"answers NOT hidden: <why>"`` where the machine would not let it hide the solved notebooks.
    sandbox: str | None = None

    def _ipython_display_(self) -> None:
        """Show nothing when a check is the last line of a cell: its verdict is already printed."""


#: The MIME type of a verdict a graded check cell displays (``graded``); the grader reads only these.
VERDICT_MIME = "application/vnd.minillm.verdict+json"
_latest: dict[str, CheckResult] = {}  # each check's most recent verdict in this kernel


@contextlib.contextmanager
def graded(name: str, nonce: str):
    """Wraps a check cell the grader restored: afterwards, display the verdict of check ``name``
    under the grader's one-time ``nonce`` (a verdict printed or logged elsewhere does not count)."""
    _latest.pop(name, None)
    try:
        yield
    except BaseException as err:
        if not isinstance(err, CheckFailed) or name not in _latest:  # a check's own failure is already recorded
            _latest[name] = CheckResult(name, FAIL, f"the check cell raised {type(err).__name__}: {err}")
        raise
    finally:
        from IPython.display import display

        result = _latest.get(name, CheckResult(name, NOT_ATTEMPTED, "the check cell ran but the check did not report"))
        display({VERDICT_MIME: {"nonce": nonce, **asdict(result)}}, raw=True)


def _record(result: CheckResult) -> None:
    _latest[result.check] = result
    path = environment.get(GRADE_LOG_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(asdict(result)) + "\n")


def _not_implemented(err: BaseException) -> bool:
    """Is this the skeleton's ``raise NotImplementedError()`` — possibly wrapped, as Triton's
    interpreter wraps errors raised inside a kernel (and its compiler reports them by name)?"""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, NotImplementedError):
            return True
        if type(err).__name__ in ("InterpreterError", "CompilationError") and "NotImplementedError" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _failed(name: str, err: Exception) -> NoReturn:
    """A wrong answer (``CheckFailed``), a crash in the learner's code, or a crash of the check
    itself: record which, and raise a ``CheckFailed`` that renders as one short line."""
    if isinstance(err, CheckFailed):
        err.check = name
        _record(CheckResult(name, CHECK_ERROR if isinstance(err, CheckError) else FAIL, str(err)))
        raise err.with_traceback(None) from None
    cause = learner_cause(err)
    if cause is not None:
        failure = CheckFailed(f"your code raised {type(cause).__name__}: {cause}")
        failure.learner_frames = learner_frames_of(cause)
        status = FAIL
    else:
        failure = CheckError(
            f"the check itself failed — please report this (it is not your code's fault): {type(err).__name__}: {err}"
        )
        status = CHECK_ERROR
    failure.check = name
    _record(CheckResult(name, status, str(failure)))
    raise failure from err


def _refuse_package_functions(args) -> None:
    """A check grades the learner's function; passing the package's own implementation (or a
    library function) would grade minillm instead."""
    for fn in args:
        module = getattr(fn, "__module__", None) or ""
        if callable(fn) and (module == "minillm" or module.startswith(("minillm.", "torch", "triton"))):
            raise CheckFailed(
                f"you passed {getattr(fn, '__qualname__', fn)!r} from {module}, not a function you wrote: "
                "pass the function this exercise asks you to complete"
            )


def _refuse_library_answers(check_name: str, args) -> None:
    """A learner's function that names a library function computing the exercise's whole answer
    (``exercises.LIBRARY_ANSWERS``: torch's fused attention for causal attention) is told so."""
    import inspect

    from minillm.course.exercises import LIBRARY_ANSWERS

    names = {attr for _, attr in LIBRARY_ANSWERS.get(check_name, ())}
    for fn in args:
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
        used = sorted(n for n in names if n in source)
        if used:
            raise CheckFailed(f"your {getattr(fn, '__name__', 'function')} calls torch's {used[0]}, which computes "
                              "this exercise's whole answer: write the computation yourself")  # fmt: skip


def check(func: Callable[..., str]) -> Callable[..., CheckResult]:
    """Turn ``func`` (returns a success sentence, raises ``CheckFailed``) into a reporting check."""

    @functools.wraps(func)
    def run(*args, **kwargs) -> CheckResult:
        name = func.__name__
        given = [a for a in args if callable(a)]  # as the learner wrote them (kept in your_engine/ on a pass)
        try:
            _refuse_package_functions(args)
            _refuse_library_answers(name, args)
            args = tuple(learner_function(a) if callable(a) else a for a in args)
            message = func(*args, **kwargs)
        except CheckFailed as err:
            return _failed(name, err)
        except Exception as err:
            if not _not_implemented(err):
                return _failed(name, err)
            result = CheckResult(name, NOT_ATTEMPTED, "not attempted yet: replace `raise NotImplementedError()`")
            _record(result)
            print(f"⏭  {name}: {result.message}")
            return result
        result = CheckResult(name, PASS, message)
        _record(result)
        record_pass(name, given)
        print(f"✅ {name}: {message}")
        return result

    return run


def require_pass(name: str) -> None:
    """Raise unless check ``name``'s latest verdict in this kernel is *pass*.

    This is the hidden test of a check cell in an nbgrader source notebook
    (``minillm course nbgrader-source``). nbgrader gives a test cell that does not raise full
    points, and a check that is not attempted does not raise (so a student notebook runs top to
    bottom); the call after the check makes "not attempted" (or a check that never ran) worth
    no points. A failed check has raised already, before this runs."""
    result = _latest.get(name)
    if result is None or result.status != PASS:
        why = "it never reported a verdict" if result is None else result.message
        err = CheckFailed(f"no points: {name} did not pass — {why}")
        err.check = name
        raise err
