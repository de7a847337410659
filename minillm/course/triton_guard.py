"""Bounds-checked loads and stores for a learner's Triton kernel under the interpreter.

Why: on a GPU a kernel that reads or writes past its tensors gets "illegal memory access"; under
``TRITON_INTERPRET=1`` the same kernel reads and writes the process's own heap through raw
pointers, so a store mask off by one row corrupts memory and the Jupyter kernel dies with
"corrupted double-linked list" — no check message, no hint. Inside ``bounds_checked()`` every
launch records the storage of each tensor it was given, and every load and store checks that
each address it really touches (the lanes its mask keeps) lies inside one of them; the first
that does not raises ``OutOfBounds`` naming the operation, before anything is written. Lanes a
mask turns off are not checked, exactly as the hardware never touches them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np


class OutOfBounds(RuntimeError):
    """A load or store of the learner's kernel touched memory outside every tensor it was given."""


_state = threading.local()


def _storages(args) -> list[tuple[int, int]]:
    ranges = []
    for arg in list(args):
        if hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges


def _check(kind: str, ptrs, mask, itemsize: int) -> None:
    ranges = getattr(_state, "ranges", None)
    if ranges is None:
        return
    addresses = np.asarray(ptrs.data, dtype=np.uint64)
    if mask is not None:
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
    if addresses.size == 0:
        return
    inside = np.zeros(addresses.shape, dtype=bool)
    for lo, hi in ranges:
        inside |= (addresses >= lo) & (addresses + itemsize <= hi)
    if not inside.all():
        outside = int((~inside).sum())
        raise OutOfBounds(
            f"a tl.{kind} touched {outside} address(es) outside every tensor the kernel was given (on a GPU: an "
            f"illegal memory access; here it would overwrite other memory): mask the rows past the end — "
            f"offs[:, None] < T for the queries and the output, offs_n[:, None] < S for the keys and values"
        )


@contextlib.contextmanager
def bounds_checked() -> Iterator[None]:
    """Check every load and store of interpreted Triton launches inside the ``with``."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    executor_call = interpreter.GridExecutor.__call__
    load, store = builder.create_masked_load, builder.create_masked_store

    def call(self, *args, **kwargs):
        outer = getattr(_state, "ranges", None)
        _state.ranges = _storages([*args, *kwargs.values()])
        try:
            return executor_call(self, *args, **kwargs)
        finally:
            _state.ranges = outer

    def checked_load(ptrs, mask, other, cache_policy, is_volatile):
        _check("load", ptrs, mask, ptrs.get_element_ty().primitive_bitwidth // 8)
        return load(ptrs, mask, other, cache_policy, is_volatile)

    def checked_store(ptrs, value, mask, cache_policy):
        _check("store", ptrs, mask, ptrs.get_element_ty().primitive_bitwidth // 8)
        return store(ptrs, value, mask, cache_policy)

    interpreter.GridExecutor.__call__ = call
    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = executor_call
        builder.create_masked_load, builder.create_masked_store = load, store


def out_of_bounds_in(err: BaseException | None) -> OutOfBounds | None:
    """The ``OutOfBounds`` behind ``err`` (the interpreter wraps what a kernel raises), if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OutOfBounds):
            return err
        err = err.__cause__ or err.__context__
    return None
