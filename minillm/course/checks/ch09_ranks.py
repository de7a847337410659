"""Running a learner's function on tensor-parallel ranks (chapter 09's checks): from its source
code, with its errors reported as the learner's and a hung collective cut off."""

from __future__ import annotations

import inspect
import math
import textwrap

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.course.results import CheckFailed

TIMEOUT_S = 120.0  # per run of the ranks: spawning and loading take seconds, a hang is cut off


class _InLearner(Exception):
    """Raised on a rank when the learner's code raised there; its message is the learner's error."""


def source_of(fn, what: str) -> str:
    """The learner's function as text, to be run on the ranks (they cannot unpickle a notebook's function)."""
    name = getattr(fn, "__name__", "")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        source = ""
    if not source or name == "<lambda>" or not name.isidentifier():
        raise CheckFailed(
            f"the ranks run your {what} from its source code, and there is none for {fn!r:.60}: define it with "
            f"`def {what}(...):` in a notebook cell (not a lambda, not built by another function)"
        )
    return source


def learner_fn_from_source(source: str, name: str):
    """On a rank: define the learner's function again from its source (with the usual imports)."""
    space = {"torch": torch, "F": F, "dist": dist, "math": math}
    exec(compile(source, f"<your {name}>", "exec"), space)  # the learner's own code, in a namespace of its own
    return space[name]


def as_learner(call, *args):
    """On a rank: run learner code; what it raises is reported as the learner's."""
    try:
        return call(*args)
    except Exception as err:
        raise _InLearner(f"{type(err).__name__}: {err}") from None


def run_on_ranks(child, world: int, *args, hints: dict[str, str] | None = None) -> list:
    """``run_ranks`` with its failures turned into verdicts: the learner's error as a CheckFailed
    (with the rank, and a hint chosen by what the error says), a collective that not every rank
    joined as just that."""
    from minillm.parallel.launch import RankFailed, run_ranks

    collective = (
        "every rank must make the same collective calls in the same order: call all_reduce on every rank, "
        "not only on some"
    )
    try:
        return run_ranks(child, world, *args, timeout=TIMEOUT_S)
    except RankFailed as err:
        first = str(err).split("\n", 1)[0]
        if "_InLearner: " not in first:
            raise
        message = first.split("_InLearner: ", 1)[1]
        if message.startswith("NotImplementedError"):  # the skeleton, on the ranks: not attempted yet
            raise NotImplementedError(message) from None
        # gloo, when the other ranks returned while this one waited: the peer closed the connection or,
        # depending on timing (a loaded machine), reset it
        if "Connection closed by peer" in message or "Connection reset by peer" in message:
            raise CheckFailed(
                f"rank {err.rank} waited in a collective the other ranks never joined: {collective}"
            ) from None
        hints = {"NameError": NAME_HINT, **(hints or {})}
        hint = next((h for key, h in hints.items() if key in message), "")
        raise CheckFailed(
            f"on rank {err.rank} your code raised {message}" + (f". Hint: {hint}" if hint else "")
        ) from None
    except TimeoutError as err:
        raise CheckFailed(f"{err}: {collective}") from None


NAME_HINT = (
    "only the function's own source runs on the ranks, with torch, F, dist and math imported: "
    "define helpers and imports inside it"
)


class AllReduceWatch(TorchDispatchMode):
    """Sees every collective the learner's code makes, however it is spelled (``dist.all_reduce``,
    ``torch.distributed.all_reduce``, a process group's own method): each reaches PyTorch's
    dispatcher as a ``c10d`` operator (``c10d.allreduce_``, ``c10d.reduce_``, ...). Nothing is
    replaced; the all-reduces' shapes are recorded, and the names of the other collectives."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []
        self.others: list[str] = []  # the other collectives, as dist spells them: "reduce", "broadcast"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "allreduce" in name:
            tensors = args[0] if args and isinstance(args[0], (list, tuple)) else args[:1]
            self.shapes += [tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor)]
        elif name.startswith("c10d."):
            op = name.split(".")[1].strip("_")
            self.others.append(_COLLECTIVE_NAMES.get(op, op))
        return func(*args, **(kwargs or {}))


#: c10d operator names that ``torch.distributed`` spells otherwise.
_COLLECTIVE_NAMES = {"allgather": "all_gather", "allgather_base": "all_gather_into_tensor",
                     "reduce_scatter_base": "reduce_scatter_tensor", "alltoall": "all_to_all"}  # fmt: skip
