"""The engine's option values, and the checks of values that are structured (speculation,
quantization): each list here is the one place its choices are written down; ``EngineConfig``,
the compatibility table and the command line all read them."""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

import torch

EXECUTION_MODES = ("paged", "contiguous", "naive")
#: Old mode names that still work, with a deprecation warning.
DEPRECATED_MODES = {"kv_cache": "contiguous"}
SCHEDULING_POLICIES = ("static", "dynamic", "continuous")
ATTENTION_BACKENDS = ("auto", "torch", "sdpa", "cpu", "triton")
QUANTIZATION_METHODS = ("int8", "int4", "awq", "w8a8")  # the linear-layer methods of minillm/quantization
SPARSITY_METHODS = ("2:4", "2:4-wanda")  # 2:4 pruning by magnitude or by Wanda scores (quantization/sparsity.py)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # the paged pool's storage (minillm/kvcache/quantization.py)
#: How a data-parallel router picks a replica for a prompt (minillm/cluster/router.py).
ROUTER_POLICIES = ("round_robin", "least_loaded", "prefix_aware")
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what PyTorch's CPU int4 kernel accepts
INT4_METHODS = ("int4", "awq")  # the methods that store int4 groups



class KVCacheDtype(str):
    """How the paged pool stores keys and values: ``auto`` (the model's dtype), ``int8`` or
    ``fp8`` (8 bits per value plus one fp32 scale per token and head: kvcache/quantization.py).

    Checked once, where it is made (``EngineConfig``; the pool takes it or a name), and asked
    instead of compared: the pool reads ``storage`` and ``quantized``, the Triton kernels
    ``kernel_code``. It stays a string — it prints, compares, pickles and reaches chapter 07's
    ``quantize_kv(x, kind)`` as its name."""

    __slots__ = ()
    _KERNEL_CODES = {"auto": 0, "int8": 1, "fp8": 2}  # the Triton kernels' constexpr KV_QUANT

    def __new__(cls, value: str = "auto") -> KVCacheDtype:
        if isinstance(value, cls):
            return value
        if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={value!r}: expected one of {KV_CACHE_DTYPES}")
        return super().__new__(cls, value)

    @property
    def quantized(self) -> bool:
        """8-bit values with scales (``int8``, ``fp8``), not the model's dtype."""
        return str(self) != "auto"

    @property
    def storage(self) -> torch.dtype | None:
        """What the pool's K/V tensors hold (fp8 as its bit patterns: PyTorch's CPU kernels cannot
        index-copy fp8); None: the model's dtype."""
        return {"int8": torch.int8, "fp8": torch.uint8}.get(str(self))

    @property
    def kernel_code(self) -> int:
        """The Triton kernels' ``KV_QUANT`` constexpr: 0 plain, 1 int8, 2 fp8."""
        return self._KERNEL_CODES[str(self)]


SPECULATIVE_METHODS = ("draft", "eagle", "ngram")


@dataclass
class SpeculativeConfig:
    """A checked ``speculative_config``: who proposes (``method``), how many tokens per step."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model ("draft") or the EAGLE head ("eagle")
    quantization: str | None = None  # the draft's weights ("draft"): e.g. "int8" — its LM head dominates a small draft
    prompt_lookup_max: int = 4  # the longest n-gram matched ("ngram")
    prompt_lookup_min: int = 1  # the shortest
    # Guess up to 1, 2, 4, 8 tokens after a match of 1, 2, 3, 4 (capped at k), as far as the
    # match vouches for (speculative/ngram.py, ``reach``) — so prompt_lookup_max also caps the
    # guess, at 2^(max - 1); False: k whenever anything matches (vLLM's ngram).
    prompt_lookup_scaled: bool = True
    # Measure per batch size whether proposing (and how many, up to k) pays, and propose only
    # that many (speculative/governor.py); False: always k.
    adaptive: bool = True
    # EAGLE-2's dynamic tree ("eagle"): each level expands its ``topk`` most likely nodes into
    # their ``topk`` best children, ``depth`` levels deep, and the ``num_speculative_tokens`` most
    # likely nodes of all are verified in one pass (speculative/tree.py). topk 1: a chain of
    # num_speculative_tokens.
    topk: int = 1
    depth: int | None = None  # levels grown (default: num_speculative_tokens for a chain, else 5)
    # An EAGLE tree also gets prompt lookup's guess, up to this many tokens, grafted on as a
    # branch of its own (speculative/tree.py, ``graft_chain``): the head guesses free text, prompt
    # lookup copies runs the text has seen. Default: 4 for a tree (topk > 1), 0 (none) for a chain.
    ngram_branch: int | None = None  # from_dict resolves it

    KEYS = {
        "draft": {"method", "model", "num_speculative_tokens", "quantization", "adaptive"},
        "eagle": {"method", "model", "num_speculative_tokens", "adaptive", "topk", "depth", "ngram_branch",
                  "prompt_lookup_max", "prompt_lookup_min"},
        "ngram": {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "prompt_lookup_scaled",
                  "adaptive"},
    }

    @classmethod
    def from_dict(cls, raw) -> SpeculativeConfig | None:
        """``None`` stays None; anything else is checked, every bad field named."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise TypeError(f"speculative_config={raw!r} must be a dict (or None)")
        method = raw.get("method")
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={method!r}: expected one of {SPECULATIVE_METHODS}")
        unknown = sorted(set(raw) - cls.KEYS[method])
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown} for method {method!r}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config needs num_speculative_tokens (the k tokens proposed per step)")
        check_int("speculative_config num_speculative_tokens", raw["num_speculative_tokens"], 1)
        if raw["num_speculative_tokens"] > 16:
            raise ValueError(f"speculative_config num_speculative_tokens={raw['num_speculative_tokens']} is above 16")
        config = cls(method, raw["num_speculative_tokens"])
        for key in ("adaptive", "prompt_lookup_scaled"):
            if key in raw:
                if not isinstance(raw[key], bool):
                    raise ValueError(f"speculative_config {key}={raw[key]!r} must be true or false")
                setattr(config, key, raw[key])
        for key in ("topk", "depth"):
            if key in raw:
                check_int(f"speculative_config {key}", raw[key], 1)
                if raw[key] > 8 and key == "topk":
                    raise ValueError(f"speculative_config topk={raw[key]} is above 8 (children per expanded node)")
                if raw[key] > 16:
                    raise ValueError(f"speculative_config depth={raw[key]} is above 16")
                setattr(config, key, raw[key])
        if config.depth is None:
            config.depth = min(config.num_speculative_tokens, 5) if config.topk > 1 else config.num_speculative_tokens
        if "ngram_branch" in raw:
            check_int("speculative_config ngram_branch", raw["ngram_branch"], 0)
            if raw["ngram_branch"] > 16:
                raise ValueError(f"speculative_config ngram_branch={raw['ngram_branch']} is above 16")
            if raw["ngram_branch"] and config.topk == 1:
                raise ValueError(f"speculative_config ngram_branch={raw['ngram_branch']} grafts prompt lookup's guess "
                                 "onto a tree: it needs topk > 1 (a chain has no second branch)")  # fmt: skip
            config.ngram_branch = raw["ngram_branch"]
        else:
            config.ngram_branch = 4 if method == "eagle" and config.topk > 1 else 0
        if method in ("draft", "eagle"):
            if not isinstance(raw.get("model"), (str, os.PathLike)) or not str(raw.get("model")):
                what = "the draft model" if method == "draft" else "the EAGLE head, e.g. 'smollm2-eagle'"
                raise ValueError(f"speculative_config method={method!r} needs model=NAME_OR_PATH ({what})")
            config.model = str(raw["model"])
            if raw.get("quantization") is not None:
                try:
                    check_quantization(raw["quantization"], None)
                except ValueError as err:
                    raise ValueError(f"speculative_config {err}") from None
                config.quantization = raw["quantization"]
        for key in ("prompt_lookup_max", "prompt_lookup_min"):  # "ngram", and an EAGLE tree's n-gram branch
            if key in raw:
                check_int(f"speculative_config {key}", raw[key], 1)
                setattr(config, key, raw[key])
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min={config.prompt_lookup_min} is above "
                f"prompt_lookup_max={config.prompt_lookup_max}"
            )
        return config


def check_quantization(method: str | None, group_size: int | None) -> None:
    """A weight-quantization method and group size the engine supports, else ``ValueError``
    naming the option (checked before any weight is touched)."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={method!r}: expected one of {QUANTIZATION_METHODS} (or None)")
    if method in INT4_METHODS and group_size is not None and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size={group_size!r}: int4 groups must be one of {INT4_GROUP_SIZES}")


def check_int(name: str, value, minimum: int, optional: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum`` (or None if optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy ints are integers too
        raise ValueError(f"{name}={value!r} must be an integer" + (" or None" if optional else ""))
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")


