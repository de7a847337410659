"""Compiled code loads only if this user built it (minillm/trusted_cache.py).

The attack from the field: replace a compiled package (or the C++ kernel's library) in the
cache, and the next engine start runs it. Now a replaced file is refused before it is loaded,
and a cache folder other users could write to is refused with the fix in the message.
"""

from __future__ import annotations

import os
import stat

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
