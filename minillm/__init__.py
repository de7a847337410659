"""minillm: a compact, readable LLM inference engine, built chapter by chapter in the course.

Public API::

    from minillm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].text)

Importing it changes no process-wide setting: the environment variables minillm reads or sets
are declared in ``config/environment.py``, and what it sets is set when needed (inductor's cache
folder when an engine is built, Triton's interpreter when Triton is first used:
``minillm.triton_setup``, which a notebook writing its own Triton kernels imports first).
"""

from minillm.config import EngineConfig, ModelConfig
from minillm.config import environment as _environment
from minillm.engine import LLMEngine
from minillm.entrypoints import LLM
from minillm.errors import ModelLoadError, ModelNotFoundError, PromptTooLongError
from minillm.outputs import RequestMetrics, RequestOutput, StreamDelta, TokenLogprob
from minillm.sampling import SamplingParams

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

if _environment.get("MINILLM_GRADING"):  # a process the learner's code started while a check is graded
    from minillm.course.guard import guard_from_environment

    guard_from_environment()
