"""minillm: a compact, readable LLM inference engine, built chapter by chapter in the course.

Public API::

    from minillm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].text)
"""

import os as _os

import torch as _torch

# Without CUDA, Triton kernels can only run in Triton's interpreter, and the switch must be set
# before anything (transformers, for one) imports triton: its own helper functions are
# compiled for one mode or the other at import time.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from minillm.assets import cache_dir as _cache_dir  # noqa: E402

# torch.compile's on-disk caches (compiled decode steps: runtime/compiled_decode.py) live in the
# project's cache folder, so the minute a compile costs is paid once per machine, not per start.
# Set before anything asks inductor for its folder (it fixes the default on first use).
_os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_cache_dir() / "inductor"))

from minillm.config import EngineConfig, ModelConfig  # noqa: E402
from minillm.engine import LLM, LLMEngine  # noqa: E402
from minillm.errors import ModelLoadError, ModelNotFoundError, PromptTooLongError  # noqa: E402
from minillm.outputs import RequestMetrics, RequestOutput, StreamDelta, TokenLogprob  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "ModelConfig",
    "ModelLoadError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StreamDelta",
    "TokenLogprob",
]

if _os.environ.get("MINILLM_GRADING"):  # a process the learner's code started while a check is graded
    from minillm.course.guard import guard_from_environment  # noqa: E402

    guard_from_environment()
