"""Triton, imported ready for this machine: every module with Triton kernels (attention,
quantized matmuls, fused norms) takes ``triton`` and ``tl`` from here, so the one rule about
importing it lives in one place.

The rule: without CUDA, Triton's kernels run only in its interpreter, and the switch
(``TRITON_INTERPRET=1``) must be set before ``triton`` is first imported — its own helper
functions are built for one mode or the other at import time. So this module sets the switch
(unless the environment already chose) and only then imports triton; if something imported
triton earlier, without the switch, on a machine with no GPU, it says so instead of letting
the kernels fail later with a confusing error. Nothing imports this module until a Triton
kernel is needed (``attention_backend="triton"``, a quantized matmul on CUDA, the tests).
"""

from __future__ import annotations

from minillm.config import environment

environment.choose_triton_mode()

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

#: Whether the kernels run in Triton's interpreter (on the CPU: correct, slow).
INTERPRETED = environment.get("TRITON_INTERPRET") == "1"

if INTERPRETED and type(tl.zeros).__name__ != "InterpretedFunction":
    raise ImportError(
        "triton was imported before TRITON_INTERPRET=1 was set, so its helpers are compiled for a GPU this "
        "machine does not have: import minillm.triton_setup first (it imports triton ready for this machine), "
        "or set TRITON_INTERPRET=1 in the environment"
    )

__all__ = ["INTERPRETED", "tl", "triton"]
