"""The environment variables minillm reads or sets: declared here, and read and written only here.

An environment variable is an option set outside Python — for a whole machine (a cache folder on
a shared disk), a test suite (no compile by default), a process another one starts (a check
being graded, one rank of ``torchrun``), or a library we configure (inductor's cache, Triton's
interpreter, gloo's network interface). Declared in one table, each is documented, its value
comes with where it came from, and ``LLMEngine.resolved.environment`` names the ones that
decided something for that engine. ``python -m minillm.config`` prints the table.

Importing minillm sets nothing: what minillm sets (``set_default``, never over a value the user
chose) is set when it is needed — when an engine is built, when Triton is first used, when a
server starts, when a rank joins its group.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EnvOption:
    """One environment variable: its default (None: unset means "not given") and what it does.
    ``secret``: its value is never printed (``describe`` says only that it is set)."""

    name: str
    default: str | None
    help: str
    secret: bool = False


OPTIONS: dict[str, EnvOption] = {
    o.name: o
    for o in (
        EnvOption("MINILLM_CACHE", None, "the folder for converted models, compiled decode steps and the choices "
                  "measured on this machine (default: <repo>/.cache/minillm in a checkout, else ~/.cache/minillm)"),
        EnvOption("MINILLM_COMPILE", "1", "0: compile=None (auto) leaves the decode step eager — for test suites "
                  "and classrooms that must not start a compile"),
        EnvOption("MINILLM_COMPILE_NICENESS", "19", "the background compiler's priority, 0 (normal) to 19 (lowest)"),
        EnvOption("MINILLM_API_KEY", None, "minillm serve: the API key clients must send (default for --api-key)",
                  secret=True),
        EnvOption("MINILLM_GRADING", None, "set by a grading run for the processes a learner's code starts: "
                  "names the check being graded"),
        EnvOption("MINILLM_GRADING_HIDE", None, "folders (os.pathsep-separated) a graded notebook must not read"),
        EnvOption("TORCHINDUCTOR_CACHE_DIR", None, "inductor's on-disk cache; set when an engine is built to "
                  "<MINILLM_CACHE>/inductor unless given, so a compile is paid once per machine"),
        EnvOption("TRITON_INTERPRET", None, "1: Triton kernels run in its interpreter; set when Triton is first "
                  "needed on a machine without CUDA (minillm/triton_setup.py)"),
        EnvOption("MINILLM_CPU_BF16_ROWS", "auto", "compiled graphs of several bf16 rows multiply through minillm's "
                  "AVX-512 BF16 kernel (layers/cpu_bf16_rows.py): auto (a CPU with AVX-512 BF16 and no AMX), "
                  "1 (any CPU with AVX-512 BF16), 0 (never)"),
        EnvOption("ATEN_CPU_CAPABILITY", None, "PyTorch's CPU instruction-set override; the C++ decode kernel then "
                  "leaves the choice to inductor too"),
        EnvOption("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None, "oneDNN's kernel cache; a server bounds it (256) "
                  "unless given (server/heap.py)"),
        EnvOption("LRU_CACHE_CAPACITY", None, "PyTorch's oneDNN kernel cache; bounded like the one above"),
        EnvOption("GLOO_SOCKET_IFNAME", None, "gloo's network interface; a parallel engine's ranks use the loopback "
                  "interface unless given"),
        EnvOption("NCCL_SOCKET_IFNAME", None, "NCCL's network interface; as for gloo"),
        EnvOption("TORCHELASTIC_RUN_ID", None, "set by torchrun: this process is one rank of a parallel engine"),
        EnvOption("WORLD_SIZE", "1", "set by torchrun: how many ranks"),
        EnvOption("RANK", "0", "set by torchrun: this process's rank"),
        EnvOption("LOCAL_RANK", None, "set by torchrun: this rank's GPU on its host"),
        EnvOption("MINILLM_GRADE_LOG", None, "a file each check's verdict is appended to (set by the grader)"),
        EnvOption("LD_LIBRARY_PATH", None, "the dynamic linker's path: llama.cpp's tools get their own folder first"),
    )
}

_SET_HERE: dict[str, str] = {}  # what set_default set in this process (for ``describe``)


def _option(name: str) -> EnvOption:
    if name not in OPTIONS:
        raise KeyError(f"{name} is not a declared environment variable (minillm/config/environment.py)")
    return OPTIONS[name]


def get(name: str) -> str | None:
    """The variable's value, or its default when unset (or set to the empty string)."""
    option = _option(name)  # an undeclared (or misspelt) name fails whether or not it is set
    value = os.environ.get(name)
    return value if value else option.default


def is_set(name: str) -> bool:
    """Whether the environment gives ``name`` a value (the user's, or one ``set_default`` set)."""
    _option(name)
    return bool(os.environ.get(name))


def source(name: str) -> str:
    """Where ``get(name)`` comes from: "set by minillm", "environment", or "default"."""
    if not is_set(name):
        return "default"
    return "set by minillm" if _SET_HERE.get(name) == os.environ[name] else "environment"


def set_default(name: str, value: str) -> bool:
    """Set ``name`` for this process and the ones it starts, unless the environment already gives
    it a value (the user's choice wins). True if it was set here."""
    if is_set(name):
        return False
    os.environ[name] = _SET_HERE[name] = value
    return True


@contextlib.contextmanager
def scoped(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` inside the ``with`` (for the processes started there too), and
    removed again on the way out."""
    _option(name)
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)


def for_children(**extra: str) -> dict[str, str]:
    """This process's whole environment, plus ``extra``: what a process it starts is given."""
    return {**os.environ, **extra}


def adopt(env: dict[str, str]) -> None:
    """Replace this process's environment by ``env`` (a worker taking its driver's, first thing)."""
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)


def describe() -> str:
    """The declared variables that are set, each with its value and source, e.g.
    ``MINILLM_COMPILE=0 (environment); TORCHINDUCTOR_CACHE_DIR=... (set by minillm)``."""
    parts = [f"{n}={'<set>' if o.secret else os.environ[n]} ({source(n)})" for n, o in OPTIONS.items() if is_set(n)]
    return "; ".join(parts) or "none set"


def choose_triton_mode() -> None:
    """Without CUDA, Triton's kernels run only in its interpreter, and the switch must be set
    before triton is first imported — which torch does by itself (``torch._dynamo`` and
    ``torch._inductor`` import it: a compile, the C++ decode kernel's build). So an engine's
    set-up, the parallel workers' fork server and ``minillm.triton_setup`` each set it first
    (unless the environment chose), without importing triton."""
    if not torch.cuda.is_available():
        set_default("TRITON_INTERPRET", "1")


def table() -> str:
    """The declared variables as plain text: name, default, what it does."""
    return "\n".join(f"{o.name} (default: {o.default or 'unset'})\n    {o.help}" for o in OPTIONS.values())
