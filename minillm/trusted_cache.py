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
import hashlib
import hmac
import os
import secrets
import stat
import time
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
    """``folder``, created private (0700) if missing — every missing level, not only the last
    (``mkdir(parents=True)`` gives the others the umask's mode: 0775 under 002) — and checked
    (``check_private``). A folder of ours strictly inside the cache folder that others could
    write to (made by an older minillm, or by inductor, with the umask's mode) is closed first."""
    folder = Path(folder)
    missing = []
    for level in (folder, *folder.parents):
        if level.exists():
            break
        missing.append(level)
    for level in reversed(missing):
        level.mkdir(mode=0o700, exist_ok=True)
    if _in_cache(folder):
        _close_ifis_minillms_inductor_folder(folder)
    check_private(folder)
    return folder


def _in_cache(folder: Path) -> bool:
    root = cache_dir().resolve()
    resolved = Path(folder).resolve()
    return resolved != root and resolved.is_relative_to(root)


def _close_ifis_minillms_inductor_folder(folder: Path) -> None:
    """``chmod go-w`` a folder of ours: it sits in a private tree, and whatever another user might
    have put in it before has no record keyed by this cache's secret, so it is never loaded."""
    try:
        info = folder.lstat()
    except FileNotFoundError:
        return
    uid = os.getuid() if hasattr(os, "getuid") else None
    if stat.S_ISDIR(info.st_mode) and (uid is None or info.st_uid == uid) and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        try:
            folder.chmod(stat.S_IMODE(info.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
        except FileNotFoundError:
            return
        except OSError as error:
            raise UnsafeCacheError(
                f"{folder} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}) and could not be closed "
                f"({error}): run `chmod -R go-w {folder}` (or set MINILLM_CACHE to a private folder)"
            ) from None


def check_tree(root: Path, close: bool = True) -> None:
    """``check_private(root)``, then every folder beneath it: none owned by another user, none
    that others could write to, and no symbolic link that leads out of ``root``. A folder of
    ours that others could write to is closed (``chmod go-w``: inductor makes its folders with
    the umask's mode) — with ``close`` False (a folder the user chose) it is refused. Raises
    ``UnsafeCacheError`` naming the first offender. Files and folders that vanish while it looks
    (another process's temporary files) are passed over."""
    root = Path(root)
    if not root.exists():
        return
    check_private(root)
    top = root.resolve()
    uid = os.getuid() if hasattr(os, "getuid") else None
    for folder, subfolders, files in os.walk(root):  # does not follow links into other trees
        for name in subfolders + files:
            path = Path(folder) / name
            try:
                info = path.lstat()
                if stat.S_ISLNK(info.st_mode) and not path.resolve().is_relative_to(top):
                    raise UnsafeCacheError(
                        f"{path} is a symbolic link to {os.readlink(path)}, out of {root}: code loaded through it "
                        f"could be anyone's. Remove it (or set MINILLM_CACHE to a private folder)"
                    )
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(info.st_mode):
                continue
            if uid is not None and info.st_uid != uid:
                raise UnsafeCacheError(
                    f"{path} belongs to another user (uid {info.st_uid}), so compiled code in it cannot be trusted: "
                    f"remove it (or set MINILLM_CACHE to a folder of your own)"
                )
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                if not close:
                    raise UnsafeCacheError(
                        f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}): anyone could put "
                        f"code in it. Run `chmod -R go-w {root}`"
                    )
                _close_ifis_minillms_inductor_folder(path)


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


def record_of(path: Path) -> Path:
    """Where ``path``'s record is kept."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def forget(path: Path) -> None:
    """Delete ``path`` and its record."""
    path = Path(path)
    path.unlink(missing_ok=True)
    path.with_name(path.name + SUFFIX).unlink(missing_ok=True)


INDUCTOR_FOLDERS = ("inductor", "inductor-worker")  # minillm's: the engine process's, the compile worker's


def inductor_cache() -> Path | None:
    """Inductor's on-disk cache folder, as this process's inductor will use it (None: unset)."""
    folder = environment.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(folder) if folder else None


def is_minillms_inductor_folder(folder: Path) -> bool:
    """Whether ``folder`` is one of minillm's folders for inductor (not one the user chose)."""
    return any(Path(folder).resolve() == (cache_dir() / name).resolve() for name in INDUCTOR_FOLDERS)


@contextlib.contextmanager
def holding(root: Path, wait: bool = True) -> Iterator[bool]:
    """Inside the ``with``, this process alone sweeps, builds in and records ``root`` (an
    exclusive lock on a file in it, ``LOCK_FILE``): one process's sweep must not delete what
    another has built but not yet recorded. With ``wait`` False it yields False at once if
    another process holds the tree (True: held)."""
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


def _unrecorded_or_changed(root: Path) -> list[Path]:
    """Every file in ``root`` (but records, locks, the key) that does not verify."""
    return [path for path in native_files(root, None) if not verified(path)]


def _forget_orphan_records(root: Path) -> None:
    for folder, _, files in os.walk(root):
        for name in files:
            if name.endswith(SUFFIX) and not (Path(folder) / name[: -len(SUFFIX)]).exists():
                (Path(folder) / name).unlink(missing_ok=True)


@contextlib.contextmanager
def inductor_session() -> Iterator[None]:
    """A compile in this process from start to end, with the tree to itself (the compile worker,
    whose folder is its own, ``<cache>/inductor-worker``, and whose compiles run one at a time):
    every folder checked, every file nobody recorded deleted first — inductor builds again what
    it needs rather than load a library, a generated module or a cached graph (a pickle: loading
    one runs code) that this cache did not write — and, when the compile succeeds, every file it
    wrote or rewrote recorded. A folder the user chose is checked folder by folder, but its
    files are the user's: none is deleted or recorded."""
    folder = inductor_cache()
    if folder is None or not is_minillms_inductor_folder(folder):
        if folder is not None:
            check_tree(folder, close=False)
        yield
        return
    with holding(folder):
        sweep_unrecorded(folder, None)
        _forget_orphan_records(folder)
        yield
        for path in _unrecorded_or_changed(folder):  # new, and rewritten in place (inductor's autotune cache)
            record(path)


_SHARED: dict[Path, object] = {}  # tree -> the open lock file this process holds shared until it exits


def guard_inductor() -> list[Path]:
    """Before ``torch.compile`` runs in this process (it compiles lazily, at its first calls, so
    it cannot hold a tree to itself): if no other process is compiling in minillm's folder for
    inductor, sweep it as ``inductor_session`` does; either way keep a shared lock on it until
    this process exits — no other process sweeps it meanwhile — and record at exit what was
    written since. Once per process and folder (a second engine must not sweep the first's
    unrecorded files). The paths deleted."""
    folder = inductor_cache()
    if folder is None or not is_minillms_inductor_folder(folder):
        if folder is not None:
            check_tree(folder, close=False)
        return []
    folder = private_dir(folder)
    if folder in _SHARED:
        return []
    handle = open(folder / LOCK_FILE, "a")  # noqa: SIM115 (held until exit, closed by the kernel then)
    removed = []
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        removed = sweep_unrecorded(folder, None)
        _forget_orphan_records(folder)
    except BlockingIOError:
        check_tree(folder)  # another process compiles here (it swept first): look, delete nothing
    fcntl.flock(handle, fcntl.LOCK_SH)
    _SHARED[folder] = handle
    started = time.time()
    atexit.register(_record_written_since, folder, started)
    return removed


def _record_written_since(folder: Path, since: float) -> None:
    """At exit: record the files this process's compiles wrote (those written after its guard)."""
    for path in native_files(folder, None):
        try:
            if path.stat().st_mtime >= since - 1 and not verified(path):
                record(path)
        except OSError:
            continue
