"""How checks report: a printed verdict for the learner, a JSON line for the grader.

Each check ends in one of three states. *pass*: a sentence saying what now works.
*fail*: a ``CheckFailed`` (an ``AssertionError``) whose message says what is wrong, where, and
a hint — raised, so the cell turns red. *not attempted*: the learner's function still raises
``NotImplementedError``; we say so quietly and the notebook carries on.

When ``MINILLM_GRADE_LOG`` names a file, every verdict is also appended to it as a JSON line
(a record for the learner's own tools). The grader does not trust that file: notebook code can
write to it. It reads verdicts from the check cells it restored and ran itself (``graded``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NoReturn

GRADE_LOG_ENV = "MINILLM_GRADE_LOG"
PASS, FAIL, NOT_ATTEMPTED = "pass", "fail", "not attempted"


class CheckFailed(AssertionError):
    """The learner's code ran but produced the wrong thing; the message says what and where."""


@dataclass
class CheckResult:
    check: str
    status: str
    message: str

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
    path = os.environ.get(GRADE_LOG_ENV)
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
    """A wrong answer (``CheckFailed``) or a crash in the learner's code: record it and raise."""
    if isinstance(err, CheckFailed):
        _record(CheckResult(name, FAIL, str(err)))
        raise err
    message = f"your code raised {type(err).__name__}: {err}"  # the learner's code crashed
    _record(CheckResult(name, FAIL, message))
    raise CheckFailed(message) from err


def check(func: Callable[..., str]) -> Callable[..., CheckResult]:
    """Turn ``func`` (returns a success sentence, raises ``CheckFailed``) into a reporting check."""

    @functools.wraps(func)
    def run(*args, **kwargs) -> CheckResult:
        name = func.__name__
        try:
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
        print(f"✅ {name}: {message}")
        return result

    return run
