"""Compiled code from the cache runs only if this user wrote it: private folders, recorded hashes.

A compiled decode package (``.pt2``) and the C++ attention kernel (``.so``) are native code the
engine loads and runs. Whoever can replace one in the cache runs their own code in every later
engine — on a shared lab machine, or with a cache on a shared drive. So:

- the cache's code folders are created private (mode 0700), and a folder that another user
  could write to — group- or world-writable, or owned by someone else — is refused with an
  ``UnsafeCacheError`` naming it and the fix, before anything in it is loaded;
- each file's SHA-256 is recorded beside it when it is built (``NAME.sha256``) and checked
  before it is loaded: a file that does not match — replaced, truncated, or from before the
  record existed — is not loaded; it is deleted and built again.

Hashing a 330 MB package takes a fraction of a second (once per load, on the background
thread that loads it); loading it takes seconds anyway.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

SUFFIX = ".sha256"


class UnsafeCacheError(PermissionError):
    """A cache folder that holds code could be written by another user."""


def check_private(folder: Path) -> None:
    """Raise ``UnsafeCacheError`` if another user could write into ``folder`` (or its parent:
    whoever may write the parent may swap the folder for their own)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for path in (Path(folder), Path(folder).parent):
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        if uid is not None and info.st_uid != uid:
            raise UnsafeCacheError(
                f"{path} belongs to another user (uid {info.st_uid}), so compiled code in it cannot be trusted: "
                "set MINILLM_CACHE to a folder of your own"
            )
        if path == Path(folder) and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeCacheError(
                f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): anyone could replace the "
                f"compiled code it holds. Run `chmod 700 {path}` (or set MINILLM_CACHE to a private folder)"
            )
        if path != Path(folder) and info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
            raise UnsafeCacheError(
                f"{path} is writable by everyone without the sticky bit, so the folder {folder} inside it could be "
                "swapped for another: set MINILLM_CACHE to a private folder"
            )


def private_dir(folder: Path) -> Path:
    """``folder``, created private (0700) if missing, and checked (``check_private``)."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_private(folder)
    return folder


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def record(path: Path, as_: Path | None = None) -> None:
    """Write ``path``'s hash beside it (atomically): it was built here, by this user. ``as_``:
    the name the file is about to be renamed to (its record is written first)."""
    path, name = Path(path), Path(as_ or path)
    partial = name.with_name(f"{name.name}{SUFFIX}.{os.getpid()}.partial")
    partial.write_text(digest(path) + "\n")
    partial.replace(name.with_name(name.name + SUFFIX))


def verified(path: Path) -> bool:
    """Whether ``path`` is exactly the file recorded when it was built (``record``)."""
    path = Path(path)
    try:
        recorded = path.with_name(path.name + SUFFIX).read_text().strip()
    except OSError:
        return False
    return recorded == digest(path)


def forget(path: Path) -> None:
    """Delete ``path`` and its record."""
    path = Path(path)
    path.unlink(missing_ok=True)
    path.with_name(path.name + SUFFIX).unlink(missing_ok=True)
