"""How each exercise's functions plug into the engine: one table, read by ``your_engine()``.

Why this module exists: a check grades a learner's function by running it inside the real
engine, through a hook (``minillm/hooks.py``). Most exercises ask for the function in the shape
a learner meets it in the chapter (``decoder_layer(x[T, hidden], w, cos, sin, config)``, ``chunk_tokens(remaining,
budget, ...)``), not in the hook's shape, so each plug-in needs a small adapter. The checks and
``your_engine()`` take the adapters from here, so the wiring that graded a piece is the wiring
that runs it in the learner's own engine.

A plug is valid in the engine modes its check ran it in: chapter 01's layer and attention see a
whole sequence at once (no cache), so they run only in ``mode="naive"``; the rest run wherever
the engine calls their hook. Exercises whose piece is not a hook of the single-process engine
(the decode loops, the online softmax, the Triton kernel, tensor parallelism's ranks, the router's
rule, the response cache key) are taught and graded on their own and are listed as such.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minillm.course.checks.ch01_decode import mha_adapter
from minillm.course.checks.ch01_transformer import layer_adapter
from minillm.course.checks.ch02_cached_model import rope_adapter
from minillm.course.checks.ch04_runner import layout_adapter
from minillm.course.checks.ch05_paged_attention import attention_adapter as paged_adapter

ALL_MODES = frozenset({"naive", "contiguous", "paged"})


@dataclass(frozen=True)
class Plug:
    """Check ``check``'s functions as hook overrides: ``build(fns, config) -> {hook: function}``
    (``fns`` in the order the check cell passes them; ``config`` the model's ``ModelConfig``)."""

    check: str
    hooks: tuple[str, ...]
    build: Callable[[tuple, object], dict[str, Callable]]
    modes: frozenset = ALL_MODES
    when: str = ""  # when the engine calls it, if not on every request (e.g. "quantization='int8'")


def tokens_to_run(chunk_tokens):
    """Hook ``tokens_to_run`` from chapter 04's ``chunk_tokens(remaining, budget, chunked_prefill, step_is_empty)``."""

    def run(scheduler, seq, budget, out):
        return chunk_tokens(
            len(seq) - seq.num_computed_tokens, budget, scheduler.enable_chunked_prefill, not out.chunks
        )

    return run


def gather_from_pool(gather_kv):
    """Hook ``gather_kv`` from chapter 03's ``gather_kv(slots, block_tables, block_size)``, run on K and on V."""

    def run(pool, layer, block_tables, by_slot=False):
        return (
            gather_kv(pool.k_slots[layer], block_tables, pool.block_size),
            gather_kv(pool.v_slots[layer], block_tables, pool.block_size),
        )

    return run


def gqa_backend(gqa_attention):
    """Hook ``torch_attention`` from chapter 05's ``gqa_attention(q, k, v, mask, scale)``: a causal
    call without a mask gets the causal mask of its last T positions."""

    def run(q, k, v, mask, is_causal, scale):
        if mask is None and is_causal:
            t, s = q.shape[2], k.shape[2]
            mask = (torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None])[None, None].expand(q.shape[0], 1, t, s)
        return gqa_attention(q, k, v, mask, scale)

    return run


def int8_weights(quantize_per_channel):
    """Hook ``quantize_int8`` from chapter 07's ``quantize_per_channel(weight) -> (q, scale)`` (scale kept fp32)."""

    def run(weight):
        q, scale = quantize_per_channel(weight)
        return q, scale.float()

    return run


def int8_kv(quantize_kv_on_write):
    """Hook ``quantize_kv`` from chapter 07's int8 ``quantize_kv_on_write(x)``; fp8 stays the package's."""
    import minillm.hooks as hooks

    package = hooks.default("quantize_kv")

    def run(x, kind="int8"):
        return quantize_kv_on_write(x) if kind == "int8" else package(x, kind)

    return run


def ngram_proposer(propose_ngram):
    """Hook ``propose_ngram`` from chapter 08's ``propose_ngram(tokens, k, max_n)``: the engine's
    ``prompt_lookup_min`` is 1 unless set; a larger one is the package's to honour."""
    import minillm.hooks as hooks

    def run(tokens, k, max_n=4, min_n=1):
        if min_n != 1:
            return hooks.default("propose_ngram")(tokens, k, max_n, min_n)
        return propose_ngram(tokens, k, max_n)

    return run


def _same(hook: str) -> Callable[[tuple, object], dict]:
    """The learner's function already has the hook's signature."""
    return lambda fns, config: {hook: fns[0]}


PLUGS: dict[str, Plug] = {
    p.check: p
    for p in [
        Plug(
            "check_causal_attention",
            ("torch_attention",),
            lambda f, c: {"torch_attention": mha_adapter(f[0])},
            frozenset({"naive"}),
        ),
        Plug("check_filter_logits", ("filter_logits",), _same("filter_logits"), when="temperature > 0"),
        Plug("check_sample", ("sample",), _same("sample")),
        Plug(
            "check_stopping",
            ("append_token", "take_stream_text"),
            lambda f, c: {"append_token": f[0], "take_stream_text": f[1]},
        ),
        Plug(
            "check_transformer",
            ("decoder_layer",),
            lambda f, c: {"decoder_layer": layer_adapter(f[1], c)},
            frozenset({"naive"}),
        ),
        Plug("check_kv_write", ("kv_write",), _same("kv_write"), frozenset({"contiguous"})),
        Plug("check_contiguous_cache", ("contiguous_cache",), _same("contiguous_cache"), frozenset({"contiguous"})),
        Plug("check_rope_tables", ("rope_tables",), _same("rope_tables")),
        Plug("check_cached_model", ("apply_rope",), lambda f, c: {"apply_rope": rope_adapter(f[0])}),
        Plug(
            "check_block_table",
            ("grow_table", "slot_mapping"),
            lambda f, c: {"grow_table": f[0], "slot_mapping": f[1]},
            frozenset({"paged"}),
        ),
        Plug(
            "check_gather_kv", ("gather_kv",), lambda f, c: {"gather_kv": gather_from_pool(f[0])}, frozenset({"paged"})
        ),
        Plug("check_block_hash", ("block_hash",), _same("block_hash"), frozenset({"paged"}), "enable_prefix_caching"),
        Plug("check_block_pool", ("block_pool",), _same("block_pool"), frozenset({"paged"})),
        Plug(
            "check_chunk_tokens",
            ("tokens_to_run",),
            lambda f, c: {"tokens_to_run": tokens_to_run(f[0])},
            frozenset({"paged"}),
        ),
        Plug(
            "check_choose_victim",
            ("choose_victim",),
            lambda f, c: {"choose_victim": lambda scheduler, seq, candidates: f[0](seq, candidates)},
            frozenset({"paged"}),
            "the pool runs out of blocks",
        ),
        Plug(
            "check_reserve_admit",
            ("reserve", "try_admit"),
            lambda f, c: {"reserve": f[0], "try_admit": f[1]},
            frozenset({"paged"}),
        ),
        Plug(
            "check_continuous_schedule",
            ("schedule",),
            lambda f, c: {"schedule": lambda scheduler, now: f[0](scheduler)},
            frozenset({"paged"}),
        ),
        Plug(
            "check_prepare_inputs",
            ("step_layout",),
            lambda f, c: {"step_layout": layout_adapter(f[0], {})},
            frozenset({"paged"}),
        ),
        Plug("check_gqa_attention", ("torch_attention",), lambda f, c: {"torch_attention": gqa_backend(f[0])}),
        Plug("check_head_pooling", ("pool_heads",), _same("pool_heads"), when="pool_kv_heads(...)"),
        Plug(
            "check_window_release",
            ("blocks_behind_window",),
            _same("blocks_behind_window"),
            frozenset({"paged"}),
            "a sliding window",
        ),
        Plug(
            "check_paged_attention",
            ("paged_attention",),
            lambda f, c: {"paged_attention": paged_adapter(f[0], {})},
            frozenset({"paged"}),
        ),
        Plug(
            "check_quantize_per_channel",
            ("quantize_int8",),
            lambda f, c: {"quantize_int8": int8_weights(f[0])},
            when="quantization='int8'",
        ),
        Plug("check_quantize_int4", ("quantize_int4",), _same("quantize_int4"), when="quantization='int4'"),
        Plug(
            "check_pack_int4",
            ("pack_int4", "unpack_int4"),
            lambda f, c: {"pack_int4": f[0], "unpack_int4": f[1]},
            when="an int4 checkpoint",
        ),
        Plug(
            "check_quantize_kv",
            ("quantize_kv",),
            lambda f, c: {"quantize_kv": int8_kv(f[0])},
            frozenset({"paged"}),
            "kv_cache_dtype='int8'",
        ),
        Plug(
            "check_accept_greedy",
            ("accept_greedy",),
            _same("accept_greedy"),
            frozenset({"paged"}),
            "speculative_config, on the steps that propose",
        ),
        Plug(
            "check_accept_sampled",
            ("accept_sampled",),
            _same("accept_sampled"),
            frozenset({"paged"}),
            "speculative_config and temperature > 0, on the steps that propose",
        ),
        Plug(
            "check_rollback",
            ("blocks_to_roll_back",),
            _same("blocks_to_roll_back"),
            frozenset({"paged"}),
            "speculative_config, on the steps that propose",
        ),
        Plug(
            "check_tree_attention_mask",
            ("tree_attention_mask",),
            _same("tree_attention_mask"),
            frozenset({"paged"}),
            "tree drafting",
        ),
        Plug(
            "check_accept_tree",
            ("accept_tree",),
            _same("accept_tree"),
            frozenset({"paged"}),
            "tree drafting",
        ),
        Plug("check_kv_heads", ("heads_of_rank",), lambda f, c: {"heads_of_rank": heads_as_ranges(f[0])}),
        Plug("check_detokenize_step", ("detokenize_step",), _same("detokenize_step")),
        Plug("check_stream_events", ("stream_events",), _same("stream_events"), when="a streamed HTTP request"),
        Plug(
            "check_speculative_decode",
            ("propose_ngram",),
            lambda f, c: {"propose_ngram": ngram_proposer(f[0])},
            when="speculative_config={'method': 'ngram'}, on the steps that propose",
        ),
        Plug(
            "check_response_cache",
            ("response_cache",),
            lambda f, c: {"response_cache": lambda capacity: f[0](capacity)},
            when="minillm serve --response-cache N",
        ),
    ]
}


def heads_as_ranges(heads_of_rank):
    """Hook ``heads_of_rank`` from chapter 09's function (any sequences): the model slices with ranges."""

    def run(*args):
        q, kv = (list(h) for h in heads_of_rank(*args))
        return range(q[0], q[-1] + 1), range(kv[0], kv[-1] + 1)

    return run
