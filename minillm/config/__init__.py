"""Configuration: what the model is, how the engine runs it, and which options combine.

- ``model.py`` — ``ModelConfig``, our explicit view of a Hugging Face ``config.json``;
- ``engine.py`` — ``EngineConfig``, every engine option with its documentation and CLI flag;
- ``compatibility.py`` — the one table of options that do not combine, with the reason;
- ``options.py`` — the choices of each option (modes, backends, quantization methods...) and
  the structured ones (``SpeculativeConfig``);
- ``memory.py`` — sizes as people write them (``2GB``, ``50%``).

``python -m minillm.config`` prints the compatibility table.
"""

from minillm.config.compatibility import Rule, Where, check_compatible, refusal
from minillm.config.engine import EngineConfig, option
from minillm.config.memory import parse_memory
from minillm.config.model import DTYPES, SUPPORTED_MODEL_TYPES, ModelConfig, parse_dtype
from minillm.config.options import (
    ATTENTION_BACKENDS,
    DEPRECATED_MODES,
    EXECUTION_MODES,
    INT4_GROUP_SIZES,
    INT4_METHODS,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
    ROUTER_POLICIES,
    SCHEDULING_POLICIES,
    SPARSITY_METHODS,
    SPECULATIVE_METHODS,
    KVCacheDtype,
    SpeculativeConfig,
    check_int,
    check_quantization,
)
from minillm.machine import triton_available  # where it used to live; the probe is machine.py's

__all__ = [
    "ATTENTION_BACKENDS",
    "DEPRECATED_MODES",
    "DTYPES",
    "EXECUTION_MODES",
    "INT4_GROUP_SIZES",
    "INT4_METHODS",
    "KV_CACHE_DTYPES",
    "QUANTIZATION_METHODS",
    "ROUTER_POLICIES",
    "SCHEDULING_POLICIES",
    "SPARSITY_METHODS",
    "SPECULATIVE_METHODS",
    "SUPPORTED_MODEL_TYPES",
    "EngineConfig",
    "KVCacheDtype",
    "ModelConfig",
    "Rule",
    "SpeculativeConfig",
    "Where",
    "check_compatible",
    "check_int",
    "check_quantization",
    "option",
    "parse_dtype",
    "parse_memory",
    "refusal",
    "triton_available",
]
