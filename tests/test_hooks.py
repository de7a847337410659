"""The hook points (``minillm.hooks``): the registry's contract, and — for every hook — proof
that the engine really calls it.

For each hook, two tests on the tiny model: a recording wrapper that delegates to what was
installed is called and leaves the output unchanged; and a deliberately wrong implementation
changes what the engine does. The second is the one that fails if a refactor makes the engine
bypass the hook — then a course chapter would silently grade the package's own code.
"""

from __future__ import annotations

import re

import pytest
import torch

import minillm.hooks as hooks
from minillm import LLM, LLMEngine, SamplingParams
from minillm.engine.scheduler import SchedulerOutput

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=3)
PROMPTS = [
    "Caches keep keys and values; attention reads them back. Caches keep keys",
    "To be, or not to be, that is the question: whether",
    "café, naïve, 東京",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False,
         "prompt_lookup_scaled": False}  # always k: counted below


def tokens(llm, params=GREEDY, prompts=PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


def recorder(name: str, calls: list):
    """A wrapper around what hook ``name`` runs now that notes each call and changes nothing."""
    inner = hooks.current(name)

    def record(*args, **kwargs):
        calls.append(args)
        return inner(*args, **kwargs)

    return record


def pool_bytes(model_dir, blocks: int, block_size: int) -> int:
    from minillm.config import ModelConfig
    from minillm.kvcache.addressing import kv_bytes_per_token

    return blocks * block_size * kv_bytes_per_token(ModelConfig.from_folder(model_dir), torch.float32)


# ---------------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------------


def test_every_hook_has_its_reference_registered_by_its_owner():
    import minillm.kv_head_pooling  # noqa: F401  (a checkpoint tool: nothing in the engine imports it)
    import minillm.quantization.checkpoint  # noqa: F401  (the quantization modules load lazily)
    import minillm.server.streaming  # noqa: F401  (the server's app imports it)

    for name, point in hooks.points().items():
        assert point.doc and point.signature.startswith(name + "(") and point.chapter, name
        assert hooks.default(name).__module__ == point.owner, name
        assert hooks.current(name) is hooks.default(name) is getattr(hooks, name), name


def test_every_hook_is_called_where_its_declaration_says():
    from pathlib import Path

    root = Path(hooks.__file__).parent.parent
    for name, point in hooks.points().items():
        assert re.search(rf"\bhooks\.{name}\(", (root / point.caller).read_text()), (name, point.caller)


def test_every_hook_has_its_engine_test_below():
    tested = {n.split("_calls_")[0].removeprefix("test_") for n in globals() if "_calls_" in n}
    assert tested == set(hooks.points())


def test_an_unknown_hook_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"no hook named 'block_hashh'; the hooks are: .*block_hash"):
        with hooks.override(block_hashh=lambda parent, tokens: 0):
            pass
    with pytest.raises(ValueError, match="no hook named 'nope'"):
        hooks.default("nope")


def test_an_override_is_restored_after_an_exception_and_nests():
    reference = hooks.current("block_hash")

    def first(parent, tokens):
        return 1

    def second(parent, tokens):
        return 2

    with pytest.raises(KeyError):
        with hooks.override(block_hash=first):
            assert hooks.block_hash(None, [1]) == 1
            with hooks.override(block_hash=second):
                assert hooks.block_hash(None, [1]) == 2 and hooks.current("block_hash") is second
            assert hooks.block_hash(None, [1]) == 1
            raise KeyError("the body failed")
    assert hooks.block_hash is reference is hooks.current("block_hash")


def test_a_bad_override_installs_nothing():
    reference = hooks.current("block_hash")
    with pytest.raises(TypeError, match="needs a function"):
        with hooks.override(block_hash=lambda p, t: 0, block_pool=42):
            pass
    with pytest.raises(ValueError):
        with hooks.override(block_hash=lambda p, t: 0, nope=print):
            pass
    assert hooks.block_hash is reference


def test_an_override_made_before_the_owner_registers_still_wins():
    hooks.probe = hooks._declare("probe", "probe()", "00", "tests", "tests/test_hooks.py", "a throwaway hook")
    try:
        with pytest.raises(RuntimeError, match="has no implementation"):
            hooks.current("probe")()
        with hooks.override(probe=lambda: "override"):
            hooks.reference("probe")(lambda: "reference")  # the owner module imported late
            assert hooks.probe() == "override"
        assert hooks.probe() == "reference"
    finally:
        del hooks._POINTS["probe"]
        del hooks.probe


# ---------------------------------------------------------------------------------------------
# Chapters 01, 02, 05: attention and the contiguous cache
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def contiguous(tiny_model):
    llm = LLM(tiny_model, dtype="fp32", mode="contiguous", attention_backend="torch")
    return llm, tokens(llm)


def test_torch_attention_calls_go_through_the_hook(contiguous, tiny_model):
    llm, reference = contiguous
    calls = []
    with hooks.override(torch_attention=recorder("torch_attention", calls)):
        assert tokens(llm) == reference
    assert len(calls) >= 2 * llm.model_config.num_layers  # every layer, every step
    paged = LLM(tiny_model, dtype="fp32", attention_backend="torch")  # the paged reference step too
    calls.clear()
    with hooks.override(torch_attention=recorder("torch_attention", calls)):
        tokens(paged)
    assert calls
    with hooks.override(torch_attention=lambda q, k, v, mask, is_causal, scale: torch.zeros_like(q)):
        assert tokens(llm) != reference


def test_decoder_layer_calls_go_through_the_hook(contiguous, tiny_model):
    llm, reference = contiguous
    calls = []
    with hooks.override(decoder_layer=recorder("decoder_layer", calls)):
        assert tokens(llm) == reference
    assert len(calls) >= 2 * llm.model_config.num_layers  # every layer, every step
    paged = LLM(tiny_model, dtype="fp32")  # the default engine's layers too
    calls.clear()
    with hooks.override(decoder_layer=recorder("decoder_layer", calls)):
        tokens(paged)
    assert len(calls) >= 2 * llm.model_config.num_layers
    with hooks.override(decoder_layer=lambda layer, x, cos, sin, step: x):  # every block skipped
        assert tokens(llm) != reference


def test_apply_rope_calls_go_through_the_hook(contiguous, tiny_model):
    llm, reference = contiguous
    calls = []
    with hooks.override(apply_rope=recorder("apply_rope", calls)):
        assert tokens(llm) == reference
    assert len(calls) >= 2 * llm.model_config.num_layers  # every layer, every step
    paged = LLM(tiny_model, dtype="fp32")  # the default engine's layers too
    calls.clear()
    with hooks.override(apply_rope=recorder("apply_rope", calls)):
        tokens(paged)
    assert len(calls) >= 2 * llm.model_config.num_layers
    with hooks.override(apply_rope=lambda x, cos, sin: x):  # no positions at all
        assert tokens(llm) != reference


def test_filter_logits_calls_go_through_the_hook(contiguous):
    llm, greedy = contiguous
    sampled = tokens(llm, SAMPLED)
    calls = []
    with hooks.override(filter_logits=recorder("filter_logits", calls)):
        assert tokens(llm) == greedy
        assert not calls  # greedy rows take the argmax: the filter never runs
        assert tokens(llm, SAMPLED) == sampled
    assert {args[1:] for args in calls} == {(0.8, 0, 1.0)}
    assert max(args[0].shape[0] for args in calls) == len(PROMPTS)  # one call for the rows sharing settings
    mixed = [SAMPLED, SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.2, top_k=5, seed=4), SAMPLED]
    calls.clear()
    with hooks.override(filter_logits=recorder("filter_logits", calls)):
        llm.generate(PROMPTS, mixed)
    assert {args[1:] for args in calls} == {(0.8, 0, 1.0), (1.2, 5, 1.0)}

    def top_only(logits, temperature, top_k, top_p):  # a filter that keeps only the top token: greedy
        return logits.masked_fill(logits < logits.max(dim=-1, keepdim=True).values, float("-inf"))

    with hooks.override(filter_logits=top_only):
        assert tokens(llm, SAMPLED) == greedy != sampled


def test_sample_calls_go_through_the_hook(contiguous):
    llm, reference = contiguous
    calls = []
    with hooks.override(sample=recorder("sample", calls)):
        assert tokens(llm) == reference
    assert calls
    with hooks.override(sample=lambda logits, params, generators, seen=None: [0] * len(params)):
        assert tokens(llm) != reference  # every token is token 0


def test_append_token_calls_go_through_the_hook(contiguous):
    llm, reference = contiguous
    calls = []
    with hooks.override(append_token=recorder("append_token", calls)):
        assert tokens(llm) == reference
    assert len(calls) == sum(len(t) for t in reference)  # every generated token, once

    def never_ends(seq, token_id):  # appends, but never says "length": the engine's own limit is not there
        seq.output_token_ids.append(token_id)
        return "stop" if len(seq.output_token_ids) >= 2 else None

    with hooks.override(append_token=never_ends):
        assert [len(t) for t in tokens(llm)] == [2] * len(reference)


def test_take_stream_text_calls_go_through_the_hook(contiguous):
    llm, _ = contiguous
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    streamed = "".join(d.text for d in llm.stream(PROMPTS[0], params))
    calls = []
    with hooks.override(take_stream_text=recorder("take_stream_text", calls)):
        assert "".join(d.text for d in llm.stream(PROMPTS[0], params)) == streamed
    assert len(calls) >= 8  # a delta per step
    with hooks.override(take_stream_text=lambda seq: "x"):
        assert "".join(d.text for d in llm.stream(PROMPTS[0], params)) == "x" * len(calls)


def test_kv_write_calls_go_through_the_hook(contiguous):
    llm, reference = contiguous
    calls = []
    with hooks.override(kv_write=recorder("kv_write", calls)):
        assert tokens(llm) == reference
    assert {args[4] for args in calls} >= {0}  # the prefill writes from position 0
    with hooks.override(kv_write=lambda k_cache, v_cache, k_new, v_new, start: None):  # stores nothing
        assert tokens(llm) != reference


def test_contiguous_cache_calls_go_through_the_hook(contiguous):
    from minillm.kvcache import ContiguousKVCache

    llm, reference = contiguous
    calls = []
    with hooks.override(contiguous_cache=recorder("contiguous_cache", calls)):
        assert tokens(llm) == reference
    assert calls

    class Forgetful(ContiguousKVCache):
        def move_row(self, src, dst, length):  # a finished row's place is taken, but nothing is copied
            pass

    mixed = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [PROMPTS[0], PROMPTS[1] + " and more words here"]
    short = [SamplingParams(max_tokens=3, ignore_eos=True), mixed]
    expected = [o.token_ids for o in llm.generate(prompts, short)]
    with hooks.override(contiguous_cache=Forgetful):
        assert [o.token_ids for o in llm.generate(prompts, short)] != expected


def test_rope_tables_calls_go_through_the_hook(contiguous, tiny_model):
    llm, reference = contiguous
    calls = []
    with hooks.override(rope_tables=recorder("rope_tables", calls)):  # the tables are built as a model loads
        rebuilt = LLM(tiny_model, dtype="fp32", mode="contiguous", attention_backend="torch")
    assert tokens(rebuilt) == reference
    built = [(2 * args[0].shape[0], args[1]) for args in calls]  # (head_dim, positions) of each table
    assert built == [(llm.model_config.head_dim, rebuilt.model.rope.max_positions)]

    def no_rotation(inv_freq, max_positions):  # every position looks like position 0
        shape = (max_positions, 2 * inv_freq.shape[0])
        return torch.ones(shape), torch.zeros(shape)

    with hooks.override(rope_tables=no_rotation):
        blind = LLM(tiny_model, dtype="fp32", mode="contiguous", attention_backend="torch")
    assert tokens(blind) != reference


# ---------------------------------------------------------------------------------------------
# Chapter 03: the paged cache
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paged(tiny_model):
    """A maker of paged engines (a wrong hook leaves wrong K/V in a prefix cache: each run gets
    its own engine), and their tokens."""

    def make():
        return LLM(tiny_model, dtype="fp32", attention_backend="torch", block_size=4)

    return make, tokens(make())


def test_slot_mapping_calls_go_through_the_hook(paged):
    make, reference = paged
    calls = []
    with hooks.override(slot_mapping=recorder("slot_mapping", calls)):
        assert tokens(make()) == reference
    assert calls
    with hooks.override(slot_mapping=lambda table, start, n, block_size: [table[0] * block_size] * n):
        assert tokens(make()) != reference  # every token's K/V written over the same slot


def test_grow_table_calls_go_through_the_hook(paged):
    make, reference = paged
    calls = []
    with hooks.override(grow_table=recorder("grow_table", calls)):
        assert tokens(make()) == reference
    assert calls

    def never_copies(table, num_computed, num_new, block_size, ref_count, take, release):
        while len(table) * block_size < num_computed + num_new:  # grows, but writes into shared blocks
            table.append(take())
        return []

    fork = SamplingParams(max_tokens=8, n=2, temperature=0.8, seed=3, ignore_eos=True)
    llm = make()
    expected = [s.token_ids for s in llm.generate([PROMPTS[0]], fork)[0].samples]
    with hooks.override(grow_table=never_copies):
        got = [s.token_ids for s in make().generate([PROMPTS[0]], fork)[0].samples]
    assert got != expected  # the two samples overwrite each other's last prompt block


def test_gather_kv_calls_go_through_the_hook(paged):
    make, reference = paged
    calls = []
    with hooks.override(gather_kv=recorder("gather_kv", calls)):
        assert tokens(make()) == reference
    assert calls

    def empty(pool, layer, block_tables, by_slot=False):
        k, v = hooks.default("gather_kv")(pool, layer, block_tables, by_slot)
        return torch.zeros_like(k), torch.zeros_like(v)

    with hooks.override(gather_kv=empty):
        assert tokens(make()) != reference


def test_block_hash_calls_go_through_the_hook(tiny_model):
    shared = [PROMPTS[0] + " the first", PROMPTS[0] + " the second"]

    def hits(**override) -> tuple[list[list[int]], int]:
        llm = LLM(tiny_model, dtype="fp32", block_size=4)
        with hooks.override(**override):
            out = [tokens(llm, prompts=[p])[0] for p in shared]  # one after the other: the second hits
        return out, llm.engine.stats().prefix_cache_hits

    reference, reference_hits = hits()
    calls = []
    assert hits(block_hash=recorder("block_hash", calls)) == (reference, reference_hits)
    assert calls and reference_hits > 0
    constant, constant_hits = hits(block_hash=lambda parent, token_ids: 7)  # every block named alike
    assert constant == reference and constant_hits < reference_hits


def _block_tables(tiny_model, **override) -> list[dict]:
    with hooks.override(**override):  # the pool is built with the engine
        engine = LLMEngine(tiny_model, dtype="fp32", block_size=4)
    engine.record_block_tables = True
    for p in PROMPTS:
        engine.add_request(p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().kv_blocks_used == 0
    engine.block_manager.check_invariants()
    return [r.block_tables for r in engine.step_records]


def test_block_pool_calls_go_through_the_hook(tiny_model):
    from minillm.kvcache.block_manager import BlockPool

    reference = _block_tables(tiny_model)
    built = []

    def recording(num_blocks):
        built.append(num_blocks)
        return hooks.default("block_pool")(num_blocks)

    assert _block_tables(tiny_model, block_pool=recording) == reference
    assert len(built) == 1 and built[0] > 0

    class NewestFirst(BlockPool):  # a valid pool, but it hands out the free list's other end
        def allocate(self):
            if not self.free_ids:
                return super().allocate()
            block_id = self.free_ids.pop()
            self.blocks[block_id].ref_count = 1
            return block_id

    assert _block_tables(tiny_model, block_pool=NewestFirst) != reference


def test_a_pool_that_never_frees_leaks_every_block(paged):
    from minillm.kvcache.block_manager import BlockPool

    make, reference = paged

    class Leaky(BlockPool):
        def release(self, block_id):
            pass

    with hooks.override(block_pool=Leaky):
        leaky = make()
    assert tokens(leaky) == reference
    assert leaky.engine.stats().kv_blocks_used > 0  # every block it ever took


# ---------------------------------------------------------------------------------------------
# Chapter 04: batching
# ---------------------------------------------------------------------------------------------


def _run(tiny_model, override: dict, max_steps: int = 500, priorities=(0, 0, 0), **options) -> tuple[list, LLMEngine]:
    """PROMPTS through a fresh engine with ``options`` (built before ``override`` is installed:
    its warm-up must finish); outputs in order (None: not finished within ``max_steps``)."""
    engine = LLMEngine(tiny_model, dtype="fp32", block_size=4, **options)
    ids = [engine.add_request(p, GREEDY, priority=priority) for p, priority in zip(PROMPTS, priorities)]
    done = {}
    with hooks.override(**override):
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            done |= {d.request_id: d.output for d in engine.step() if d.output is not None}
    return [done.get(i) for i in ids], engine


def test_tokens_to_run_calls_go_through_the_hook(tiny_model, paged):
    reference, calls = paged[1], []
    outputs, engine = _run(tiny_model, {"tokens_to_run": recorder("tokens_to_run", calls)}, max_num_batched_tokens=8)
    assert [o.token_ids for o in outputs] == reference and calls
    steps = engine.stats().num_steps
    one_each = {"tokens_to_run": lambda scheduler, seq, budget, out: min(1, budget)}  # a token per step
    outputs, engine = _run(tiny_model, one_each, max_num_batched_tokens=8)
    assert [o.token_ids for o in outputs] == reference and engine.stats().num_steps > steps


def test_choose_victim_calls_go_through_the_hook(tiny_model, paged):
    reference, calls = paged[1], []
    # 12 blocks for 3 requests, the shortest urgent: it runs first and others must make room for it
    small = dict(kv_cache_memory=pool_bytes(tiny_model, 12, 4), max_num_batched_tokens=32, priorities=(0, 0, -1))
    outputs, _ = _run(tiny_model, {"choose_victim": recorder("choose_victim", calls)}, **small)
    assert [o.token_ids for o in outputs] == reference and calls
    preempted = [o.num_preemptions for o in outputs]
    itself = {"choose_victim": lambda scheduler, seq, candidates: seq}  # always the one that grows
    outputs, _ = _run(tiny_model, itself, **small)
    assert [o.token_ids for o in outputs] == reference and [o.num_preemptions for o in outputs] != preempted


def test_schedule_calls_go_through_the_hook(tiny_model, paged):
    reference, calls = paged[1], []
    outputs, _ = _run(tiny_model, {"schedule": recorder("schedule", calls)})
    assert [o.token_ids for o in outputs] == reference and calls
    idle = {"schedule": lambda scheduler, now: SchedulerOutput()}  # a policy that runs nothing
    outputs, engine = _run(tiny_model, idle, max_steps=5)
    assert outputs == [None] * len(PROMPTS) and engine.stats().num_waiting == len(PROMPTS)


def test_reserve_calls_go_through_the_hook(tiny_model, paged):
    reference, calls = paged[1], []
    outputs, engine = _run(tiny_model, {"reserve": recorder("reserve", calls)}, max_num_batched_tokens=8)
    assert [o.token_ids for o in outputs] == reference and calls
    steps = engine.stats().num_steps

    def one_token(scheduler, seq, n, out, drafts=()):  # a running prompt continues one token a step
        return hooks.default("reserve")(scheduler, seq, min(n, 1), out, drafts)

    outputs, engine = _run(tiny_model, {"reserve": one_token}, max_num_batched_tokens=8)
    assert [o.token_ids for o in outputs] == reference and engine.stats().num_steps > steps


def test_try_admit_calls_go_through_the_hook(tiny_model, paged):
    reference, calls = paged[1], []
    outputs, engine = _run(tiny_model, {"try_admit": recorder("try_admit", calls)})
    assert [o.token_ids for o in outputs] == reference and calls
    steps = engine.stats().num_steps

    def alone(scheduler, seq, budget, out):  # one request at a time
        return 0 if scheduler.running else hooks.default("try_admit")(scheduler, seq, budget, out)

    outputs, engine = _run(tiny_model, {"try_admit": alone})
    assert [o.token_ids for o in outputs] == reference and engine.stats().num_steps > steps


# ---------------------------------------------------------------------------------------------
# Chapter 05: pooling K/V heads
# ---------------------------------------------------------------------------------------------


def test_step_layout_calls_go_through_the_hook(tiny_model):
    llm = LLM(tiny_model, dtype="fp32", attention_backend="torch", compile=False, max_num_batched_tokens=16)
    reference = tokens(llm)
    calls = []
    with hooks.override(step_layout=recorder("step_layout", calls)):
        assert tokens(llm) == reference
    assert len(calls) >= 16  # every step of the paged runner (prompts chunked by the 16-token budget)

    def swapped_rows(runner, chunks):
        layout = hooks.default("step_layout")(runner, chunks)
        layout.logit_index = layout.logit_index.flip(0)  # the requests' logits swapped
        return layout

    with hooks.override(step_layout=swapped_rows):
        assert tokens(llm) != reference


def test_paged_attention_calls_go_through_the_hook(tiny_model):
    for backend in ("torch", "cpu"):  # the reference step, and the CPU kernels' (its decodes in C++)
        llm = LLM(tiny_model, dtype="fp32", attention_backend=backend, compile=False, max_num_batched_tokens=16)
        reference = tokens(llm)
        calls = []
        with hooks.override(paged_attention=recorder("paged_attention", calls)):
            assert tokens(llm) == reference
        assert len(calls) >= 16 * llm.model_config.num_layers  # every layer of every step
        with hooks.override(paged_attention=lambda step, layer, q, k, v, scale: torch.zeros_like(q)):
            assert tokens(llm) != reference


def test_pool_heads_calls_go_through_the_hook(tiny_models, tmp_path):
    from minillm.config import ModelConfig
    from minillm.kv_head_pooling import pool_kv_heads

    source = tiny_models["qwen2_bias"]  # 2 K/V heads with k/v biases: weights and biases both pool

    def pooled_tokens(name: str, **override) -> list[list[int]]:
        with hooks.override(**override):
            folder = pool_kv_heads(source, tmp_path / name, 1)
        return tokens(LLM(str(folder), dtype="fp32"))

    reference = pooled_tokens("reference")
    calls = []
    assert pooled_tokens("recorded", pool_heads=recorder("pool_heads", calls)) == reference
    config = ModelConfig.from_folder(source)
    assert len(calls) == 4 * config.num_layers  # k_proj, v_proj: weight and bias
    shapes = {tuple(weight.shape) for weight, *_ in calls}
    assert shapes == {(2 * config.head_dim, config.hidden_size), (2 * config.head_dim, 1)}

    def first_head_only(weight, num_heads, num_kv_heads):
        rows, cols = weight.shape
        return weight.view(num_kv_heads, num_heads // num_kv_heads, rows // num_heads, cols)[:, 0].reshape(-1, cols)

    assert pooled_tokens("first-head", pool_heads=first_head_only) != reference


# ---------------------------------------------------------------------------------------------
# Chapter 05: the sliding window
# ---------------------------------------------------------------------------------------------


def test_blocks_behind_window_calls_go_through_the_hook(tiny_model):
    def peak(**override) -> tuple[list[list[int]], int]:
        llm = LLM(tiny_model, dtype="fp32", attention_backend="torch", sliding_window=8, block_size=4)
        with hooks.override(**override):
            out = tokens(llm)
        return out, max(r.blocks_used for r in llm.engine.step_records)

    reference, reference_peak = peak()
    calls = []
    assert peak(blocks_behind_window=recorder("blocks_behind_window", calls)) == (reference, reference_peak)
    assert calls
    kept, kept_peak = peak(blocks_behind_window=lambda num_computed_tokens, window, block_size: 0)
    assert kept == reference and kept_peak > reference_peak  # nothing given back


# ---------------------------------------------------------------------------------------------
# Chapter 07: quantization
# ---------------------------------------------------------------------------------------------


def test_quantize_int8_calls_go_through_the_hook(tiny_model):
    reference = tokens(LLM(tiny_model, dtype="fp32", quantization="int8"))
    calls = []
    with hooks.override(quantize_int8=recorder("quantize_int8", calls)):
        llm = LLM(tiny_model, dtype="fp32", quantization="int8")
    assert tokens(llm) == reference and len(calls) >= 4 * llm.model_config.num_layers

    def zero(weight):
        q, scale = hooks.default("quantize_int8")(weight)
        return torch.zeros_like(q), scale

    with hooks.override(quantize_int8=zero):
        assert tokens(LLM(tiny_model, dtype="fp32", quantization="int8")) != reference


def test_quantize_int4_calls_go_through_the_hook(tiny_model):
    reference = tokens(LLM(tiny_model, dtype="fp32", quantization="int4"))
    calls = []
    with hooks.override(quantize_int4=recorder("quantize_int4", calls)):
        llm = LLM(tiny_model, dtype="fp32", quantization="int4")
    assert tokens(llm) == reference and len(calls) >= 4 * llm.model_config.num_layers  # qkv, o, gate_up, down
    assert {group_size for _, group_size in calls} == {32}  # the default group reaches the hook

    def floored(weight, group_size):  # levels rounded down: every weight off by up to a whole step
        w = weight.float().reshape(weight.shape[0], -1, group_size)
        low = w.amin(-1, keepdim=True)
        scale = ((w.amax(-1, keepdim=True) - low) / 15).clamp(min=1e-12)
        q = torch.floor((w - low) / scale).to(torch.uint8).reshape(weight.shape)
        return q, scale.squeeze(-1), low.squeeze(-1)

    with hooks.override(quantize_int4=floored):
        assert tokens(LLM(tiny_model, dtype="fp32", quantization="int4")) != reference


def _int4_tokens(tiny_model, tmp_path, write: dict, read: dict) -> list[list[int]]:
    from minillm.models import load_model
    from minillm.quantization.checkpoint import save_quantized

    out = tmp_path / f"int4-{len(list(tmp_path.iterdir()))}"
    with hooks.override(**write):
        save_quantized(load_model(tiny_model, torch.float32), tiny_model, out, "int4", group_size=32, dtype="fp32")
    with hooks.override(**read):
        llm = LLM(str(out), dtype="fp32")
    return tokens(llm)


def swapped_nibbles(q):
    return (q[..., 1::2] | (q[..., 0::2] << 4)).to(torch.uint8)


def test_pack_int4_calls_go_through_the_hook(tiny_model, tmp_path):
    reference = _int4_tokens(tiny_model, tmp_path, {}, {})
    calls = []
    assert _int4_tokens(tiny_model, tmp_path, {"pack_int4": recorder("pack_int4", calls)}, {}) == reference
    assert calls
    assert _int4_tokens(tiny_model, tmp_path, {"pack_int4": swapped_nibbles}, {}) != reference


def test_unpack_int4_calls_go_through_the_hook(tiny_model, tmp_path):
    reference = _int4_tokens(tiny_model, tmp_path, {}, {})
    calls = []
    assert _int4_tokens(tiny_model, tmp_path, {}, {"unpack_int4": recorder("unpack_int4", calls)}) == reference
    assert calls

    def swapped(packed):
        return hooks.default("unpack_int4")(swapped_nibbles(hooks.default("unpack_int4")(packed)))

    assert _int4_tokens(tiny_model, tmp_path, {}, {"unpack_int4": swapped}) != reference


def test_quantize_kv_calls_go_through_the_hook(tiny_model):
    llm = LLM(tiny_model, dtype="fp32", attention_backend="torch", kv_cache_dtype="int8", block_size=4)
    reference = tokens(llm)
    calls = []
    with hooks.override(quantize_kv=recorder("quantize_kv", calls)):
        assert tokens(llm) == reference
    assert calls and all(args[1] == "int8" for args in calls)

    def zero(x, kind="int8"):
        q, scale = hooks.default("quantize_kv")(x, kind)
        return torch.zeros_like(q), scale

    with hooks.override(quantize_kv=zero):
        assert tokens(llm) != reference


# ---------------------------------------------------------------------------------------------
# Chapter 08: speculative decoding
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speculating(tiny_model):
    """A maker of engines speculating by prompt lookup, and their greedy tokens (some of the
    proposals are rejected, so an acceptance rule that keeps them all shows)."""

    def make():
        return LLM(tiny_model, dtype="fp32", speculative_config=NGRAM, block_size=4)

    outputs = make().generate(PROMPTS, GREEDY)
    assert sum(o.metrics.spec_proposed for o in outputs) > sum(o.metrics.spec_accepted for o in outputs)
    return make, [o.token_ids for o in outputs]


def test_propose_ngram_calls_go_through_the_hook(speculating):
    make, reference = speculating
    calls = []
    with hooks.override(propose_ngram=recorder("propose_ngram", calls)):
        assert tokens(make()) == reference
    assert calls
    llm = make()
    with hooks.override(propose_ngram=lambda tokens, k, max_n, min_n: []):  # never proposes: plain decoding
        outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == reference and sum(o.metrics.spec_proposed for o in outputs) == 0


def test_accept_greedy_calls_go_through_the_hook(speculating):
    make, reference = speculating
    calls = []
    with hooks.override(accept_greedy=recorder("accept_greedy", calls)):
        assert tokens(make()) == reference
    assert calls
    with hooks.override(accept_greedy=lambda target, drafts: [*drafts, target[len(drafts)]]):  # keeps every proposal
        assert tokens(make()) != reference


def test_accept_sampled_calls_go_through_the_hook(speculating):
    make, _ = speculating
    reference = tokens(make(), SAMPLED)
    calls = []
    with hooks.override(accept_sampled=recorder("accept_sampled", calls)):
        assert tokens(make(), SAMPLED) == reference
    assert calls
    keep_all = lambda p, q, drafts, generator=None: [*drafts, int(p[len(drafts)].argmax())]  # noqa: E731
    with hooks.override(accept_sampled=keep_all):
        assert tokens(make(), SAMPLED) != reference


def test_tree_attention_mask_calls_go_through_the_hook():
    """tree_pass builds its tree mask through the hook: a mask that lets every node see every
    other one changes the nodes' logits."""
    from minillm.assets import resolve_model
    from minillm.models import load_model
    from minillm.speculative.tree import tree_pass

    model = load_model(resolve_model("tiny-shakespeare-8m"), torch.float32)
    prompt, drafts, parents = [5, 6, 7, 8], [9, 10, 11], [-1, -1, 1]
    reference, _ = tree_pass(model, prompt, drafts, parents)
    calls = []
    with hooks.override(tree_attention_mask=recorder("tree_attention_mask", calls)):
        logits, _ = tree_pass(model, prompt, drafts, parents)
    assert calls == [(parents,)] and torch.equal(logits, reference)
    with hooks.override(tree_attention_mask=lambda p: torch.ones(len(p), len(p), dtype=torch.bool)):
        leaky, _ = tree_pass(model, prompt, drafts, parents)
    assert not torch.allclose(leaky[1:], reference[1:], atol=1e-4)


def test_accept_tree_calls_go_through_the_hook():
    """tree_generate takes each pass's verdict from the hook and refuses one that is not a branch
    of the tree with its tokens: a verdict that accepts nothing keeps the tokens (the target's
    own) and costs passes."""
    from minillm.assets import resolve_model
    from minillm.config import ModelConfig
    from minillm.models import load_model
    from minillm.speculative.eagle import EagleConfig, EagleHead
    from minillm.speculative.tree import tree_generate

    folder = resolve_model("tiny-shakespeare-8m")
    mc = ModelConfig.from_folder(folder)
    model = load_model(folder, torch.float32)
    torch.manual_seed(0)
    cfg = EagleConfig(mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size,
                      mc.rms_norm_eps, 64, "tiny-shakespeare-8m")  # fmt: skip
    head = EagleHead(cfg, model, torch.arange(64)).eval()
    prompt = [5, 6, 7, 8, 9, 10]
    plain = tree_generate(model, head, prompt, 12, depth=1, branches=1)
    reference = tree_generate(model, head, prompt, 12, depth=2, branches=3)
    assert reference["token_ids"] == plain["token_ids"]
    calls = []
    with hooks.override(accept_tree=recorder("accept_tree", calls)):
        assert tree_generate(model, head, prompt, 12, depth=2, branches=3) == reference
    assert len(calls) == reference["passes"] - 1  # every pass but the prefill

    def nothing(parents, drafts, target_tokens):
        return [], [target_tokens[0]]

    with hooks.override(accept_tree=nothing):
        out = tree_generate(model, head, prompt, 12, depth=2, branches=3)
    assert out["token_ids"] == reference["token_ids"] and out["passes"] == 12
    with hooks.override(accept_tree=lambda p, d, t: ([1], [d[1], t[2]])), pytest.raises(ValueError, match="not a branch"):
        tree_generate(model, head, prompt, 12, depth=2, branches=3)  # node 1 is a child of node 0, not of the root
    with hooks.override(accept_tree=lambda p, d, t: ([], [])), pytest.raises(ValueError, match="then the target's"):
        tree_generate(model, head, prompt, 12, depth=2, branches=3)
    with hooks.override(accept_tree=lambda p, d, t: [t[0]]), pytest.raises(ValueError, match="two lists"):
        tree_generate(model, head, prompt, 12, depth=2, branches=3)


def test_blocks_to_roll_back_calls_go_through_the_hook(speculating):
    make, reference = speculating
    calls = []
    llm = make()
    with hooks.override(blocks_to_roll_back=recorder("blocks_to_roll_back", calls)):
        assert tokens(llm) == reference
    assert calls and llm.engine.stats().kv_blocks_used == 0

    def keep_the_freed(table, num_tokens, block_size):  # forgets to give the rejected blocks back
        kept, _ = hooks.default("blocks_to_roll_back")(table, num_tokens, block_size)
        return kept, []

    leaky = make()
    with hooks.override(blocks_to_roll_back=keep_the_freed):
        tokens(leaky)
    assert leaky.engine.stats().kv_blocks_used > 0


def test_verify_calls_go_through_the_hook(speculating):
    make, reference = speculating
    calls = []
    llm = make()
    with hooks.override(verify=recorder("verify", calls)):
        assert tokens(llm) == reference
    assert calls and all(args[0] is llm.engine.speculator for args in calls)
    with hooks.override(verify=lambda speculator, seq, drafts, logits: [*drafts, int(logits[-1].argmax())]):
        assert tokens(make()) != reference


# ---------------------------------------------------------------------------------------------
# Chapter 09: the K/V-head split
# ---------------------------------------------------------------------------------------------


def test_heads_of_rank_calls_go_through_the_hook(tiny_model):
    from minillm.layers.tensor_parallel import ParallelContext
    from minillm.models import load_model

    reference = tokens(LLM(tiny_model, dtype="fp32"))
    calls = []
    with hooks.override(heads_of_rank=recorder("heads_of_rank", calls)):
        llm = LLM(tiny_model, dtype="fp32")
    assert tokens(llm) == reference and len(calls) == llm.model_config.num_layers

    # A rank's shard (no collective runs while loading): rank 0 of 2 holds the first group.
    rank0 = ParallelContext(tp_rank=0, tp_size=2)
    first = load_model(tiny_model, torch.float32, parallel=rank0)

    def second_group_first(num_heads, num_kv_heads, rank, tp_size):  # a valid split, dealt the other way
        return hooks.default("heads_of_rank")(num_heads, num_kv_heads, tp_size - 1 - rank, tp_size)

    with hooks.override(heads_of_rank=second_group_first):
        other = load_model(tiny_model, torch.float32, parallel=rank0)
    attn, other_attn = first.layers[0].attn, other.layers[0].attn
    assert attn.num_heads == other_attn.num_heads
    assert not torch.equal(attn.qkv_proj.weight, other_attn.qkv_proj.weight)  # the other heads' rows


# ---------------------------------------------------------------------------------------------
# Chapter 10: the streaming detokenizer
# ---------------------------------------------------------------------------------------------


def test_detokenize_step_calls_go_through_the_hook(tiny_model):
    llm = LLM(tiny_model, dtype="fp32")
    reference = [o.text for o in llm.generate(PROMPTS, GREEDY)]
    # the random model's answers hold characters of several byte tokens (and invalid bytes, as U+FFFD)
    assert any(ord(c) > 127 and c != "\ufffd" for t in reference for c in t)
    calls = []
    with hooks.override(detokenize_step=recorder("detokenize_step", calls)):
        assert [o.text for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert len(calls) == len(PROMPTS) * GREEDY.max_tokens  # each generated token once

    def one_token_at_a_time(decode, ids, prefix_offset, read_offset):  # cuts characters into U+FFFD
        return decode(ids[-1:]), read_offset, len(ids)

    with hooks.override(detokenize_step=one_token_at_a_time):
        assert [o.text for o in llm.generate(PROMPTS, GREEDY)] != reference


# ---------------------------------------------------------------------------------------------
# Chapter 10: the streaming endpoint
# ---------------------------------------------------------------------------------------------


def test_response_cache_calls_go_through_the_hook(tiny_model, monkeypatch):
    """``minillm serve --response-cache N`` builds its cache through the hook: the app serves with
    what the hook returned (a learner's class, under ``serve --your-engine``)."""
    from minillm.server import launch

    served = []
    monkeypatch.setattr(launch, "run_server", lambda app, engines, **options: served.append(app))
    calls = []
    with hooks.override(response_cache=recorder("response_cache", calls)):
        launch.serve([str(tiny_model)], response_cache=3, dtype="fp32", kv_cache_memory=4_000_000)
    assert calls == [(3,)] and served[0].state.response_cache.capacity == 3

    class Mine(dict):
        key = staticmethod(lambda endpoint, body: None)

    with hooks.override(response_cache=lambda capacity: Mine()):
        launch.serve([str(tiny_model)], response_cache=3, dtype="fp32", kv_cache_memory=4_000_000)
    assert type(served[1].state.response_cache) is Mine
    launch.serve([str(tiny_model)], dtype="fp32", kv_cache_memory=4_000_000)  # no --response-cache: none
    assert served[2].state.response_cache is None


def test_stream_events_calls_go_through_the_hook(tiny_model):
    import json

    import httpx

    from minillm.server import ServerThread, build_app, build_engines
    from minillm.server.launch import served_name

    engines = build_engines([str(tiny_model)], dtype="fp32", kv_cache_memory=4_000_000)
    body = {"model": served_name(str(tiny_model)), "prompt": PROMPTS[:2], "max_tokens": 6, "temperature": 0, "stream": True}

    def events(server) -> list:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line]
        return [e if e == "[DONE]" else {**json.loads(e), "id": "-", "created": 0} for e in lines]

    calls = []
    inner = hooks.current("stream_events")

    def record(*args):
        calls.append(args)
        return inner(*args)

    async def done_at_once(streams, fmt, n, include_usage, prompt_tokens, abort):  # drops every delta
        for p in range(len(streams)):
            abort(p)
        yield b"data: [DONE]\n\n"

    with ServerThread(build_app(engines)) as server:
        reference = events(server)
        assert len(reference) == 2 * 6 + 1 and reference[-1] == "[DONE]"
        with hooks.override(stream_events=record):
            assert sorted(map(str, events(server))) == sorted(map(str, reference))  # the two prompts may interleave
        assert len(calls) == 1 and len(calls[0][0]) == 2  # one call per request, one stream per prompt
        with hooks.override(stream_events=done_at_once):
            assert events(server) == ["[DONE]"]
