"""The CPU decode fast path: ``compile=True`` (decode steps compiled ahead of time: a 1-row
graph over a static block window, and graphs that take any row count up to their bound, whose
rows attend in place through the C++ kernel called as an operator; kept on disk) and decode
attention computed in the dtype measured fastest.

The compiled engine must produce the eager engine's tokens — alone, in ragged batches, and
after preemption — with every step's logits close; one graph serves every context length; a
second start loads the graphs instead of compiling them."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from minillm import LLM, LLMEngine, SamplingParams
from minillm.attention import get_backend
from minillm.attention import precision as attention_precision
from minillm.attention.cpu_paged import StaticKernelDecodeStep
from minillm.attention.layout import KVPool, StepLayout
from minillm.attention.paged import ReferencePagedStep, StaticDecodeStep
from minillm.config import EngineConfig, ModelConfig
from minillm.kvcache import addressing
from minillm.kvcache.addressing import kv_bytes_per_token
from minillm.runtime import compiled_decode
from minillm.runtime.compiled_decode import CompiledDecode

PROMPTS = ["To be, or not to be", "Caches keep keys and values; attention reads them back.", "café", "the slings"]
# A pool of 14 blocks of 4 tokens: four sequences of ~40 tokens cannot all fit, so some are preempted.
ENGINE = dict(dtype="fp32", block_size=4, max_num_seqs=4, enable_prefix_caching=False)
POOL_BLOCKS = 14
# The default's shape in miniature (the default is one graph for 1-256 rows): one graph for any
# batch of 1-4 rows, unpadded (a single row padded to 2). Other engines compile a 1-row graph
# over the block window (what a graph bounded at 1 row is), or use the default.
COMPILED = dict(compile=True, compile_batch_sizes=(4,))


@pytest.fixture(scope="module", autouse=True)
def packages_folder(tmp_path_factory):
    """This module's compiled packages in a folder of their own: compiling the tiny models must
    not push a developer's SmolLM2 packages out of ``<cache>/compiled``."""
    folder = tmp_path_factory.mktemp("compiled")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled_decode, "packages_dir", lambda: folder)
        yield folder


@pytest.fixture(scope="module")
def engines(tiny_model):
    per_token = kv_bytes_per_token(ModelConfig.from_folder(tiny_model), torch.float32)
    memory = POOL_BLOCKS * ENGINE["block_size"] * per_token
    compiled = ready(LLM(tiny_model, kv_cache_memory=memory, **COMPILED, **ENGINE))
    eager = LLM(tiny_model, kv_cache_memory=memory, **ENGINE)
    return compiled, eager


def ready(llm: LLM) -> LLM:
    """Wait for the engine's background build (a compile in another process, or loading)."""
    status = llm.wait_for_fast_path(timeout=600)
    assert status.state == "ready", status
    return llm


def _counting(llm: LLM) -> list[int]:
    """Count the compiled step's calls (the fast path must actually run)."""
    graphs = llm.engine.graphs
    calls: list[int] = []
    run = graphs.run

    def counted(chunks, block_tables):
        calls.append(len(chunks))
        return run(chunks, block_tables)

    graphs.run = counted
    return calls


def test_compile_builds_the_compiled_step(engines):
    compiled, eager = engines
    graphs = compiled.engine.graphs
    assert isinstance(graphs, CompiledDecode)
    assert set(graphs.graphs) == {4} and graphs.free_rows(4)
    assert eager.engine.graphs is None
    for layer in compiled.model.linear_layers():  # the plain copies kept for the compiler are released
        assert getattr(layer, "plain_weight", None) is None


def test_a_second_start_loads_the_graphs_without_compiling(engines, tiny_model):
    """The packages the first engine compiled are on disk: an engine of the same model — with a
    pool of another size — loads them (no compile message, well under the target 10 s) and
    decodes the same tokens."""
    first, eager = engines
    memory = first.engine_config.kv_cache_memory * 3 // 2
    again = ready(LLM(tiny_model, kv_cache_memory=memory, **COMPILED, **ENGINE))
    assert again.engine.kv_cache.num_blocks != first.engine.kv_cache.num_blocks
    graphs = again.engine.graphs
    assert graphs.compile_seconds == {} and set(graphs.load_seconds) == {4}
    assert sum(graphs.load_seconds.values()) < 10
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    assert again.generate(PROMPTS[0], params)[0].token_ids == eager.generate(PROMPTS[0], params)[0].token_ids


def test_compile_is_on_by_default_for_a_big_enough_model_on_cpu(engines, tiny_model, monkeypatch):
    """compile=None (the default): the paged CPU engine compiles its decode step unless the model
    is too small to repay the compile, another feature owns the weights or the step, or
    MINILLM_COMPILE=0 (the test suite's setting)."""
    from minillm.engine import builder
    from minillm.models.loader import load_model

    assert EngineConfig().compile is None
    model = load_model(tiny_model, torch.float32)
    monkeypatch.setenv("MINILLM_COMPILE", "1")
    assert not builder.compile_by_default(EngineConfig(), model, "sdpa")  # a 1M-parameter model: too small
    monkeypatch.setattr(builder, "COMPILE_BY_DEFAULT_MIN_BYTES", 0)
    assert builder.compile_by_default(EngineConfig(), model, "sdpa")
    for ruled_out, backend in [
        (dict(mode="contiguous"), "sdpa"),
        (dict(quantization="awq"), "sdpa"),  # compiles when asked; not measured faster, so not by default
        (dict(quantization="w8a8"), "sdpa"),
        (dict(sparsity="2:4"), "sdpa"),
        ({}, "triton"),
    ]:
        assert not builder.compile_by_default(EngineConfig(**ruled_out), model, backend), ruled_out
    speculating = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert builder.compile_by_default(speculating, model, "sdpa")  # verify steps run compiled too
    assert builder.compile_by_default(EngineConfig(quantization="int8"), model, "sdpa")
    assert builder.compile_by_default(EngineConfig(quantization="int4", quantization_group_size=32), model, "sdpa")
    first, eager = engines  # the same model and pool: its graphs load from disk
    default = ready(LLM(tiny_model, kv_cache_memory=first.engine_config.kv_cache_memory, compile_batch_sizes=(4,),
                        **ENGINE))  # fmt: skip
    assert isinstance(default.engine.graphs, CompiledDecode)
    assert default.engine_config.compile is True  # what the default became, written back
    assert default.resolved.compile and default.resolved.decode_fast_path == "compiled (4,)"
    monkeypatch.setenv("MINILLM_COMPILE", "0")
    assert not builder.compile_by_default(EngineConfig(), model, "sdpa")


@pytest.mark.parametrize("method", ["int8", "int4", "awq", "w8a8"])
def test_quantized_weights_compile_too(tiny_model, method, tmp_path, monkeypatch):
    """Quantized linears inside the compiled graph (int8's and int4's packed matmuls, AWQ's
    scaled int4, W8A8's int8 x int8): the eager engine's tokens with the same method, alone and
    in a batch. (Their packages go to a folder of their own: eight more packages in the
    module's folder would prune the ones the other tests load.)"""
    monkeypatch.setattr(compiled_decode, "packages_dir", lambda: tmp_path)
    memory = (
        POOL_BLOCKS * 4 * ENGINE["block_size"] * kv_bytes_per_token(ModelConfig.from_folder(tiny_model), torch.float32)
    )
    quant = dict(quantization=method) | ({"quantization_group_size": 32} if method in ("int4", "awq") else {})
    compiled = ready(LLM(tiny_model, kv_cache_memory=memory, **quant, **COMPILED, **ENGINE))
    eager = LLM(tiny_model, kv_cache_memory=memory, compile=False, **quant, **ENGINE)
    calls = _counting(compiled)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 20, 7)]
    got = compiled.generate(PROMPTS[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager.generate(PROMPTS[:3], params)]
    assert 1 in calls and 3 in calls


def test_speculation_verifies_on_the_compiled_step(engines, tiny_model):
    """Speculative decoding stacks on the compiled step: each verify chunk (the last token and
    its proposals) runs as rows of the compiled graph, one per position. Greedy tokens are the
    plain engines' (compiled and eager) — one request at a time, in a batch whose pool is too
    small (preemption), and with prefix caching — across accepted runs and rollbacks."""
    compiled, eager = engines
    memory = compiled.engine_config.kv_cache_memory
    # always k (3 guesses whenever anything matches): neither the governor (test_governor.py) nor the
    # guesses' length (test_speculative.py) is this test's subject; the graph's 4-row bound is
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False,
             "prompt_lookup_scaled": False}
    spec = ready(LLM(tiny_model, kv_cache_memory=memory, speculative_config=ngram, **COMPILED, **ENGINE))
    assert spec.engine.graphs.compile_seconds == {}  # the same package serves the speculating engine
    verify_rows: list[int] = []  # the tokens of every verify chunk the compiled step ran
    run = spec.engine.graphs.run

    def counted(chunks, block_tables):
        verify_rows.extend(c.num_tokens for c in chunks if c.num_tokens > 1)
        return run(chunks, block_tables)

    spec.engine.graphs.run = counted
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:  # alone: 4 rows, the graph's bound
        expected = eager.generate(prompt, params)[0].token_ids
        assert compiled.generate(prompt, params)[0].token_ids == expected
        assert spec.generate(prompt, params)[0].token_ids == expected
    assert verify_rows and max(verify_rows) == 4
    outs = spec.generate(PROMPTS, params)  # a batch: its verify steps over 4 rows run eagerly
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager.generate(PROMPTS, params)]
    assert sum(o.num_preemptions for o in outs) > 0
    proposed, accepted = sum(o.metrics.spec_proposed for o in outs), sum(o.metrics.spec_accepted for o in outs)
    assert 0 < accepted < proposed  # accepted runs and rollbacks both happened
    spec.engine.block_manager.check_invariants()
    assert spec.engine.block_manager.num_used_blocks == 0

    cached = ready(LLM(tiny_model, kv_cache_memory=memory * 3, speculative_config=ngram, **COMPILED,
                       **(ENGINE | {"enable_prefix_caching": True})))  # fmt: skip
    shared = [PROMPTS[1] + " and again", PROMPTS[1] + " once more"]
    expected = [o.token_ids for o in eager.generate(shared, params)]
    for _ in range(2):
        outs = cached.generate(shared, params)
        assert [o.token_ids for o in outs] == expected
    assert sum(o.num_cached_tokens for o in outs) > 0


def test_an_eagle_head_drafts_from_the_compiled_steps_features(engines, tiny_model, tmp_path):
    """The compiled graph returns every row's last hidden state with its logits, so a
    feature-level draft stacks on the compiled step too: its features are the eager model's
    (close in fp32), and greedy tokens are the plain engines'."""
    from test_eagle import random_head

    compiled, eager = engines
    head = random_head(tmp_path / "head", str(tiny_model), vocab=64)
    # always k: the governor (test_governor.py) is not this test's subject
    spec = ready(LLM(tiny_model, kv_cache_memory=compiled.engine_config.kv_cache_memory, **COMPILED, **ENGINE,
                     speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 2,
                                         "adaptive": False}))  # fmt: skip
    graphs = spec.engine.graphs
    seen = []
    run = graphs.run

    def counted(chunks, block_tables):
        logits = run(chunks, block_tables)
        seen.append((sum(c.num_tokens for c in chunks), graphs.last_hidden.shape[0]))
        return logits

    graphs.run = counted
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        assert spec.generate(prompt, params)[0].token_ids == eager.generate(prompt, params)[0].token_ids
    assert seen and all(rows == hidden for rows, hidden in seen) and max(r for r, _ in seen) == 3
    assert sum(o.metrics.spec_proposed for o in [spec.generate(PROMPTS[0], params)[0]]) > 0
    # The graph's features against the eager model's, for one decode step.
    from minillm.runtime.runner import ChunkInput, StepInputs

    ids = spec.tokenizer.encode(PROMPTS[1])
    blocks = -(-(len(ids) + 1) // ENGINE["block_size"])
    table = list(range(1, 1 + blocks))
    runner = spec.engine.runner
    runner.execute(StepInputs([ChunkInput("x", ids, 0, 1, table)]))
    step = [ChunkInput("x", [ids[-1]], len(ids), 1, table)]
    runner.execute(StepInputs(step, want_hidden=True))
    assert graphs.last_hidden is not None and runner.last_hidden[0].shape == (1, spec.model.config.hidden_size)
    compiled_hidden = runner.last_hidden[0].clone()
    runner.graphs = None
    runner.execute(StepInputs(step, want_hidden=True))  # the same step, eagerly (its K/V rewritten alike)
    torch.testing.assert_close(compiled_hidden, runner.last_hidden[0], atol=1e-4, rtol=1e-4)


def test_the_package_digest_follows_every_tensor_folded_in(tiny_model):
    """Whatever the graph bakes in changes the digest: weights, an int8 layer's quantized
    matrix (a plain attribute, not a parameter), the rotary tables' length (``max_model_len``)."""
    from minillm.models import load_model
    from minillm.quantization.int8 import Int8Method

    model = load_model(tiny_model, torch.float32)
    digests = [compiled_decode.weights_digest(model)]
    model.init_rope(64)
    digests.append(compiled_decode.weights_digest(model))
    layer = model.linear_layers()[0]
    layer.set_method(Int8Method())
    digests.append(compiled_decode.weights_digest(model))
    layer.qweight[0, 0] += 1
    digests.append(compiled_decode.weights_digest(model))
    assert len(set(digests)) == 4
    assert compiled_decode.weights_digest(model) == digests[-1]  # and it is deterministic


def test_a_failed_compile_leaves_the_engine_decoding_eagerly(tiny_model, tmp_path, monkeypatch):
    """No working C++ compiler, say: the engine answers eagerly from the start, the status says
    the build failed and why (the compiler's own words), the next step warns once, and the
    tokens keep coming — by default and with compile=True alike."""
    from minillm.engine import builder

    monkeypatch.setenv("CXX", "/bin/false")  # inherited by the worker; inductor's compiler command
    monkeypatch.setattr(compiled_decode, "packages_dir", lambda: tmp_path)
    monkeypatch.setenv("MINILLM_COMPILE", "1")
    monkeypatch.setattr(builder, "COMPILE_BY_DEFAULT_MIN_BYTES", 0)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for options in ({}, {"compile": True}):
        llm = LLM(tiny_model, compile_batch_sizes=(1,), **options, **ENGINE)
        assert len(llm.generate(PROMPTS[0], params)[0].token_ids) == 5  # eagerly, while the build runs
        with pytest.warns(UserWarning, match="compiled decode step is not available: compiling the decode step failed"):
            status = llm.wait_for_fast_path(timeout=600)  # or the next step: said once
        assert status.state == "failed" and "compiling the decode step failed" in status.detail, status
        assert "C++ compiler" in status.detail  # the compiler's own words
        assert status.ready == () and "decoding eagerly" in str(status)
        assert len(llm.generate(PROMPTS[0], params)[0].token_ids) == 5
        assert llm.engine.graphs.graphs == {}
        assert all(getattr(layer, "plain_weight", None) is None for layer in llm.model.linear_layers())
    assert list(tmp_path.glob("*.pt2")) == []  # no half-written package left behind


def test_a_corrupt_package_is_compiled_again(engines, tiny_model, packages_folder):
    """A truncated package file (a full disk, a killed copy) is replaced, not a crash at every start."""
    corrupted = list(packages_folder.glob("decode-b4-*.pt2"))  # the engines fixture's
    assert corrupted
    for package in corrupted:
        package.write_bytes(b"not a package")
    with pytest.warns(UserWarning, match="could not be loaded .*compiling it again"):
        llm = ready(LLM(tiny_model, **COMPILED, **ENGINE))
    assert set(llm.engine.graphs.compile_seconds) == {4}
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    _, eager = engines
    assert llm.generate(PROMPTS[2], params)[0].token_ids == eager.generate(PROMPTS[2], params)[0].token_ids


def test_packages_are_pruned_to_the_newest(packages_folder, tmp_path, monkeypatch):
    folder = tmp_path / "compiled"
    folder.mkdir()
    monkeypatch.setattr(compiled_decode, "packages_dir", lambda: folder)
    for age in range(6):
        path = folder / f"decode-b1-{age}.pt2"
        path.write_bytes(b"x")
        os.utime(path, (1000 - age, 1000 - age))
    (folder / "decode-b1-9.123.partial.pt2").write_bytes(b"x")  # another process's compile in progress
    compiled_decode.prune_packages(keep=2)
    assert sorted(p.name for p in folder.iterdir()) == [
        "decode-b1-0.pt2",
        "decode-b1-1.pt2",
        "decode-b1-9.123.partial.pt2",
    ]


@pytest.mark.parametrize(
    "variant,options",
    [
        ("mistral_window", {}),  # a sliding window
        ("qwen2_bias", {}),  # q/k/v biases
        ("same_shapes_other_weights", {}),  # only the folded-in weights differ from the first engine's
        ("llama_gqa", {"kv_cache_dtype": "int8"}),  # an 8-bit pool, dequantized as attention reads it
    ],
)
def test_each_engine_gets_its_own_graph(engines, tiny_models, tiny_model, tmp_path, variant, options):
    """Other engines in the same process each compile their own graph — never reuse the first
    engine's frozen weights; their tokens are their eager twins'."""
    from conftest import build_tiny_model

    folder = (
        build_tiny_model(tmp_path / variant, "llama_gqa", seed=7)
        if variant.startswith("same")
        else tiny_models[variant]
    )
    other = ready(LLM(folder, compile=True, compile_batch_sizes=(1,), **ENGINE, **options))
    assert set(other.engine.graphs.compile_seconds) == {1}
    # Rows attend in place in every batched graph, except over an 8-bit pool the kernel does not read.
    assert other.engine.graphs.free_rows(4) == ("kv_cache_dtype" not in options)
    calls = _counting(other)
    params = SamplingParams(max_tokens=20, ignore_eos=True)  # past mistral_window's 8-token window
    got = other.generate(PROMPTS[1], params)[0].token_ids
    assert got == LLM(folder, **ENGINE, **options).generate(PROMPTS[1], params)[0].token_ids
    assert len(calls) == 19
    first, eager = engines  # and the first engine still runs its own graph
    assert first.generate(PROMPTS[0], params)[0].token_ids == eager.generate(PROMPTS[0], params)[0].token_ids


def test_single_sequence_tokens_identical_over_a_growing_window(engines):
    compiled, eager = engines
    calls = _counting(compiled)
    params = SamplingParams(max_tokens=30, ignore_eos=True)  # 5 -> 35 tokens: the window grows 2 -> 9 blocks
    got = compiled.generate(PROMPTS[0], params)[0].token_ids
    assert got == eager.generate(PROMPTS[0], params)[0].token_ids
    assert len(calls) == 29 and set(calls) == {1}  # every decode step after the prompt's, one graph


@pytest.mark.parametrize("max_tokens", [[3, 40, 9, 17], [35, 35, 35, 35]])
def test_ragged_and_preempted_batches_tokens_identical(engines, max_tokens):
    """Batches of 2-4 rows run through the 1-4-row graph with exactly their rows (no padding:
    each row attends in place over its own keys), a single row padded to 2; 35 tokens each
    overflow the 14-block pool, so sequences are preempted and recomputed."""
    compiled, eager = engines
    calls = _counting(compiled)
    graphs = compiled.engine.graphs.graphs
    batched, rows_seen = graphs[4], []

    def recording(*inputs):
        rows_seen.append(inputs[0].shape[1])  # input_ids [1, rows]
        return batched(*inputs)

    graphs[4] = recording
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    try:
        got = compiled.generate(PROMPTS, params)
    finally:
        graphs[4] = batched
    want = eager.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert 1 in calls and any(n > 1 for n in calls), "single rows and batches must both run"
    assert rows_seen == [max(n, 2) for n in calls]  # unpadded, but for a single row
    if max_tokens[0] == 3:
        assert {2, 3} <= set(calls)  # shrinking batches
    if max_tokens[0] == 35:
        assert sum(o.num_preemptions for o in got) > 0


def test_compiled_logits_match_eager(engines):
    compiled, eager = engines
    logits = {}
    for name, llm in (("compiled", compiled), ("eager", eager)):
        params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5)
        out = llm.generate(PROMPTS[1], params)[0]
        logits[name] = [[lp for _, lp in step.top] for step in out.logprobs]
    for a, b in zip(logits["compiled"], logits["eager"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@pytest.mark.parametrize("window", [None, 6])
def test_static_decode_step_matches_the_bucketed_reference(window):
    """The static layout (every row over the same padded block window, lengths as a mask)
    computes what the reference's length buckets compute, sliding window included."""
    torch.manual_seed(0)
    bs, kv, h, d, blocks = 4, 2, 4, 8, 12
    pool = KVPool([torch.randn(blocks * bs, kv, d)], [torch.randn(blocks * bs, kv, d)], bs, null_block=0)
    tables = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    starts = [9, 2, 17, 5]  # each row's new token goes at this position
    width = 7  # wider than the longest row needs: padding must be masked
    slots = [addressing.slot_mapping(t, s, 1, bs)[0] for t, s in zip(tables, starts)]

    def layout(static: bool, order: list[int]) -> StepLayout:
        rows = [tables[i] for i in order]
        return StepLayout(
            input_ids=torch.zeros(1, 4, dtype=torch.long),
            positions=torch.tensor([[starts[i] for i in order]]),
            slot_mapping=torch.tensor([slots[i] for i in order]),
            query_lens=[1] * 4,
            context_lens=[starts[i] + 1 for i in order],
            block_tables=torch.tensor(addressing.padded_block_tables(rows, width if static else 5, 0)),
            num_decodes=4,
            logit_index=torch.arange(4),
            pool=pool,
            window=window,
            context_lens_tensor=torch.tensor([starts[i] + 1 for i in order]),
            static_decode=static,
        )

    q, k, v = torch.randn(1, 4, h, d), torch.randn(1, 4, kv, d), torch.randn(1, 4, kv, d)
    order = sorted(range(4), key=lambda i: starts[i])  # the runner sorts decodes by length
    ref = ReferencePagedStep(layout(False, order), get_backend("torch").padded).attend(
        0, q[:, order], k[:, order], v[:, order], d**-0.5
    )
    static = StaticDecodeStep(layout(True, list(range(4))), torch.float32).attend(0, q, k, v, d**-0.5)
    torch.testing.assert_close(static[:, order], ref, atol=1e-5, rtol=1e-5)
    in_place = layout(True, list(range(4)))
    in_place.in_place_decode = True
    kernel = get_backend("cpu").paged_step(in_place)
    assert isinstance(kernel, StaticKernelDecodeStep)
    torch.testing.assert_close(kernel.attend(0, q, k, v, d**-0.5)[:, order], ref, atol=1e-5, rtol=1e-5)


def test_default_graphs_one_for_every_batch_but_over_an_8_bit_pool(tiny_model):
    """By default one graph takes every batch of 1-256 rows, attending in place; the kernel does
    not read an 8-bit pool, so there the graphs attend over the window, for 1 row and 8 (padded).
    A bf16 pool on a CPU without AMX also gets a 1-row graph (it decodes one row faster there)."""
    from minillm.kvcache.paged import PagedKVCache
    from minillm.models.loader import load_model

    model, config = load_model(tiny_model, torch.float32), ModelConfig.from_folder(tiny_model)
    for kv_cache_dtype, sizes, free in (("auto", (256,), True), ("int8", (1, 8), False), ("fp8", (1, 8), False)):
        cache = PagedKVCache(config, 4, 4, torch.float32, torch.device("cpu"), kv_cache_dtype)
        compiled = CompiledDecode(model, cache, None, torch.float32)
        assert compiled.batch_sizes == sizes and compiled.free_rows(sizes[-1]) == free, kv_cache_dtype
        assert compiled.describe(sizes[-1]) == ("1-256-row" if free else "8-row")
        assert compiled.free_rows(1) is False and compiled.free_rows(2) is False  # bounds of 1, 2: exact rows
    assert EngineConfig().compile_batch_sizes is None  # "the default for this pool"
    bf16 = PagedKVCache(config, 4, 4, torch.bfloat16, torch.device("cpu"))
    for amx, sizes in ((True, (256,)), (False, (1, 256))):
        with mock.patch.object(compiled_decode, "cpu_has_amx", return_value=amx):
            assert compiled_decode.default_batch_sizes(bf16) == sizes, amx
    with mock.patch.object(compiled_decode, "cpu_has_amx", return_value=False):  # measured in bf16 only
        fp32 = PagedKVCache(config, 4, 4, torch.float32, torch.device("cpu"))
        assert compiled_decode.default_batch_sizes(fp32) == (256,)
        int8 = PagedKVCache(config, 4, 4, torch.bfloat16, torch.device("cpu"), "int8")
        assert compiled_decode.default_batch_sizes(int8) == (1, 8)


@pytest.mark.parametrize("call", ["operator", "python"])
def test_the_kernel_operator_passes_pytorchs_operator_checks(call):
    """``minillm::paged_decode``, the kernel as the operator a compiled graph calls: its fake
    (what the tracer sees) must agree with the kernel on shape, dtype and strides — for a
    non-contiguous ``q`` too, the model's view (a fake that copied its strides made compiled
    batches decode wrong tokens) — and it must be traceable (``torch.library.opcheck``). The
    same for its C++ kernel (what the dispatcher runs once the library built with it is loaded,
    ``operator_in_cpp``) and its Python function (the fallback), which agree bit for bit."""
    from minillm import native_build
    from minillm.attention import cpu_paged

    if cpu_paged.kernel_unavailable_reason() is not None:
        pytest.skip(f"the kernel did not build here: {cpu_paged.kernel_unavailable_reason()}")
    assert native_build.build_operators() is None, native_build.operators_failure()
    assert cpu_paged.operator_in_cpp()
    registered = torch._C._dispatch_dump("minillm::paged_decode")
    assert ".cpp" in registered.split("CPU: registered at")[1].splitlines()[0]
    op = torch.ops.minillm.paged_decode if call == "operator" else cpu_paged.paged_decode_op
    torch.manual_seed(0)
    bs, kv, h, d = 4, 2, 4, 16
    pool_k, pool_v = torch.randn(10 * bs, kv, d, dtype=torch.bfloat16), torch.randn(10 * bs, kv, d, dtype=torch.bfloat16)
    q = torch.randn(3, d, h, dtype=torch.bfloat16).transpose(1, 2)  # [3, h, d], not contiguous
    tables = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]])
    lens = torch.tensor([6, 2, 11])
    seen = torch.tensor([-1, -1, 0b1011])  # the third row: a tree node seeing itself, its parent 1 back, and 3 back
    for window, visible in ((0, seen), (3, torch.full((3,), -1))):
        args = (q, pool_k, pool_v, tables, lens, visible, bs, d**-0.5, window)
        torch.library.opcheck(torch.ops.minillm.paged_decode.default, args)
        out = op(*args)
        assert out.is_contiguous() and out.dtype == q.dtype and out.shape == q.shape
        assert torch.equal(out, torch.ops.minillm.paged_decode(*args) if call == "python" else cpu_paged.paged_decode_op(*args))
    # It reads raw pointers, so what would make it read out of bounds is refused by name.
    bad = {
        "int32 tables": (q, pool_k, pool_v, tables.int(), lens, seen, bs, 1.0, 0),
        "a table per row missing": (q, pool_k, pool_v, tables[:2], lens, seen, bs, 1.0, 0),
        "pools of two dtypes": (q, pool_k, pool_v.float(), tables, lens, seen, bs, 1.0, 0),
        "a non-contiguous pool": (q, pool_k.transpose(0, 1), pool_v.transpose(0, 1), tables, lens, seen, bs, 1.0, 0),
        "another head size": (q[..., :8], pool_k, pool_v, tables, lens, seen, bs, 1.0, 0),
        "a mask per row missing": (q, pool_k, pool_v, tables, lens, seen[:2], bs, 1.0, 0),
        "int32 masks": (q, pool_k, pool_v, tables, lens, seen.int(), bs, 1.0, 0),
    }
    for case, args in bad.items():
        with pytest.raises(ValueError, match="minillm::paged_decode"):
            op(*args)
            pytest.fail(f"{case}: accepted")


def test_compile_refusals(tiny_model):
    cases = [
        (dict(mode="naive", compile=True), "compile=True needs mode='paged' or 'contiguous'"),
        (dict(compile=True, cuda_graphs=True), "compile=True and cuda_graphs=True"),
        (dict(compile="yes"), "compile='yes' must be True or False"),
        (dict(compile_batch_sizes=()), "compile_batch_sizes=() must be a non-empty tuple"),
        (dict(compile_batch_sizes=(1, 0)), "compile_batch_sizes=(1, 0) must be"),
        (dict(compile_batch_sizes=(1, "8")), "compile_batch_sizes=(1, '8') must be"),
        (dict(compile_batch_sizes=8), "compile_batch_sizes=8 must be"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
            EngineConfig(**kwargs)
    with pytest.raises(ValueError, match="compile=True compiles the paged engine's decode step for the CPU"):
        LLMEngine(tiny_model, compile=True, attention_backend="triton", dtype="fp32")


# ---- decode attention dtype, chosen per machine ------------------------------------------


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    return tmp_path


def test_attention_dtype_is_measured_once_per_machine_and_remembered(fresh_cache, monkeypatch):
    calls = []

    def fake(dtype, *shape):
        calls.append(shape)
        return {"bfloat16": 2.0, "float32": 0.5}  # fp32 4x faster: chosen

    monkeypatch.setattr(attention_precision, "measure_decode_attention", fake)
    cpu = torch.device("cpu")
    assert attention_precision.decode_attention_dtype(torch.bfloat16, cpu, 9, 3, 64) == torch.float32
    assert attention_precision.decode_attention_dtype(torch.bfloat16, cpu, 9, 3, 64) == torch.float32
    assert calls == [(9, 3, 64)]  # the second engine reads the remembered choice
    assert (fresh_cache / "machine" / "attention_dtype.json").is_file()


def test_attention_dtype_keeps_the_model_dtype_on_a_near_tie(fresh_cache, monkeypatch):
    monkeypatch.setattr(attention_precision, "measure_decode_attention", lambda *a: {"bfloat16": 1.0, "float32": 0.9})
    assert attention_precision.decode_attention_dtype(torch.bfloat16, torch.device("cpu"), 4, 2, 16) == torch.bfloat16


def test_attention_dtype_has_nothing_to_choose_for_fp32_or_a_gpu(fresh_cache, monkeypatch):
    monkeypatch.setattr(attention_precision, "measure_decode_attention", lambda *a: pytest.fail("measured"))
    assert attention_precision.decode_attention_dtype(torch.float32, torch.device("cpu"), 4, 2, 16) == torch.float32
    assert attention_precision.decode_attention_dtype(torch.bfloat16, torch.device("cuda"), 4, 2, 16) == torch.bfloat16


def test_measured_timings_are_real(fresh_cache):
    timings = attention_precision.measure_decode_attention(torch.bfloat16, 4, 2, 16, batch=2, context=64)
    assert set(timings) == {"bfloat16", "float32"} and all(t > 0 for t in timings.values())


def test_bf16_engine_decodes_in_the_chosen_dtype(fresh_cache, monkeypatch, tiny_model):
    """The engine passes the choice to its attention backend, and a bf16 engine computing
    decode attention in fp32 still produces tokens (its own reference: the same engine)."""
    monkeypatch.setattr(
        attention_precision, "measure_decode_attention", lambda *a, **k: {"bfloat16": 5.0, "float32": 1.0}
    )
    llm = LLM(tiny_model, dtype="bf16")
    assert llm.engine.model.attention_backend.decode_dtype == torch.float32
    monkeypatch.setattr(
        attention_precision, "measure_decode_attention", lambda *a, **k: {"bfloat16": 1.0, "float32": 1.0}
    )
    (fresh_cache / "machine" / "attention_dtype.json").unlink()
    same = LLM(tiny_model, dtype="bf16")
    assert same.engine.model.attention_backend.decode_dtype is None
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert len(llm.generate(PROMPTS[0], params)[0].token_ids) == 8


# ---- the llama.cpp anchor of the generate benchmark (no llama.cpp needed: a stand-in binary) --


def _gguf(path, file_type: int):
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_file_type(file_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_llama_cpp_anchor_reads_llama_benchs_own_figures(tmp_path):
    from minillm.tools.llamacpp import LlamaCpp

    binary = tmp_path / "llama-bench"  # prints what llama-bench -o json prints, and its arguments
    binary.write_text(
        '#!/bin/sh\necho "$@" > "$(dirname "$0")/args"\n'
        'echo \'[{"avg_ts": 99.5, "build_commit": "abc123", "n_prompt": 0, "n_gen": 64}]\'\n'
    )
    binary.chmod(0o755)
    anchor = LlamaCpp(str(binary), str(_gguf(tmp_path / "m.gguf", 32)), threads=2)
    assert anchor.dtype == torch.bfloat16 and not anchor.supports_batch(8)  # no llama-batched-bench beside it
    assert anchor.measure(1, 64, 64) == {"decode_tok_s": 99.5}
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("-n") + 1] == "64" and args[args.index("-d") + 1] == "64"  # decodes after a 64-token context
    assert args[args.index("-t") + 1] == "2"
    assert anchor.measure("prefill", 512, 64) == {"prefill_tok_s": 99.5}
    assert anchor.describe()["build"] == "abc123"


def test_llama_cpp_anchor_refuses_bad_input(tmp_path):
    from minillm.tools.bench import run_generate_benchmark
    from minillm.tools.llamacpp import LlamaCpp

    binary = tmp_path / "llama-bench"
    binary.write_text("")  # exists, but cannot run
    bf16 = _gguf(tmp_path / "bf16.gguf", 32)
    (tmp_path / "junk.gguf").write_text("not a gguf")
    cases = [
        ((None, str(bf16)), "--gguf needs --llama-bench"),
        ((str(binary), None), "--llama-bench needs --gguf"),
        ((str(tmp_path / "nope"), str(bf16)), "--llama-bench .*nope: no such file"),
        ((str(binary), str(tmp_path / "junk.gguf")), "--gguf .*junk.gguf: not a readable GGUF file"),
        ((str(binary), str(_gguf(tmp_path / "q4.gguf", 3))), "is quantized"),
    ]
    for (bench, model), message in cases:
        with pytest.raises(ValueError, match=message):
            LlamaCpp(bench, model, threads=2)
    with pytest.raises(RuntimeError, match="llama-bench"):  # not executable: named, not a bare OSError
        LlamaCpp(str(binary), str(bf16), threads=2).measure(1, 64, 64)
    with pytest.raises(ValueError, match="holds bfloat16 weights, but --dtypes fp32"):
        run_generate_benchmark(dtypes=("fp32",), llama_bench=str(binary), gguf=str(bf16))
    with pytest.raises(ValueError, match="prefill_len=0"):
        run_generate_benchmark(prefill_len=0)


def test_generate_benchmark_reports_mbu_and_engine_starts():
    """The benchmark end to end on the tiny model (eager only: fast) — decode, prefill, MBU
    against the measured bandwidth — and the start-up table a compiled run adds."""
    from minillm.tools.bench import format_table, measure_read_bandwidth, run_generate_benchmark

    assert measure_read_bandwidth(megabytes=64, repeats=2) > 0.1
    result = run_generate_benchmark(
        "tiny-shakespeare-1m", dtypes=("fp32",), batch_sizes=(1, 2), prompt_len=8, new_tokens=4, repeats=1,
        include_hf=False, compile=False, prefill_len=16,
    )  # fmt: skip
    (one, two), (prefill,) = result["rows"], result["prefill"]
    expected = one["minillm"]["decode_tok_s"] * one["decode_bytes_per_step"] / (result["read_bandwidth_gb_s"] * 1e9)
    assert one["minillm"]["mbu"] == pytest.approx(expected) and "mbu" not in two["minillm"]
    assert prefill["minillm"]["prefill_tok_s"] > 0 and result["engine_start"][0]["minillm_s"] > 0
    result["engine_start"] = [
        {"dtype": "bf16", "minillm_s": 3.5, "compiled_first_s": 170.0, "compile_s": {1: 87.0, 8: 80.0},
         "compiled_warm_s": 7.4, "load_s": {1: 1.8, 8: 1.8}}
    ]  # fmt: skip
    table = format_table(result)
    assert "| bf16 | 3.5 s | 170.0 s (batch 1: 87 s, batch 8: 80 s) | 7.4 s (graphs loaded in 3.6 s) |" in table


def test_no_package_is_compiled_while_a_traced_hook_is_overridden(tiny_model, monkeypatch):
    """A learner's gather_kv must not be baked into a package every later engine would load."""
    from minillm import hooks
    from minillm.engine import builder

    reference = hooks.default("gather_kv")

    def learner(*args, **kwargs):
        return reference(*args, **kwargs)

    with hooks.override(gather_kv=learner):
        with pytest.raises(RuntimeError, match=r"hook override\(s\) \['gather_kv'\] active"):
            LLM(tiny_model, compile=True, **ENGINE)
        monkeypatch.setenv("MINILLM_COMPILE", "1")
        monkeypatch.setattr(builder, "COMPILE_BY_DEFAULT_MIN_BYTES", 0)
        with pytest.warns(UserWarning, match="hook override"):
            llm = LLM(tiny_model, **ENGINE)  # the default runs eagerly, through the learner's function
    assert llm.engine.graphs is None and not llm.resolved.compile


def test_the_compiled_step_verifies_a_tree(engines, tiny_model, tmp_path, monkeypatch):
    """A speculative tree runs on the compiled graph as rows: each node at its own address with
    its depth's position, seeing its ancestors only (the kernel's ancestor bits, an input of the
    graph). With every tree hiding the true continuation behind a wrong first guess, the graph's
    greedy tokens are the eager engine's and two proposals are accepted per step (a tree of 3
    nodes: 4 rows, this graph's bound)."""
    from test_eagle import random_head
    from test_tree_serving import lure_tree

    from minillm.speculative.eagle import EagleProposer

    compiled, eager = engines
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    truth = {tuple(eager.tokenizer.encode(p)): eager.generate(p, SamplingParams(max_tokens=36, ignore_eos=True))[0].token_ids
             for p in PROMPTS[:2]}  # fmt: skip
    grow = EagleProposer._grow_tree

    def grow_lure(self, seq, state, k, topk, depth):
        tokens, parents = grow(self, seq, state, k, topk, depth)
        future = truth[tuple(seq.prompt_token_ids)][len(seq.output_token_ids) :]
        return lure_tree(future, k) if len(future) >= 3 else (tokens, parents)

    monkeypatch.setattr(EagleProposer, "_grow_tree", grow_lure)
    head = random_head(tmp_path / "head", str(tiny_model), vocab=64)
    spec = ready(LLM(tiny_model, kv_cache_memory=compiled.engine_config.kv_cache_memory, **COMPILED, **ENGINE,
                     speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 3,
                                         "topk": 3, "depth": 3, "adaptive": False}))  # fmt: skip
    assert spec.engine.graphs.compile_seconds == {}  # the same package serves the speculating engine
    graphs, trees = spec.engine.graphs, []
    run = graphs.run

    def counted(chunks, block_tables):
        trees.extend(len(c.tree_parents) for c in chunks if c.tree_parents)
        return run(chunks, block_tables)

    graphs.run = counted
    for prompt in PROMPTS[:2]:
        out = spec.generate(prompt, params)[0]
        assert out.token_ids == eager.generate(prompt, params)[0].token_ids
        assert out.metrics.spec_accepted >= 2 * (out.metrics.num_verify_steps - 2)
    assert trees and max(trees) == 3  # whole trees ran on the graph
    assert spec.engine.block_manager.num_used_blocks == 0
