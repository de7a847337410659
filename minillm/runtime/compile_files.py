"""The compile's temporary files: named after the process that owns them, gone when it is.

A background compile (``background_compile.py``) hands its worker two files — the job
(``job-PID-*.pkl``) and a copy of the engine's folded tensors (``tensors-PID-*.pt``: the model's
weights, 273 MB for SmolLM2-135M) — and the worker writes each package first as
``decode-*.PID.partial.pt2``, with its record as ``*.sha256.PID.partial``. Each is removed when
its job ends or fails; but a process killed outright (a notebook kernel restarted mid-compile,
SIGKILL, a power cut) runs no clean-up, and a review found 8 job files and 8 tensor copies, 2.4
GB, left in one cache after a morning of ordinary use. So every such file carries its owner's
process id, and ``sweep_stale`` — run at every engine start that uses the compiled step —
removes each whose owner is gone: no process with that id, or one that started after the file
was written (the id was reused). The worker also deletes its job files as soon as it has read
them, and its partial package when its parent dies (``compile_worker.py``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: Temporary compile files and the group holding their owner's process id.
OWNED = re.compile(r"^(?:job|tensors)-(\d+)-.*\.(?:pkl|pt)$|^.*\.(\d+)\.partial(?:\.pt2)?$")


def owned_prefix(kind: str) -> str:
    """The name prefix of a temporary file of ``kind`` ("job", "tensors") this process owns."""
    return f"{kind}-{os.getpid()}-"


def owner(path: Path) -> int | None:
    """The process id in a temporary compile file's name (None: not such a file)."""
    match = OWNED.match(Path(path).name)
    if match is None:
        return None
    return int(match.group(1) or match.group(2))


def _started(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), None if there is none. Linux reads
    ``/proc``; elsewhere a live process counts as started at the epoch (never younger than a file)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: whether the process exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0.0
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after the command name
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def is_stale(path: Path) -> bool:
    """Whether ``path`` is a temporary compile file whose owner is gone."""
    pid = owner(path)
    if pid is None:
        return False
    started = _started(pid)
    if started is None:
        return True
    try:
        written = Path(path).stat().st_mtime
    except FileNotFoundError:
        return False
    return started > written + 1.0  # the id was taken by a younger process (1 s: /proc's tick rounding)


def sweep_stale(folder: Path) -> list[Path]:
    """Remove the temporary compile files in ``folder`` whose owners are gone; the paths removed."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.iterdir():
        if path.is_file() and is_stale(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def own_partials(folder: Path) -> list[Path]:
    """This process's partial packages and records in ``folder`` (what a worker leaving early removes)."""
    return [p for p in Path(folder).glob(f"*.{os.getpid()}.partial*") if owner(p) == os.getpid()]


def temporary_files(folder: Path) -> list[Path]:
    """Every temporary compile file in ``folder``, stale or in use."""
    folder = Path(folder)
    return sorted(p for p in folder.iterdir() if owner(p) is not None) if folder.is_dir() else []
