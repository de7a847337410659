"""What the grading process can reach on disk: the answers hidden from it.

``hide_answers`` — the folders beside the package that hold answers (``solutions/``, the
``source/`` folder of an nbgrader course, ``tests/`` with its catalogue of right answers,
``.git/``) are covered by an empty, read-only file system in a mount namespace of the grading
process's own (Linux ``unshare``: directly as root, inside a user namespace as anyone else).
``hide_sources`` then empties the source files of the modules that define the exercise's
answers, once they are imported. The rest of the machine sees everything as before. Where the
kernel refuses (no namespaces in a container, another OS) nothing is hidden, and every row of
the grader's report says so. (The static scan of the learner's code is ``reach.py``; the
stand-ins for the answers in memory, ``guard.py``.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from pathlib import Path

from minillm.config import environment


def answer_folders() -> list[Path]:
    """The folders beside the package that hold answers: the solved notebooks (``solutions/``,
    an nbgrader course's ``source/``), the test suite's catalogue of right answers (``tests/``)
    and the repository's history (``.git/``) — in an instructor's checkout; none where the package
    alone is installed. ``MINILLM_GRADING_HIDE`` adds folders (``:``-separated), such as an
    nbgrader course kept elsewhere."""
    root = Path(__file__).resolve().parents[2]
    extra = [Path(p) for p in (environment.get("MINILLM_GRADING_HIDE") or "").split(os.pathsep) if p]
    candidates = [root / "solutions", root / "source", root / "tests", root / ".git", *extra]
    return [folder for folder in candidates if folder.is_dir()]


CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_RDONLY, MS_REC, MS_PRIVATE = 1, 16384, 1 << 18


def hide_answers(folders: list[Path] | None = None) -> str | None:
    """In this process (call it in the grading process, before any learner code): cover each of
    ``folders`` (default ``answer_folders()``) with an empty read-only file system, seen by this
    process and its children only. Returns None when done, or why it could not be done."""
    folders = answer_folders() if folders is None else folders
    if not hasattr(os, "getuid") or not Path("/proc/self/ns/mnt").exists():
        return "this system has no mount namespaces"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError as err:
        return f"no C library to ask ({err})"
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS if uid == 0 else CLONE_NEWUSER | CLONE_NEWNS
    if libc.unshare(flags) != 0:
        return f"the kernel refused a mount namespace ({os.strerror(ctypes.get_errno())})"
    if uid != 0:  # keep this user's own id inside the user namespace (files stay theirs)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            try:
                Path(f"/proc/self/{name}").write_text(text)
            except OSError:
                pass
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return f"the mounts could not be made private ({os.strerror(ctypes.get_errno())})"
    for folder in folders:
        target = str(folder).encode()
        if libc.mount(b"minillm-grading", target, b"tmpfs", MS_RDONLY, b"size=4k,mode=0555") != 0:
            return f"{folder} could not be covered ({os.strerror(ctypes.get_errno())})"
    _STATE["libc"] = libc
    return None


_STATE: dict = {}  # the C library, once ``hide_answers`` made this process's mounts its own
MS_BIND = 4096


def hide_sources(modules) -> str | None:
    """Cover the source files (and cached bytecode) of ``modules`` — already imported, so nothing
    needs them again — with an empty file, in this process's own mounts (``hide_answers`` first):
    the package's answers cannot be read back and run as a fresh copy. None when done, or why not."""
    import importlib.util

    libc = _STATE.get("libc")
    if libc is None:
        return "this process has no mounts of its own"
    for module in modules:
        source = getattr(module, "__file__", None)
        if not source or not source.endswith(".py"):
            continue
        for path in (source, importlib.util.cache_from_source(source)):
            if os.path.isfile(path) and libc.mount(b"/dev/null", path.encode(), None, MS_BIND, None) != 0:
                return f"{path} could not be covered ({os.strerror(ctypes.get_errno())})"
    return None
