"""Compiled code loads only if this user built it (minillm/trusted_cache.py).

The attack from the field: replace a compiled package (or the C++ kernel's library) in the
cache, and the next engine start runs it. Now a replaced file is refused before it is loaded,
and a cache folder other users could write to is refused with the fix in the message.
"""

from __future__ import annotations

import os
import stat
import time

import pytest
import torch

from minillm import trusted_cache
from minillm.config import ModelConfig
from minillm.runtime.compiled_decode import CompiledDecode


def test_private_dir_is_created_0700(tmp_path):
    folder = trusted_cache.private_dir(tmp_path / "a" / "compiled")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_folder_others_can_write_is_refused_with_the_fix(tmp_path, mode):
    folder = tmp_path / "compiled"
    folder.mkdir()
    folder.chmod(mode)
    with pytest.raises(trusted_cache.UnsafeCacheError, match=f"chmod 700 {folder}"):
        trusted_cache.check_private(folder)


def test_a_world_writable_parent_needs_the_sticky_bit(tmp_path):
    parent = tmp_path / "shared"
    folder = trusted_cache.private_dir(parent / "compiled")
    parent.chmod(0o777)
    with pytest.raises(trusted_cache.UnsafeCacheError, match="swapped"):
        trusted_cache.check_private(folder)
    parent.chmod(0o1777)  # like /tmp: others cannot rename what is ours
    trusted_cache.check_private(folder)


def test_record_verify_and_a_replaced_file(tmp_path):
    built = tmp_path / "lib.so"
    built.write_bytes(b"the code we compiled")
    trusted_cache.record(built)
    assert trusted_cache.verified(built)
    built.write_bytes(b"someone else's code!")  # same length, other bytes
    assert not trusted_cache.verified(built)
    unrecorded = tmp_path / "other.so"
    unrecorded.write_bytes(b"x")
    assert not trusted_cache.verified(unrecorded)
    trusted_cache.forget(built)
    assert not built.exists() and not (tmp_path / "lib.so.sha256").exists()


@pytest.fixture
def compiled(tiny_model):
    from minillm.kvcache.paged import PagedKVCache
    from minillm.models.loader import load_model

    model, config = load_model(tiny_model, torch.float32), ModelConfig.from_folder(tiny_model)
    cache = PagedKVCache(config, 4, 4, torch.float32, torch.device("cpu"))
    return CompiledDecode(model, cache, None, torch.float32)


def test_a_replaced_package_is_never_loaded(compiled, tmp_path, monkeypatch):
    def must_not_run(path):
        raise AssertionError(f"loaded {path}: its code would have run")

    monkeypatch.setattr(torch._inductor, "aoti_load_package", must_not_run)
    folder = trusted_cache.private_dir(tmp_path / "compiled")
    package = folder / "decode-b256-0123456789abcdef0123.pt2"
    package.write_bytes(b"a package as built")
    trusted_cache.record(package)
    package.write_bytes(b"a package swapped in")
    with pytest.warns(UserWarning, match="not the file recorded when it was built"):
        assert compiled.try_load(256, package) is False
    assert not package.exists()  # deleted, to be compiled again
    package.write_bytes(b"no record at all")
    with pytest.warns(UserWarning, match="not the file recorded"):
        assert compiled.try_load(256, package) is False


def test_a_package_in_a_folder_others_can_write_is_refused_not_deleted(compiled, tmp_path):
    folder = tmp_path / "compiled"
    folder.mkdir()
    package = folder / "decode-b256-0123456789abcdef0123.pt2"
    package.write_bytes(b"someone's")
    trusted_cache.record(package)
    folder.chmod(0o777)
    with pytest.raises(trusted_cache.UnsafeCacheError):
        compiled.try_load(256, package)
    assert package.exists()  # not ours to delete


def test_the_kernels_library_is_rebuilt_when_replaced(monkeypatch, tmp_path):
    """Record the kernel's library, swap the file (by rename: the loaded copy stays mapped), and
    load it in a fresh lookup: the swapped file is deleted before inductor could load it."""
    from minillm.attention import cpu_paged

    if cpu_paged.kernel_unavailable_reason() is not None:
        pytest.skip(f"no C++ kernel here: {cpu_paged.kernel_unavailable_reason()}")
    library = cpu_paged._library()
    path = library._name
    assert trusted_cache.verified(path)  # recorded when it was first loaded
    with open(path, "rb") as f:
        original = f.read()

    def put(content: bytes) -> None:  # by rename: the library this process loaded stays mapped
        with open(f"{path}.swap", "wb") as f:
            f.write(content)
        os.replace(f"{path}.swap", path)

    put(b"\x7fELF not the kernel")
    assert not trusted_cache.verified(path)
    try:
        cpu_paged._library.cache_clear()
        cpu_paged._library()  # inductor's in-process cache still holds the real library
        # the swapped file was deleted before anything loaded it (or inductor rebuilt the real one)
        assert not os.path.exists(path) or trusted_cache.verified(path)
    finally:  # give later processes the real library back, recorded
        put(original)
        trusted_cache.record(path)
        cpu_paged._library.cache_clear()


# ---- issue 50, item 1: only verified native code runs ------------------------------------------

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("PLANTED_MARKER");
    if (marker) { FILE *f = fopen(marker, "w"); if (f) { fputs("ran", f); fclose(f); } }
}
"""


def _planted_library(tmp_path) -> bytes:
    """A shared library whose constructor writes $PLANTED_MARKER: proof that it was loaded."""
    import shutil
    import subprocess

    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C compiler")
    source, out = tmp_path / "planted.c", tmp_path / "planted.so"
    source.write_text(PLANTED_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", str(source), "-o", str(out)], check=True)
    return out.read_bytes()


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MINILLM_CACHE", str(cache))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    return cache


def test_a_plain_sha256_record_beside_a_planted_file_does_not_verify(private_cache):
    import hashlib

    folder = trusted_cache.private_dir(private_cache / "inductor" / "ab")
    planted = folder / "planted.so"
    planted.write_bytes(b"\x7fELF someone's code")
    (folder / "planted.so.sha256").write_text(hashlib.sha256(planted.read_bytes()).hexdigest() + "\n")
    assert not trusted_cache.verified(planted)  # the record is keyed by this cache's secret
    trusted_cache.record(planted)
    assert trusted_cache.verified(planted)
    key = private_cache / "compiled" / "trust.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    key.chmod(0o644)
    with pytest.raises(trusted_cache.UnsafeCacheError, match="mode 600"):
        trusted_cache.verified(planted)


def test_an_unrecorded_library_under_inductor_is_deleted_before_inductor_runs(private_cache):
    inductor = trusted_cache.private_dir(private_cache / "inductor")
    probe = trusted_cache.private_dir(inductor / "xy") / "cxyprobe.so"  # as an instruction-set probe sits
    probe.write_bytes(b"\x7fELF planted probe")
    ours = inductor / "xy" / "ckernel.so"
    ours.write_bytes(b"\x7fELF compiled here")
    trusted_cache.record(ours)
    source = inductor / "xy" / "cxyprobe.cpp"  # anything unrecorded: a generated module or a cached graph can run too
    source.write_text("int main() {}")
    lock = inductor / "locks" / "abc.lock"  # inductor's locks are left alone
    trusted_cache.private_dir(lock.parent)
    lock.write_text("")
    orphan = inductor / "xy" / ("gone.so" + trusted_cache.SUFFIX)
    orphan.write_text("a record without its file\n")
    autotune = inductor / "cache" / "system"
    trusted_cache.private_dir(autotune.parent)
    autotune.write_text("{}")
    trusted_cache.record(autotune)
    with trusted_cache.inductor_session():  # the compile worker's
        assert not probe.exists() and not source.exists() and not orphan.exists()
        assert ours.exists() and lock.exists() and autotune.exists()
        fresh = trusted_cache.private_dir(inductor / "zz") / "cnew.so"
        fresh.write_bytes(b"\x7fELF compiled just now")
        autotune.with_name("tmp").write_text('{"gemm": 1}')
        autotune.with_name("tmp").replace(autotune)  # inductor rewrites its autotune cache in place
    assert trusted_cache.verified(fresh) and trusted_cache.verified(autotune)  # recorded: kept next time


def test_an_in_process_compile_sweeps_once_and_records_at_exit(private_cache):
    from minillm.trusted_cache import _record_written_since

    inductor = trusted_cache.private_dir(private_cache / "inductor")
    planted = trusted_cache.private_dir(inductor / "ab") / "x.so"
    planted.write_bytes(b"\x7fELF planted")
    assert trusted_cache.guard_inductor() == [planted]
    written = inductor / "ab" / "y.so"  # the lazy compile's output, unrecorded until exit
    written.write_bytes(b"\x7fELF compiled lazily")
    assert trusted_cache.guard_inductor() == [] and written.exists()  # a second engine: no second sweep
    _record_written_since(inductor, time.time() - 60)  # what atexit runs
    assert trusted_cache.verified(written)


def test_a_cold_cache_under_umask_002_is_private_all_the_way_down(tmp_path, monkeypatch):
    cache = tmp_path / "fresh-cache"
    monkeypatch.setenv("MINILLM_CACHE", str(cache))
    old = os.umask(0o002)
    try:
        kernels = trusted_cache.private_dir(cache / "compiled" / "kernels")  # the kernel's thread comes first
        assert stat.S_IMODE((cache / "compiled").stat().st_mode) == 0o700
        lib = kernels / "k.so"
        lib.write_bytes(b"x")
        trusted_cache.record(lib)  # needs the key, in compiled/: private
        assert trusted_cache.verified(lib)
        (cache / "inductor").mkdir(mode=0o775)  # as inductor (or an older minillm) makes it
        os.chmod(cache / "inductor", 0o775)
        trusted_cache.private_dir(cache / "inductor")  # ours, inside the cache: closed, not refused
        assert stat.S_IMODE((cache / "inductor").stat().st_mode) == 0o755
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o722])
def test_every_folder_under_inductor_is_checked_not_only_the_top(private_cache, mode):
    """A folder of ours deep in the tree that others could write to (inductor makes them with the
    umask's mode: 0775 under 002) is closed, and what sits in it unrecorded — a library with a
    plain SHA-256 beside it, as planted in the field — is deleted, never loaded."""
    import hashlib

    inductor = trusted_cache.private_dir(private_cache / "inductor")
    deep = trusted_cache.private_dir(inductor / "ab" / "cd")
    planted = deep / "k.so"
    planted.write_bytes(b"\x7fELF planted")
    (deep / "k.so.sha256").write_text(hashlib.sha256(planted.read_bytes()).hexdigest() + "\n")
    deep.chmod(mode)
    assert trusted_cache.guard_inductor() == [planted]
    assert not planted.exists() and stat.S_IMODE(deep.stat().st_mode) == mode & ~0o022


def test_a_folder_of_another_user_deep_in_the_tree_is_refused(private_cache):
    if os.getuid() != 0:
        pytest.skip("only root can give a folder to another user")
    inductor = trusted_cache.private_dir(private_cache / "inductor")
    deep = trusted_cache.private_dir(inductor / "ab")
    os.chown(deep, 12345, -1)
    with pytest.raises(trusted_cache.UnsafeCacheError, match="belongs to another user"):
        trusted_cache.guard_inductor()


def test_a_symlink_out_of_the_tree_is_refused(private_cache, tmp_path):
    inductor = trusted_cache.private_dir(private_cache / "inductor")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (inductor / "ab").symlink_to(elsewhere)
    with pytest.raises(trusted_cache.UnsafeCacheError, match="symbolic link"):
        trusted_cache.guard_inductor()
    (inductor / "ab").unlink()
    trusted_cache.private_dir(inductor / "ab")
    (inductor / "ab" / "inside").symlink_to(inductor / "ab")  # a link that stays inside is fine
    trusted_cache.guard_inductor()


def test_a_folder_the_user_chose_for_inductor_is_checked_but_not_swept(private_cache, tmp_path, monkeypatch):
    chosen = tmp_path / "my-inductor"
    trusted_cache.private_dir(chosen)
    (chosen / "k.so").write_bytes(b"theirs")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(chosen))
    assert trusted_cache.guard_inductor() == [] and (chosen / "k.so").exists()
    with trusted_cache.inductor_session():
        pass
    assert (chosen / "k.so").exists() and not (chosen / "k.so.sha256").exists()
    chosen.chmod(0o777)
    with pytest.raises(trusted_cache.UnsafeCacheError):
        trusted_cache.guard_inductor()


def test_the_compile_worker_sweeps_inductor_before_it_compiles_and_records_after(private_cache, monkeypatch, tmp_path):
    """The worker's order: guard (an unrecorded probe planted in inductor's tree is gone before
    the build starts), build, record what the build wrote."""
    import pickle
    from types import SimpleNamespace

    from minillm.runtime import compile_worker

    inductor = trusted_cache.private_dir(private_cache / "inductor")
    planted = trusted_cache.private_dir(inductor / "pr") / "cprobe.so"
    planted.write_bytes(b"\x7fELF planted")
    seen = {}

    def build(job, tensors):
        seen["planted before the build"] = planted.exists()
        (inductor / "pr" / "cbuilt.so").write_bytes(b"\x7fELF built by the compile")

    monkeypatch.setattr(compile_worker, "build", build)
    monkeypatch.setattr(compile_worker, "follow_parent", lambda *a: None)
    monkeypatch.setattr(compile_worker, "niceness", lambda: os.getpriority(os.PRIO_PROCESS, 0))
    job_file = tmp_path / f"job-{os.getpid()}-x.pkl"
    packages = trusted_cache.private_dir(private_cache / "compiled")
    job_file.write_bytes(pickle.dumps(SimpleNamespace(paths={1: str(packages / "decode-b1-x.pt2")}, tensors=None,
                                                      parent_pid=os.getppid())))  # fmt: skip
    assert compile_worker.main([str(job_file)]) == 0
    assert seen == {"planted before the build": False}
    assert trusted_cache.verified(inductor / "pr" / "cbuilt.so")


def test_the_kernels_library_with_its_record_deleted_is_rebuilt_never_loaded(tmp_path):
    """The field's attack: put a library of one's own where the kernel's is, delete its record,
    start again. The planted library's constructor must not run; the kernel is built anew."""
    import subprocess
    import sys

    from minillm.attention import cpu_paged

    if cpu_paged.kernel_unavailable_reason() is not None:
        pytest.skip(f"no C++ kernel here: {cpu_paged.kernel_unavailable_reason()}")
    planted = _planted_library(tmp_path)
    marker = tmp_path / "planted-ran"
    env = dict(os.environ, MINILLM_CACHE=str(tmp_path / "cache"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache" / "inductor"),
               PLANTED_MARKER=str(marker))  # fmt: skip
    load = "from minillm.attention import cpu_paged; print(cpu_paged._library()._name)"
    first = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    path = first.stdout.strip().splitlines()[-1]
    assert path.startswith(str(tmp_path / "cache" / "compiled" / "kernels"))
    with open(path, "wb") as f:
        f.write(planted)
    os.unlink(path + trusted_cache.SUFFIX)
    for record in (tmp_path / "cache" / "compiled").glob("cpu-paged-decode-*.path"):  # an older layout's record
        record.unlink()
    again = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not marker.exists(), "the planted library's constructor ran"
    rebuilt = again.stdout.strip().splitlines()[-1]
    with open(rebuilt, "rb") as f:
        assert f.read() != planted


def test_a_record_is_sealed_and_a_file_rewritten_with_its_old_times_is_hashed_again(private_cache, tmp_path):
    built = tmp_path / "lib.so"
    built.write_bytes(b"the code we compiled")
    trusted_cache.record(built)
    record = built.with_name("lib.so" + trusted_cache.SUFFIX)
    content, fingerprint, seal = record.read_text().split()
    assert trusted_cache.verified(built)
    record.write_text(f"{content} 1:2:3:4 {seal}\n")  # a fingerprint of one's own: the seal no longer matches
    assert not trusted_cache.verified(built)
    trusted_cache.record(built)
    times = built.stat()
    built.write_bytes(b"someone else's code!")  # same length ...
    os.utime(built, ns=(times.st_atime_ns, times.st_mtime_ns))  # ... and the old modification time
    assert not trusted_cache.verified(built)  # the change time moved: hashed in full, and it differs
