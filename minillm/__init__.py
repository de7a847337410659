"""minillm: a compact, readable LLM inference engine, built chapter by chapter in the course.

Public API::

    from minillm import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].text)
"""

from minillm.config import EngineConfig, ModelConfig
from minillm.engine import LLM, LLMEngine
from minillm.errors import ModelLoadError, ModelNotFoundError, PromptTooLongError
from minillm.sampling import SamplingParams
from minillm.sequence import RequestMetrics, RequestOutput, StreamDelta

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
]
