"""Chapter 03: more wrong answers a learner writes (see ``check_catalogue``)."""

from __future__ import annotations

from check_catalogue import right, wrong  # noqa: F401
