"""Compiled code from the cache runs only if this user built it: private folders, keyed records.

Compiled decode packages (``.pt2``), the C++ attention kernel (``.so``) and inductor's own
libraries (its compiled kernels and the probe programs it loads to pick an instruction set)
are native code the engine, or its compile worker, loads and runs. Whoever can put a file of
their own in the cache runs their code in every later engine — on a shared lab machine, or with
a cache on a shared drive. So:

- every folder of the cache's code trees is checked, not only the top ones (``check_tree``):
  created private (mode 0700), and a folder another user could write to — group- or
  world-writable, or owned by someone else — or a symbolic link that leads out of the tree is
  refused with an ``UnsafeCacheError`` naming it and the fix, before anything in it is loaded;
- each file's record (``NAME.sha256``) is written when the engine builds it, and checked
  before it is loaded: a file that does not match — replaced, truncated, or with no record at
  all — is never loaded; it is deleted and built again (``sweep_unrecorded`` before inductor
  runs; ``verified`` before a package or the kernel loads). A record is an HMAC of the file
  keyed by a secret of this cache (``compiled/trust.key``, mode 0600, made on first use): a file planted
  beside a record its planter computed — a plain SHA-256 — does not match.

What it does not protect against: anyone who can write as this user (the key, the records, the
code alike), and code outside the cache (PyTorch itself, Triton's own cache on a GPU,
``~/.triton``). Hashing a 330 MB package takes a fraction of a second (once per load, on the
background thread that loads it).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from minillm.assets import cache_dir
from minillm.config import environment

SUFFIX = ".sha256"
KEY_FILE = "trust.key"
LOCK_FILE = "minillm-tree.lock"  # held by the process sweeping, building in and recording a tree
RECORD_PREFIX = "hmac-sha256:"  # records written before keyed ones (plain SHA-256) no longer match
NATIVE = (".so", ".pt2")  # what a loader would run


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


def check_tree(root: Path) -> None:
    """``check_private(root)``, then every folder beneath it: none owned by another user, none
    that others could write to (one of ours is closed: ``chmod go-w``), and no symbolic link
    that leads out of ``root``. Raises ``UnsafeCacheError`` naming the first offender."""
    root = Path(root)
    if not root.exists():
        return
    check_private(root)
    top = root.resolve()
    uid = os.getuid() if hasattr(os, "getuid") else None
    for folder, subfolders, files in os.walk(root):  # does not follow links into other trees
        for name in subfolders + files:
            path = Path(folder) / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                if not path.resolve().is_relative_to(top):
                    raise UnsafeCacheError(
                        f"{path} is a symbolic link to {os.readlink(path)}, out of {root}: code loaded through it "
                        f"could be anyone's. Remove it (or set MINILLM_CACHE to a private folder)"
                    )
                continue
            if not stat.S_ISDIR(info.st_mode):
                continue
            if uid is not None and info.st_uid != uid:
                raise UnsafeCacheError(
                    f"{path} belongs to another user (uid {info.st_uid}), so compiled code in it cannot be trusted: "
                    f"remove it (or set MINILLM_CACHE to a folder of your own)"
                )
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                # Ours, inside a private root: inductor makes its folders with the umask's mode (0775
                # under a umask of 002). Closed now; whatever another user might have put in it
                # before has no record keyed by this cache's secret, and is never loaded.
                try:
                    path.chmod(stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
                except OSError as error:
                    raise UnsafeCacheError(
                        f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}) and could not be "
                        f"closed ({error}): run `chmod -R go-w {root}` (or set MINILLM_CACHE to a private folder)"
                    ) from None


def _key() -> bytes:
    """This cache's secret (``<cache>/compiled/trust.key``, 32 random bytes; in the folder that
    is always private), made on first use."""
    root = private_dir(cache_dir() / "compiled")
    path = root / KEY_FILE
    if not path.exists():
        partial = root / f"{KEY_FILE}.{os.getpid()}.partial"
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        try:
            os.link(partial, path)  # atomic: two first starts agree on one key
        except FileExistsError:
            pass
        finally:
            partial.unlink(missing_ok=True)
    info = path.lstat()
    uid = os.getuid() if hasattr(os, "getuid") else None
    if stat.S_ISLNK(info.st_mode) or (uid is not None and info.st_uid != uid) or info.st_mode & 0o077:
        raise UnsafeCacheError(
            f"{path} must be a file of yours that no one else can read or write (mode 600): with it anyone could "
            f"sign code for this cache. Remove it (a new one is made, and the compiled code is built again)"
        )
    key = path.read_bytes()
    if len(key) < 32:
        raise UnsafeCacheError(f"{path} is not a key minillm wrote ({len(key)} bytes): remove it")
    return key


def digest(path: Path) -> str:
    """An HMAC-SHA256 of ``path``'s bytes under this cache's key."""
    h = hmac.new(_key(), digestmod=hashlib.sha256)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return RECORD_PREFIX + h.hexdigest()


def _fingerprint(path: Path) -> str:
    """What changes whenever the file does: its inode, size, and modification and change times
    (the change time cannot be set back by a user: a rewrite, a ``touch -d``, a rename all move it)."""
    info = os.stat(path)
    return f"{info.st_ino}:{info.st_size}:{info.st_mtime_ns}:{info.st_ctime_ns}"


def _seal(content: str, fingerprint: str) -> str:
    """The key's signature over a record's two parts: a record is unforgeable as a whole."""
    return hmac.new(_key(), f"{content} {fingerprint}".encode(), hashlib.sha256).hexdigest()


def record(path: Path, as_: Path | None = None) -> None:
    """Write ``path``'s record beside it (atomically): it was built here, by this user. ``as_``:
    the name the file is about to be renamed to (its record is written first).

    A record holds the file's keyed hash and its stat fingerprint, both sealed by the key: a
    file whose fingerprint is unchanged is verified without reading it again (the whole of
    inductor's tree is checked before each compile: hundreds of megabytes), one whose
    fingerprint moved is hashed in full."""
    path, name = Path(path), Path(as_ or path)
    before = _fingerprint(path)
    content = digest(path)
    fingerprint = _fingerprint(path) if _fingerprint(path) == before else "changed"
    partial = name.with_name(f"{name.name}{SUFFIX}.{os.getpid()}.partial")
    partial.write_text(f"{content} {fingerprint} {_seal(content, fingerprint)}\n")
    partial.replace(name.with_name(name.name + SUFFIX))


def verified(path: Path) -> bool:
    """Whether ``path`` is exactly the file recorded when it was built (``record``)."""
    path = Path(path)
    try:
        content, fingerprint, seal = path.with_name(path.name + SUFFIX).read_text().split()
        if not hmac.compare_digest(seal, _seal(content, fingerprint)):
            return False  # not a record this cache wrote
        if fingerprint == _fingerprint(path):
            return True  # untouched since it was recorded
        return hmac.compare_digest(content, digest(path))
    except UnsafeCacheError:
        raise  # the key itself is unsafe: the user must hear of it
    except (OSError, ValueError):  # no record, a malformed one, or the file gone meanwhile
        return False


def native_files(root: Path, suffixes: Iterable[str] | None = NATIVE) -> list[Path]:
    """The files under ``root`` (not through links) ending in one of ``suffixes`` — with None,
    every file but records, locks and the key: all that a loader there might read."""
    root = Path(root)
    if not root.is_dir():
        return []
    wanted = tuple(suffixes) if suffixes is not None else None

    def counts(name: str) -> bool:
        if wanted is not None:
            return name.endswith(wanted)
        return not (name.endswith((SUFFIX, ".lock", ".partial")) or name == KEY_FILE)

    return sorted(Path(folder) / name for folder, _, files in os.walk(root) for name in files
                  if counts(name) and not (Path(folder) / name).is_symlink())  # fmt: skip


def sweep_unrecorded(root: Path, suffixes: Iterable[str] | None = NATIVE) -> list[Path]:
    """Before anything under ``root`` may be loaded (by us, or by inductor, which loads whatever
    sits at the path it computes): check every folder (``check_tree``), and delete each library
    or package that is not the file recorded when it was built — the compiler builds it again.
    The paths deleted."""
    check_tree(root)
    removed = [path for path in native_files(root, suffixes) if not verified(path)]
    for path in removed:
        forget(path)
    return removed


def record_unrecorded(root: Path, suffixes: Iterable[str] | None = NATIVE) -> list[Path]:
    """After our own compile under ``root``: record every library or package it wrote (each one
    without a record; ``sweep_unrecorded`` removed any other before it ran). The paths recorded."""
    new = [path for path in native_files(root, suffixes) if not path.with_name(path.name + SUFFIX).exists()]
    for path in new:
        record(path)
    return new


def forget(path: Path) -> None:
    """Delete ``path`` and its record."""
    path = Path(path)
    path.unlink(missing_ok=True)
    path.with_name(path.name + SUFFIX).unlink(missing_ok=True)


def inductor_cache() -> Path | None:
    """Inductor's on-disk cache folder, as this process's inductor will use it (None: unset)."""
    folder = environment.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(folder) if folder else None


@contextlib.contextmanager
def holding(root: Path, wait: bool = True) -> Iterator[bool]:
    """Inside the ``with``, this process alone sweeps, builds in and records ``root`` (a lock file
    in it, ``LOCK_FILE``): one process's sweep must not delete what another has built but not yet
    recorded. With ``wait`` False it yields False at once if another process holds it (True:
    held)."""
    root = private_dir(root)
    with open(root / LOCK_FILE, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def guard_inductor(wait: bool = True) -> list[Path]:
    """Before inductor compiles or loads in this process: in the folder minillm chose for it
    (``<cache>/inductor``), every folder checked and every file nobody recorded deleted —
    inductor builds again what it needs rather than load a library, a generated module or a
    cached graph (a pickle: loading one runs code) that this cache did not write. A folder the
    user chose (``TORCHINDUCTOR_CACHE_DIR``) is checked folder by folder, but its files are the
    user's: none is deleted. With ``wait`` False and another process compiling there now (it
    swept first, under the lock), only the folders are checked. The paths deleted."""
    folder = inductor_cache()
    if folder is None:
        return []
    if folder != cache_dir() / "inductor":
        check_tree(folder)
        return []
    with holding(folder, wait) as held:
        if not held:
            check_tree(folder)
            return []
        return sweep_unrecorded(folder, None)


def record_inductor(wait: bool = True) -> list[Path]:
    """After inductor compiled in this process (``guard_inductor`` ran first): record the files
    it wrote in minillm's folder for it. The paths recorded (none if ``wait`` is False and
    another process holds the folder: the files stay unrecorded, and are built again later)."""
    folder = inductor_cache()
    if folder is None or folder != cache_dir() / "inductor" or not folder.is_dir():
        return []
    with holding(folder, wait) as held:
        return record_unrecorded(folder, None) if held else []


@contextlib.contextmanager
def inductor_session() -> Iterator[None]:
    """A compile in this process from start to end: inductor's folder guarded, held against
    other processes' sweeps, and what the compile wrote recorded when it succeeds (the compile
    worker: a minute or two)."""
    folder = inductor_cache()
    if folder is None or folder != cache_dir() / "inductor":
        guard_inductor()
        yield
        return
    with holding(folder):
        sweep_unrecorded(folder, None)
        yield
        record_unrecorded(folder, None)


@functools.cache
def record_inductor_at_exit() -> None:
    """``record_inductor`` when this process exits (once, however often it is asked): for
    ``torch.compile`` in the engine's own process, which compiles at its first calls. A process
    killed first leaves its files unrecorded, and the next ``guard_inductor`` deletes them."""
    atexit.register(record_inductor, False)
