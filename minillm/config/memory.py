"""Sizes as people write them (``2GB``, ``1.5GiB``, ``50%``): the command line's KV pool size."""

from __future__ import annotations

import math

_MEMORY_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_memory(text: str) -> int | float:
    """A KV-pool size as written on a command line: ``"0.5"`` or ``"50%"`` is a fraction of free
    memory (a float in (0, 1]); ``"2e9"``, ``"2000000000"``, ``"2GB"``, ``"1.5GiB"`` are bytes (an int).
    Raises ``ValueError`` saying what is wrong with ``text``."""
    raw = text.strip().lower().replace("_", "")
    unit = next((u for u in sorted(_MEMORY_UNITS, key=len, reverse=True) if raw.endswith(u)), None)
    number = raw[: -len(unit)] if unit else raw[:-1] if raw.endswith("%") else raw
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: use bytes (2e9, 2GB, 1.5GiB) or a fraction (0.5, 50%)") from None
    if not 0 < value < math.inf:
        raise ValueError(f"{text!r}: the KV pool size must be a positive, finite amount")
    if raw.endswith("%"):
        value /= 100
        if value > 1:
            raise ValueError(f"{text!r}: a fraction of free memory cannot exceed 100%")
        return value
    if unit is None and "." in number and "e" not in number:  # 0.5, 1.0: a fraction
        if value > 1:
            raise ValueError(f"{text!r}: a fraction of free memory must be in (0, 1]; write bytes as 2e9 or 2GB")
        return value
    size = int(value * _MEMORY_UNITS.get(unit, 1))
    if size < 1:
        raise ValueError(f"{text!r} is less than one byte; write a fraction of free memory as 0.5 or 50%")
    return size


