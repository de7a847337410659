"""What minillm keeps on disk, and clearing it: ``minillm cache`` and ``minillm cache clean``.

The cache folder (``$MINILLM_CACHE``, else ``<repo>/.cache/minillm``) holds what can be made
again, at a cost: converted models (seconds), compiled decode packages (``compiled/``: a minute
or two each, and each holds a copy of its model's weights), inductor's compiler cache
(``inductor/``), machine probes (``machine/``), offloaded weights (``offload/``). The report
says how much each holds, so a learner whose disk fills up sees where it went; ``clean``
removes the compiled code (packages, the kernel's library, their records, inductor's cache)
and the files of compiles whose processes were killed — never the cache's key
(``trusted_cache.py``), which records still in use are keyed by — and with ``everything``
the rest too.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from minillm import trusted_cache
from minillm.assets import cache_dir
from minillm.runtime.compile_files import is_stale, sweep_stale, temporary_files

#: What each top-level entry of the cache holds; anything else is a converted model.
KNOWN = {
    "compiled": "compiled decode packages, the C++ kernel, their records",
    "inductor": "PyTorch inductor's compiler cache (the engine's own compiles)",
    "inductor-worker": "PyTorch inductor's compiler cache (the background compile worker's)",
    "machine": "this machine's measured choices",
    "offload": "weights offloaded to disk",
}
#: Removed by ``clean``: compiled code, which the engine builds again when it needs it.
COMPILED = ("compiled", "inductor", "inductor-worker")


@dataclass
class Entry:
    name: str
    what: str
    bytes: int
    files: int


def _size(path: Path) -> tuple[int, int]:
    """Bytes and files under ``path`` (symbolic links not followed)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size, 1
    total = files = 0
    for child in path.rglob("*"):
        if child.is_file() and not child.is_symlink():
            total, files = total + child.stat().st_size, files + 1
    return total, files


def report(root: Path | None = None) -> list[Entry]:
    """One ``Entry`` per top-level folder or file of the cache, largest first, and one for the
    temporary files of compiles (stale ones: their processes are gone)."""
    root = Path(root or cache_dir())
    if not root.is_dir():
        return []
    entries = []
    for path in sorted(root.iterdir()):
        size, files = _size(path)
        entries.append(Entry(path.name, KNOWN.get(path.name, "a converted model" if path.is_dir() else "a file"), size, files))
    entries.sort(key=lambda e: -e.bytes)
    temporary = temporary_files(root / "compiled")
    if temporary:
        stale = [p for p in temporary if is_stale(p)]
        size = sum(p.stat().st_size for p in temporary if p.exists())
        entries.append(Entry("compiled/ (temporary)", f"files of compiles in progress; {len(stale)} of them stale", size,
                             len(temporary)))  # fmt: skip
    return entries


def clean(root: Path | None = None, everything: bool = False) -> list[Path]:
    """Remove the compiled code (``COMPILED``) and stale compile files — with ``everything``,
    every entry of the cache; the paths removed. A compile running now keeps its files: a tree
    another process holds (``trusted_cache.holding``) is passed over, and so are a running
    compile's temporary files, the locks and the cache's key."""
    root = Path(root or cache_dir())
    if not root.is_dir():
        return []
    removed = sweep_stale(root / "compiled")
    for path in sorted(root.iterdir()):
        if not everything and path.name not in COMPILED:
            continue
        if path.is_dir() and not path.is_symlink() and path.name in COMPILED:
            if not everything:
                removed += _empty(path, keep=set(temporary_files(path)))
                continue
            with trusted_cache.holding(path, wait=False) as held:
                if not held:
                    print(f"{path}: a compile is running there; left as it is")
                    continue
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _empty(tree: Path, keep: set[Path]) -> list[Path]:
    """Everything in ``tree`` but ``keep``, its lock files and the key, unless another process
    holds it (then nothing, and it says so); the paths removed. Subfolders are trees of their
    own (``compiled/kernels``)."""
    removed: list[Path] = []
    with trusted_cache.holding(tree, wait=False) as held:
        if not held:
            print(f"{tree}: a compile is running there; left as it is")
            return removed
        for child in sorted(tree.iterdir()):
            if child in keep or child.suffix == ".lock" or child.name == trusted_cache.KEY_FILE:
                continue
            if child.is_dir() and not child.is_symlink():
                if (child / trusted_cache.LOCK_FILE).exists():
                    removed += _empty(child, keep)
                    continue
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child)
    return removed


def format_report(entries: list[Entry], root: Path | None = None) -> str:
    """The report as a table, with the total."""
    root = Path(root or cache_dir())
    if not entries:
        return f"{root}: empty"
    lines = [f"{root}:"]
    for e in entries:
        lines.append(f"  {e.bytes / 1e6:10.1f} MB  {e.files:6d} files  {e.name:<24} {e.what}")
    total = sum(e.bytes for e in entries if not e.name.endswith("(temporary)"))
    lines.append(f"  {total / 1e6:10.1f} MB  in all (`minillm cache clean` removes compiled code; --all everything)")
    return "\n".join(lines)
