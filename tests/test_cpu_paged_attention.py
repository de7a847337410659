"""The ``cpu`` attention backend: decode rows attended by our C++ paged kernel.

The kernel must compute what the PyTorch reference computes — plain attention over each row's
own keys, read through shuffled block tables, for every head layout, head size (including
sizes that are not a multiple of the SIMD width), pool dtype and sliding window — and each row
alone, whatever else is in the batch. The engine on it must produce the ``sdpa`` engine's greedy
tokens alone, in ragged batches and after preemption; ``auto`` must pick it only where it
applies, and bad arguments must fail by name.
"""

from __future__ import annotations

import platform
import threading
import time

import pytest
import torch

from minillm import LLM, SamplingParams, native_build
from minillm.attention import cpu_paged
from minillm.attention.cpu_paged import paged_decode_attention
from minillm.attention.torch_ref import attention
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import builder
from minillm.kvcache.addressing import kv_bytes_per_token, padded_block_tables

pytestmark = pytest.mark.skipif(
    cpu_paged.kernel_unavailable_reason() is not None, reason="the C++ kernel does not build here"
)


def scattered_pool(gen, lens, kv_heads, head_dim, block_size, dtype, num_blocks=64):
    """A pool with each sequence's K/V in shuffled blocks; returns pools, tables and per-row K/V."""
    k_pool = torch.zeros(num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # block 0: the null block
    tables, keys, values = [], [], []
    for n in lens:
        table = [free.pop() for _ in range(-(-n // block_size))]
        k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(n)])
        k_pool[slots], v_pool[slots] = k, v
        tables.append(table)
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    return k_pool, v_pool, torch.tensor(padded_block_tables(tables, width, 0)), keys, values


def reference(q, keys, values, scale, window=None):
    """Each row's attention over its own keys (its last ``window``), in fp32, one row at a time."""
    rows = []
    for b, (k, v) in enumerate(zip(keys, values)):
        if window is not None:
            k, v = k[-window:], v[-window:]
        out = attention(q[b : b + 1, :, None].float(), k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
                        None, scale)  # fmt: skip
        rows.append(out[0, :, 0])
    return torch.stack(rows)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (4, 1), (9, 3)])
@pytest.mark.parametrize("head_dim", [8, 40, 64])
def test_kernel_matches_reference_attention(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    lens = [1, 5, 16, 17, 3, 40]  # one key; inside one block; exactly one block; ragged
    k_pool, v_pool, tables, keys, values = scattered_pool(gen, lens, kv_heads, head_dim, 4, torch.float32)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens), 4, scale)
    torch.testing.assert_close(out, reference(q, keys, values, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_pools_are_read_as_stored(dtype):
    """A bf16/fp16 pool is upcast as it is read: the result is fp32 attention over the stored values."""
    gen = torch.Generator().manual_seed(1)
    lens = [7, 33, 2]
    k_pool, v_pool, tables, keys, values = scattered_pool(gen, lens, 3, 64, 16, dtype)
    q = torch.randn(3, 9, 64, generator=gen)
    out = paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens), 16, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference(q, keys, values, 0.125), atol=1e-5, rtol=1e-5)
    half = paged_decode_attention(q.to(dtype), k_pool, v_pool, tables, torch.tensor(lens), 16, 0.125)
    assert half.dtype == dtype  # the output comes back in the query's dtype


@pytest.mark.parametrize("window", [1, 6, 100])
def test_sliding_window_sees_only_the_last_keys(window):
    gen = torch.Generator().manual_seed(2)
    lens = [3, 20, 9]
    k_pool, v_pool, tables, keys, values = scattered_pool(gen, lens, 2, 8, 4, torch.float32)
    q = torch.randn(3, 4, 8, generator=gen)
    out = paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens), 4, 0.3, window)
    torch.testing.assert_close(out, reference(q, keys, values, 0.3, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [5, 40, 90])  # masks within the last 63 keys, and longer rows
def test_a_tree_nodes_row_sees_only_what_its_mask_lets_it(length):
    """``visible``: bit ``j`` lets a row see the key ``j`` places before its own (a speculative
    tree's node: its ancestors, never a sibling branch); keys 63 or more places back are always
    seen. The result is attention over exactly the keys the mask keeps, whatever the others hold."""
    gen = torch.Generator().manual_seed(length)
    lens = [length] * 4
    k_pool, v_pool, tables, keys, values = scattered_pool(gen, lens, 3, 64, 4, torch.float32, num_blocks=128)
    q = torch.randn(4, 9, 64, generator=gen)
    masks = [-1, 0b1, 0b1101, (1 << 62) | 0b101]
    kept = []
    for m in masks:
        back = torch.arange(length - 1, -1, -1)  # how far each key lies behind the row's own
        kept.append((m == -1) | (back >= 63) | ((m >> back.clamp(max=62)) & 1).bool())
    out = paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens), 4, 0.125, visible=torch.tensor(masks))
    want = reference(q, [k[s] for k, s in zip(keys, kept)], [v[s] for v, s in zip(values, kept)], 0.125)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="visible must be a CPU int64 tensor of shape \\(4,\\)"):
        paged_decode_attention(q, k_pool, v_pool, tables, torch.tensor(lens), 4, 0.125, visible=torch.tensor(masks[:3]))


def test_a_row_does_not_depend_on_its_batch_or_the_thread_count():
    """Each (sequence, KV head) is one task with a fixed summation order: a row's result is the
    same bits alone, in a batch, and on one thread or two."""
    gen = torch.Generator().manual_seed(3)
    lens = [50, 3, 120, 64]
    k_pool, v_pool, tables, _, _ = scattered_pool(gen, lens, 2, 32, 8, torch.bfloat16)
    q = torch.randn(4, 4, 32, generator=gen)
    lens_t = torch.tensor(lens)
    batch = paged_decode_attention(q, k_pool, v_pool, tables, lens_t, 8, 0.2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = paged_decode_attention(q, k_pool, v_pool, tables, lens_t, 8, 0.2)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, single)
    for b in range(4):
        alone = paged_decode_attention(q[b : b + 1], k_pool, v_pool, tables[b : b + 1], lens_t[b : b + 1], 8, 0.2)
        assert torch.equal(alone[0], batch[b])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k_pool=torch.zeros(32, 2, 8, dtype=torch.int8)), "k_pool is torch.int8"),
        (dict(v_pool=torch.zeros(32, 2, 8, dtype=torch.bfloat16)), "shapes do not match"),  # K and V differ
        (dict(v_pool=torch.zeros(40, 2, 8)), "shapes do not match"),
        (dict(q=torch.zeros(2, 3, 8)), "shapes do not match"),  # 3 heads over 2 KV heads
        (dict(q=torch.zeros(2, 4, 16)), "shapes do not match"),  # head size differs from the pool's
        (dict(context_lens=torch.tensor([1, 2, 3])), "shapes do not match"),
        (dict(k_pool=torch.zeros(32, 4, 8)[:, ::2]), "k_pool must be contiguous"),
        (dict(context_lens=torch.tensor([1, 33])), "33 tokens needs 5 blocks of 8; block_tables has 4"),
        (dict(context_lens=torch.tensor([0, 2])), "context_lens must be >= 1"),
        (dict(block_tables=torch.tensor([[0, 1, 2, 3], [0, -1, 0, 0]])), r"block ids must be in \[0, 4\)"),
        (dict(block_tables=torch.tensor([[0, 1, 2, 3], [4, 0, 0, 0]])), r"block ids must be in \[0, 4\)"),
        (dict(q=torch.zeros(2, 4, 8, device="meta")), "reads CPU tensors; q is on meta"),
    ],
)
def test_bad_arguments_are_named(change, message):
    """The kernel reads memory through raw pointers: whatever would make it read outside the
    pool is refused by name first."""
    args = dict(
        q=torch.zeros(2, 4, 8),
        k_pool=torch.zeros(32, 2, 8),
        v_pool=torch.zeros(32, 2, 8),
        block_tables=torch.zeros(2, 4, dtype=torch.long),
        context_lens=torch.tensor([1, 2]),
    )
    args |= change
    if args["k_pool"].dtype == torch.int8:
        args["v_pool"] = args["k_pool"]
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args, block_size=8, scale=1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_short_last_chunk_reads_nothing_past_the_row(dtype):
    """A head size that is not a multiple of the SIMD width (20: 16 + 4 with AVX-512, 8 + 8 + 4
    with AVX2) loads its last few values alone. The pool here is the front of a buffer whose
    rest is NaN, and the sequence's last key is the pool's last row: a load past that row would
    bring NaN into the result."""
    gen = torch.Generator().manual_seed(4)
    slots, kv_heads, dim, bs = 16, 2, 20, 4
    pools = []
    for _ in range(2):
        buffer = torch.full((slots * kv_heads * dim + 64,), float("nan"), dtype=dtype)
        pool = buffer[: slots * kv_heads * dim].view(slots, kv_heads, dim)
        pool.copy_(torch.randn(slots, kv_heads, dim, generator=gen).to(dtype))
        pools.append(pool)
    table, lens = [1, 3], torch.tensor([8])  # positions 4-7 in block 3: slots 12-15, the last the pool's last row
    q = torch.randn(1, 4, dim, generator=gen)
    out = paged_decode_attention(q, pools[0], pools[1], torch.tensor([table]), lens, bs, 0.2)
    slot_ids = torch.tensor([1 * bs + i for i in range(bs)] + [3 * bs + i for i in range(bs)])
    want = reference(q, [pools[0][slot_ids]], [pools[1][slot_ids]], 0.2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


PROMPTS = ["To be, or not to be", "Caches keep keys and values; attention reads them back.", "café", "the slings"]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("variant", ["llama_gqa", "llama_mha", "llama_mqa", "llama_head_dim", "mistral_window"])
def test_engine_tokens_match_the_sdpa_engine(tiny_models, variant):
    """Ragged batches (four prompts of different lengths, chunked prefill mixing prompt chunks and
    decodes) on every head layout, an odd head size and a sliding window."""
    args = dict(dtype="fp32", block_size=4, max_num_batched_tokens=16)
    kernel = LLM(tiny_models[variant], attention_backend="cpu", **args)
    plain = LLM(tiny_models[variant], attention_backend="sdpa", **args)
    got = [o.token_ids for o in kernel.generate(PROMPTS, PARAMS)]
    assert got == [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    assert got == [kernel.generate(p, PARAMS)[0].token_ids for p in PROMPTS]  # alone, the same


def test_engine_tokens_match_after_preemption(tiny_model):
    per_token = kv_bytes_per_token(ModelConfig.from_folder(tiny_model), torch.float32)
    args = dict(dtype="fp32", block_size=4, max_num_seqs=4, kv_cache_memory=14 * 4 * per_token)
    kernel = LLM(tiny_model, attention_backend="cpu", **args)
    plain = LLM(tiny_model, attention_backend="sdpa", **args)
    params = SamplingParams(max_tokens=35, ignore_eos=True)  # 4 x ~40 tokens > 14 blocks of 4
    got = kernel.generate(PROMPTS, params)
    assert sum(o.num_preemptions for o in got) > 0  # the pool is too small for all four
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS, params)]


def test_bf16_engine_logprobs_close_to_the_sdpa_engine(tiny_model):
    args = dict(dtype="bf16", block_size=4)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    kernel = LLM(tiny_model, attention_backend="cpu", **args).generate(PROMPTS[1], params)[0]
    plain = LLM(tiny_model, attention_backend="sdpa", **args).generate(PROMPTS[1], params)[0]
    assert kernel.token_ids[0] == plain.token_ids[0]
    for a, b in zip(kernel.logprobs, plain.logprobs):
        if a.token_id != b.token_id:  # bf16 may round a near-tie the other way; compare up to there
            break
        assert abs(a.logprob - b.logprob) < 0.05  # bf16 weights; attention in fp32 on both paths


def test_auto_picks_the_kernel_for_the_paged_cpu_engine_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert builder.resolve_backend(EngineConfig(), cpu) == "cpu"
    assert builder.resolve_backend(EngineConfig(mode="contiguous"), cpu) == "sdpa"
    assert builder.resolve_backend(EngineConfig(kv_cache_dtype="int8"), cpu) == "sdpa"  # an 8-bit pool
    assert builder.resolve_backend(EngineConfig(), cuda) in ("triton", "sdpa")
    with pytest.raises(ValueError, match="runs on the CPU"):
        builder.resolve_backend(EngineConfig(attention_backend="cpu"), cuda)


def test_a_build_failure_is_reported_with_the_compilers_words(monkeypatch):
    def broken():
        raise RuntimeError(
            "C++ compile error\n\nCommand:\ng++ kernel.cpp -O3\n\nOutput:\nkernel.cpp:3: error: no omp.h"
        )

    monkeypatch.setattr(cpu_paged, "_library", broken)
    cpu_paged._unavailable_reason.cache_clear()
    try:
        reason = cpu_paged.kernel_unavailable_reason()
    finally:
        cpu_paged._unavailable_reason.cache_clear()
    assert reason.startswith("RuntimeError: C++ compile error") and "no omp.h" in reason


def test_a_build_started_early_is_the_one_the_engine_waits_for(monkeypatch):
    """``start_building`` runs the build in a thread; ``kernel_unavailable_reason`` waits for that
    build rather than starting a second one, and later calls reuse its answer."""
    calls = []
    release = threading.Event()

    def slow_build():
        calls.append(threading.current_thread().name)
        release.wait(10)

    monkeypatch.setattr(cpu_paged, "_library", slow_build)
    cpu_paged._unavailable_reason.cache_clear()
    try:
        cpu_paged.start_building()
        deadline = time.monotonic() + 5
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        threading.Timer(0.2, release.set).start()
        assert cpu_paged.kernel_unavailable_reason() is None
        cpu_paged.start_building()  # already answered: no new build
        assert cpu_paged.kernel_unavailable_reason() is None
        assert calls == ["minillm-cpu-kernel-build"]
    finally:
        release.set()
        cpu_paged._unavailable_reason.cache_clear()


class _Loads:
    """A stand-in for ``CppCodeCache``: records which instruction set each load was given."""

    def __init__(self, fail_first: str | None = None):
        from torch._inductor import codecache

        self.codecache, self.fail_first, self.isas = codecache, fail_first, []

    def load(self, source):
        isa = self.codecache.pick_vec_isa()
        self.isas.append(isa)
        if self.fail_first and len(self.isas) == 1:
            flag = isa.build_arch_flags().split()[0]
            raise RuntimeError(self.fail_first.format(flag=flag))
        return "library"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the instruction set is named on x86 only")
def test_the_kernel_takes_its_instruction_set_from_the_cpu_without_probe_builds(monkeypatch):
    """Inductor's ``pick_vec_isa`` compiles a probe per instruction set (19 s of a cold first
    start); the kernel's build names AVX-512 or AVX2 from PyTorch's CPU detection instead, and
    leaves inductor's own pick in place for everything else."""
    from torch._inductor import codecache, cpu_vec_isa

    expected = "avx512" if torch.cpu._is_avx512_supported() else "avx2" if torch.cpu._is_avx2_supported() else None
    if expected is None:
        pytest.skip("neither AVX2 nor AVX-512 here: inductor's own pick applies")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda *a: pytest.fail("a probe build ran"))
    other_thread = []

    class LoadsWhileAnotherThreadAsks(_Loads):
        def load(self, source):
            asker = threading.Thread(target=lambda: other_thread.append(codecache.pick_vec_isa()))
            asker.start()
            asker.join()
            return super().load(source)

    monkeypatch.setattr(codecache, "pick_vec_isa", lambda: "probed")  # what inductor's own pick answers
    probing = codecache.pick_vec_isa
    loads = LoadsWhileAnotherThreadAsks()
    assert native_build._build(loads, "source") == "library"
    assert [str(isa) for isa in loads.isas] == [expected]
    assert other_thread == ["probed"]  # another thread's compile still gets inductor's pick
    assert codecache.pick_vec_isa is probing


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the instruction set is named on x86 only")
def test_a_build_that_fails_with_the_named_set_is_retried_the_probing_way(monkeypatch):
    from torch._inductor import codecache

    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    if not torch.cpu._is_avx2_supported():
        pytest.skip("no AVX2: nothing is named")
    probed = object()
    monkeypatch.setattr(codecache, "pick_vec_isa", lambda: probed)
    loads = _Loads(fail_first="g++: error: unrecognized command-line option '{flag}'")
    assert native_build._build(loads, "source") == "library"
    assert len(loads.isas) == 2 and loads.isas[0] is not probed and loads.isas[1] is probed


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the instruction set is named on x86 only")
def test_any_other_build_failure_is_raised_not_rebuilt(monkeypatch):
    """Only a compiler that rejects the named flags earns a second (probing) build: a missing
    header fails once, with its own words."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    if not torch.cpu._is_avx2_supported():
        pytest.skip("no AVX2: nothing is named")
    loads = _Loads(fail_first="kernel.cpp:3: fatal error: omp.h: No such file or directory")
    with pytest.raises(RuntimeError, match="omp.h"):
        native_build._build(loads, "source")
    assert len(loads.isas) == 1


def test_a_kernel_that_does_not_build_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr(builder, "kernel_unavailable_reason", lambda: "CalledProcessError: no C++ compiler")
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert builder.resolve_backend(EngineConfig(), torch.device("cpu")) == "sdpa"
    with pytest.raises(RuntimeError, match="did not build here .*no C\\+\\+ compiler"):
        builder.resolve_backend(EngineConfig(attention_backend="cpu"), torch.device("cpu"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(mode="contiguous"), "needs mode='paged'"),
        (dict(kv_cache_dtype="int8"), "not kv_cache_dtype='int8'"),
        (dict(device="cuda"), "runs on the CPU, not on device='cuda'"),
    ],
)
def test_config_refuses_the_kernel_where_it_does_not_apply(args, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(attention_backend="cpu", **args)


def test_the_kernel_build_thread_leaves_setuptools_to_the_engines_thread():
    """``start_building`` imports setuptools (through ``torch.utils.cpp_extension``) before its
    thread starts: setuptools puts a ``backports`` package on ``sys.path`` as it imports, and the
    engine's thread meanwhile imports urllib3 (``from backports import zstd``) for the tokenizer.
    The two on two threads failed a worker's start once with ``KeyError: 'backports'``. In a fresh
    process, where nothing has imported setuptools yet."""
    import subprocess
    import sys

    code = (
        "import sys; import minillm.attention.cpu_paged as cp; "
        "assert 'setuptools' not in sys.modules, 'imported before the test'; "
        "cp._unavailable_reason.cache_clear(); cp.start_building(); "
        "print('setuptools' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
