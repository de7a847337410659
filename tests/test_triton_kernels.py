"""Triton kernels against the PyTorch reference.

Without CUDA they run under Triton's interpreter (``minillm/triton_setup.py`` sets ``TRITON_INTERPRET=1``), so
shapes stay small; with CUDA the same tests run on the GPU, plus larger shapes. Tolerances:
fp32 1e-5 on the interpreter (exact fp32 arithmetic), 2e-3 on a GPU (tf32-free "ieee" dots,
but a different summation order); bf16/fp16 inputs are compared after the reference's own
rounding of the output (2e-2).
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention import triton_available
from minillm.attention.decode_tuning import DecodeConfig
from minillm.attention.torch_ref import attention, causal_mask

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from minillm.attention.triton_kernels import (  # noqa: E402
    FlashConfig,
    flash_attention,
    flash_config,
    paged_decode,
    rope_write_kv,
    write_kv,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_TOL = 2e-3 if DEVICE.type == "cuda" else 1e-5


def reference(q, k, v, causal: bool, window: int | None = None) -> torch.Tensor:
    """``q[T, H, D]`` (the last T of S positions) against ``k, v[S, KV, D]``, in fp32."""
    t, s = q.shape[0], k.shape[0]
    mask = causal_mask(torch.arange(s - t, s, device=q.device)[None], s, window) if causal else None
    out = attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        mask,
        q.shape[-1] ** -0.5,
    )
    return out[0].transpose(0, 1)


def random_sequences(lengths, heads, kv_heads, dim, gen, dtype=torch.float32):
    """Per sequence ``(new tokens, total keys)``: queries ``[t, H, D]``, keys and values ``[s, KV, D]``,
    and ``cu_seqlens`` of the queries packed back to back."""
    qs = [torch.randn(t, heads, dim, generator=gen).to(DEVICE, dtype) for t, _ in lengths]
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE, dtype) for _, s in lengths]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE, dtype) for _, s in lengths]
    cu_q = torch.tensor([0] + torch.tensor([t for t, _ in lengths]).cumsum(0).tolist(), device=DEVICE)
    return qs, ks, vs, cu_q


def scatter_into_pool(seqs_k, seqs_v, block_size, num_blocks, gen):
    """Write each sequence's K/V into randomly chosen, non-contiguous blocks of a pool."""
    kv_heads, dim = seqs_k[0].shape[1:]
    k_pool = torch.zeros(num_blocks * block_size, kv_heads, dim, dtype=seqs_k[0].dtype, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in zip(seqs_k, seqs_v):
        table = [free.pop() for _ in range(-(-k.shape[0] // block_size))]
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(k.shape[0])], device=DEVICE
        )
        k_pool[slots], v_pool[slots] = k, v
        tables.append(table)
    width = max(len(t) for t in tables)
    return k_pool, v_pool, torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)


CASES = [  # (heads, kv_heads, head_dim, [(new tokens, total keys) per sequence])
    (4, 4, 64, [(1, 1), (7, 7), (33, 33)]),  # MHA, lengths 1 and non-multiples of the tile
    (6, 2, 64, [(5, 20), (16, 16), (1, 9)]),  # GQA 3, prefixes already cached
    (8, 1, 128, [(9, 9), (3, 40)]),  # MQA (GQA 8), head_dim 128
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "lengths"), CASES)
def test_flash_attention_packed(heads, kv_heads, dim, lengths, causal):
    gen = torch.Generator().manual_seed(0)
    qs = [torch.randn(t, heads, dim, generator=gen).to(DEVICE) for t, _ in lengths]
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    cu_q = torch.tensor([0] + torch.tensor([t for t, _ in lengths]).cumsum(0).tolist(), device=DEVICE)
    cu_k = torch.tensor([0] + torch.tensor([s for _, s in lengths]).cumsum(0).tolist(), device=DEVICE)
    out = flash_attention(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, torch.tensor([s for _, s in lengths], device=DEVICE),
        max(t for t, _ in lengths), dim**-0.5, causal=causal, cu_seqlens_k=cu_k, block_m=16, block_n=16,
    )  # fmt: skip
    for i in range(len(lengths)):
        expected = reference(qs[i], ks[i], vs[i], causal)
        torch.testing.assert_close(out[cu_q[i] : cu_q[i + 1]], expected, atol=FP32_TOL, rtol=FP32_TOL)


VARIANTS = [  # every step of FlashConfig on and off, and tiles of unequal sides
    FlashConfig(block_m=16, block_n=16),
    FlashConfig(block_m=32, block_n=16, exp2=False),
    FlashConfig(block_m=16, block_n=32, skip_interior_masks=False),
    FlashConfig(block_m=16, block_n=16, exp2=False, skip_interior_masks=False, input_dtype_dots=False),
]


@pytest.mark.parametrize("config", VARIANTS, ids=["all", "exp", "masked", "none"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(6, 2, 48), (9, 3, 64), (4, 1, 128)])
@pytest.mark.parametrize("window", [None, 24])
def test_flash_attention_every_variant_is_exact(config, heads, kv_heads, dim, window):
    """Odd lengths that leave whole key tiles inside a query tile's view (run without masks when
    ``skip_interior_masks``) next to diagonal and window-edge tiles (with them); GQA 3:1 and 4:1;
    head dims 48 (padded to 64 in registers), 64 and 128; packed and paged keys."""
    gen = torch.Generator().manual_seed(5)
    lengths = [(70, 70), (5, 40), (19, 83)]
    qs, ks, vs, cu_q = random_sequences(lengths, heads, kv_heads, dim, gen)
    cu_k = torch.tensor([0] + torch.tensor([s for _, s in lengths]).cumsum(0).tolist(), device=DEVICE)
    seqlens = torch.tensor([s for _, s in lengths], device=DEVICE)
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, 8, 40, gen)
    packed = flash_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), cu_q, seqlens, 70, dim**-0.5,
                             cu_seqlens_k=cu_k, window=window, config=config)  # fmt: skip
    paged = flash_attention(torch.cat(qs), k_pool, v_pool, cu_q, seqlens, 70, dim**-0.5, block_tables=tables,
                            block_size=8, window=window, config=config)  # fmt: skip
    for i in range(len(lengths)):
        expected = reference(qs[i], ks[i], vs[i], True, window)
        torch.testing.assert_close(packed[cu_q[i] : cu_q[i + 1]], expected, atol=FP32_TOL, rtol=FP32_TOL)
        torch.testing.assert_close(paged[cu_q[i] : cu_q[i + 1]], expected, atol=FP32_TOL, rtol=FP32_TOL)


def test_flash_config_picks_tiles_per_head_dim():
    """The interpreter keeps the tests' 32 × 32 tiles; a GPU gets the tutorial's shapes, fewer
    queries for fp32 and head dims past 128, more warps for 128."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert flash_config(64, torch.bfloat16, cpu) == FlashConfig()
    if DEVICE.type == "cuda":
        small, large = flash_config(64, torch.bfloat16, gpu), flash_config(128, torch.bfloat16, gpu)
        assert (small.block_m, small.block_n, small.num_warps, small.num_stages) == (128, 64, 4, 3)
        assert (large.block_m, large.num_warps) == (128, 8)
        assert flash_config(64, torch.float32, gpu).block_m == 64 == flash_config(256, torch.bfloat16, gpu).block_m


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "lengths"), CASES)
def test_flash_attention_paged_prefix(heads, kv_heads, dim, lengths):
    """Prefill chunks that continue a cached prefix, their keys read from scattered pool blocks."""
    gen = torch.Generator().manual_seed(1)
    qs = [torch.randn(t, heads, dim, generator=gen).to(DEVICE) for t, _ in lengths]
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, 4, 40, gen)
    cu_q = torch.tensor([0] + torch.tensor([t for t, _ in lengths]).cumsum(0).tolist(), device=DEVICE)
    out = flash_attention(
        torch.cat(qs), k_pool, v_pool, cu_q, torch.tensor([s for _, s in lengths], device=DEVICE),
        max(t for t, _ in lengths), dim**-0.5, causal=True, block_tables=tables, block_size=4, block_m=16, block_n=16,
    )  # fmt: skip
    for i in range(len(lengths)):
        torch.testing.assert_close(
            out[cu_q[i] : cu_q[i + 1]], reference(qs[i], ks[i], vs[i], True), atol=FP32_TOL, rtol=FP32_TOL
        )


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["dot", "broadcast"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 4, 64), (6, 2, 64), (9, 3, 48), (8, 1, 128)])
def test_paged_decode(heads, kv_heads, dim, splits, tensor_cores):
    """Both ways of multiplying a query group (one matrix product on the group padded to 16
    rows, or fp32 broadcasts), GQA 1:1 to 8:1, head dims 48 (padded to 64), 64 and 128."""
    gen = torch.Generator().manual_seed(2)
    contexts = [1, 17, 50]
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for s in contexts]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for s in contexts]
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, 8, 20, gen)
    q = torch.randn(len(contexts), heads, dim, generator=gen).to(DEVICE)
    out = paged_decode(
        q, k_pool, v_pool, tables, torch.tensor(contexts, device=DEVICE), dim**-0.5, 8, max(contexts),
        num_splits=splits, block_n=16, config=DecodeConfig(tensor_cores=tensor_cores),
    )  # fmt: skip
    for i in range(len(contexts)):
        torch.testing.assert_close(
            out[i : i + 1], reference(q[i : i + 1], ks[i], vs[i], False), atol=FP32_TOL, rtol=FP32_TOL
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_accumulate_in_fp32(dtype):
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 4, 64, generator=gen).to(DEVICE, dtype)
    k = torch.randn(12, 2, 64, generator=gen).to(DEVICE, dtype)
    v = torch.randn(12, 2, 64, generator=gen).to(DEVICE, dtype)
    cu = torch.tensor([0, 12], device=DEVICE)
    out = flash_attention(
        q, k, v, cu, torch.tensor([12], device=DEVICE), 12, 0.125, cu_seqlens_k=cu, block_m=16, block_n=16
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(q, k, v, True), atol=2e-2, rtol=2e-2)
    k_pool, v_pool, tables = scatter_into_pool([k], [v], 4, 5, gen)
    dec = paged_decode(q[-1:], k_pool, v_pool, tables, torch.tensor([12], device=DEVICE), 0.125, 4, 12)
    torch.testing.assert_close(dec.float(), reference(q[-1:], k, v, False), atol=2e-2, rtol=2e-2)


def test_write_kv_through_slot_mapping():
    k_pool = torch.zeros(32, 2, 16, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    k, v = torch.randn(5, 2, 16, device=DEVICE), torch.randn(5, 2, 16, device=DEVICE)
    slots = torch.tensor([7, 3, 31, 16, 0], device=DEVICE)
    write_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool[slots], k) and torch.equal(v_pool[slots], v)
    assert k_pool.abs().sum(dim=(1, 2)).nonzero().flatten().sort().values.tolist() == sorted(slots.tolist())


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 48), (8, 1, 128)])
def test_rope_write_kv_is_rope_then_the_write(heads, kv_heads, dim, kv_cache_dtype):
    """One kernel for apply_rope on q and K and write_kv of K and V: the same q, the same pool
    bytes (and scales, for an 8-bit pool) as the two steps apart."""
    from minillm.models.rope import apply_rope

    gen = torch.Generator().manual_seed(6)
    n, slots_total = 5, 24
    qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=gen).to(DEVICE)
    angles = torch.rand(n, dim // 2, generator=gen).to(DEVICE) * 6.0
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    signed_sin = torch.cat([-angles.sin(), angles.sin()], -1)
    slots = torch.tensor([7, 3, 20, 16, 0], device=DEVICE)
    pool_dtype = torch.int8 if kv_cache_dtype == "int8" else torch.float32
    pools = [torch.zeros(slots_total, kv_heads, dim, dtype=pool_dtype, device=DEVICE) for _ in range(4)]
    scales = [torch.zeros(slots_total, kv_heads, device=DEVICE) for _ in range(4)] if kv_cache_dtype == "int8" else None
    quant = lambda i: {} if scales is None else dict(k_scales=scales[i], v_scales=scales[i + 1], kv_cache_dtype="int8")  # noqa: E731
    rotated = apply_rope(qkv[None, :, : heads + kv_heads], cos[None, :, None], signed_sin[None, :, None])[0]
    write_kv(rotated[:, heads:], qkv[:, heads + kv_heads :], pools[0], pools[1], slots, **quant(0))
    q = rope_write_kv(qkv, cos, signed_sin, heads, kv_heads, pools[2], pools[3], slots, **quant(2))
    torch.testing.assert_close(q, rotated[:, :heads], atol=1e-6, rtol=1e-6)
    if kv_cache_dtype == "int8":  # a last-bit difference in a rotated value may move its rounding by one step
        assert (pools[0].int() - pools[2].int()).abs().max() <= 1 and torch.equal(pools[1], pools[3])
        torch.testing.assert_close(scales[2], scales[0], atol=1e-7, rtol=1e-6)
        assert torch.equal(scales[1], scales[3])
    else:
        torch.testing.assert_close(pools[2], pools[0], atol=1e-6, rtol=1e-6)
        assert torch.equal(pools[3], pools[1])
    with pytest.raises(ValueError, match="qkv has 15 heads, not heads"):
        rope_write_kv(qkv[:, :15] if heads + 2 * kv_heads > 15 else torch.zeros(n, 15, dim, device=DEVICE), cos,
                      signed_sin, heads + 1, kv_heads, pools[2], pools[3], slots)  # fmt: skip


def test_a_course_rope_is_used_by_the_triton_step(tiny_model, monkeypatch):
    """The Triton step fuses RoPE with its K/V write only while apply_rope is the package's own:
    a learner's RoPE plugged in by a check runs instead of the fused kernel, and the tokens stay
    the same."""
    from minillm import hooks
    from minillm.attention import triton_kernels
    from minillm.models.rope import apply_rope

    fused_calls, learner_calls = [], []
    fused_kernel = triton_kernels.rope_write_kv

    def counted_fused(*args, **kwargs):
        fused_calls.append(1)
        return fused_kernel(*args, **kwargs)

    def learners_rope(x, cos, sin):
        learner_calls.append(x.shape)
        return apply_rope(x, cos, sin)

    monkeypatch.setattr(triton_kernels, "rope_write_kv", counted_fused)
    llm = LLM(tiny_model, attention_backend="triton", dtype="fp32", block_size=4, device=DEVICE.type)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    fused = llm.generate([[5, 17, 42, 8]], params)[0].token_ids
    assert fused_calls and not learner_calls
    fused_calls.clear()
    with hooks.override(apply_rope=learners_rope):
        plugged = llm.generate([[5, 17, 42, 8]], params)[0].token_ids
    assert learner_calls and not fused_calls and plugged == fused


def test_triton_backend_reproduces_torch_backend_end_to_end(tiny_model):
    """Greedy tokens identical: chunked prefill, scattered blocks, decodes, prefix-cache hits."""
    prompts = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12], [300, 4, 77, 77, 150, 20, 21, 22, 23]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    args = dict(dtype="fp32", block_size=4, max_num_batched_tokens=7, device=DEVICE.type)
    ref = LLM(tiny_model, attention_backend="torch", **args).generate(prompts, params)
    llm = LLM(tiny_model, attention_backend="triton", **args)
    for _ in range(2):  # the second round hits the prefix cache
        out = llm.generate(prompts, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert sum(o.num_cached_tokens for o in out) > 0


def test_triton_backend_needs_the_paged_engine(tiny_model):
    with pytest.raises(ValueError, match="attention_backend='triton' needs mode='paged'"):
        LLM(tiny_model, mode="contiguous", attention_backend="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 300])
def test_flash_attention_as_shipped_on_a_gpu(window):
    """The GPU's own tiles and bf16 dot products (``flash_config``, no overrides): a prefix that
    continues a cache, a window, paged keys; bf16 tolerance after the reference's rounding."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim = 32, 8, 128
    lengths = [(1000, 1000), (300, 2048), (7, 129)]
    qs, ks, vs, cu_q = random_sequences(lengths, heads, kv_heads, dim, gen, torch.bfloat16)
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, 16, 400, gen)
    out = flash_attention(torch.cat(qs), k_pool, v_pool, cu_q, torch.tensor([s for _, s in lengths], device=DEVICE),
                          1000, dim**-0.5, block_tables=tables, block_size=16, window=window)  # fmt: skip
    for i in range(len(lengths)):
        expected = reference(qs[i], ks[i], vs[i], True, window).to(torch.bfloat16).float()
        torch.testing.assert_close(out[cu_q[i] : cu_q[i + 1]].float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_on_real_shapes_gpu():
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim = 32, 8, 128
    lengths = [(1024, 1024), (300, 2048), (1, 777)]
    qs, ks, vs, cu_q = random_sequences(lengths, heads, kv_heads, dim, gen, torch.bfloat16)
    k_pool, v_pool, tables = scatter_into_pool(ks, vs, 16, 400, gen)
    out = flash_attention(
        torch.cat(qs), k_pool, v_pool, cu_q, torch.tensor([s for _, s in lengths], device=DEVICE), 1024, dim**-0.5,
        block_tables=tables, block_size=16, block_m=64, block_n=64,
    )  # fmt: skip
    for i in range(len(lengths)):
        torch.testing.assert_close(
            out[cu_q[i] : cu_q[i + 1]].float(), reference(qs[i], ks[i], vs[i], True), atol=2e-2, rtol=2e-2
        )
    q = torch.randn(3, heads, dim, generator=gen).to(DEVICE, torch.bfloat16)
    dec = paged_decode(
        q, k_pool, v_pool, tables, torch.tensor([s for _, s in lengths], device=DEVICE), dim**-0.5, 16, 2048
    )
    for i in range(3):
        torch.testing.assert_close(
            dec[i : i + 1].float(), reference(q[i : i + 1], ks[i], vs[i], False), atol=2e-2, rtol=2e-2
        )


def test_static_decode_buffers_reproduce_the_engine(tiny_model):
    """The CUDA-graph path (padded static buffers, null block) run eagerly: identical tokens, also
    with prefix sharing and preemptions interleaving graph and non-graph steps."""
    prompts = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12], [300, 4, 77, 77, 150], [5, 17, 42, 8, 99, 3, 1]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = LLM(tiny_model, dtype="fp32", attention_backend="torch").generate(prompts, params)
    llm = LLM(tiny_model, dtype="fp32", attention_backend="triton", cuda_graphs=True, max_num_seqs=3, block_size=4)
    assert llm.engine.graphs is not None and llm.engine.graphs.sizes == [1, 2, 3]
    out = llm.generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert set(llm.engine.graphs.static) >= {3}
    # The null block took every padded write; real blocks were untouched by padding.
    llm.engine.block_manager.check_invariants()


@pytest.mark.parametrize(
    ("engine_args", "message"),
    [
        (dict(attention_backend="torch", cuda_graphs=True), "cuda_graphs=True needs attention_backend='triton'"),
        (dict(mode="contiguous", cuda_graphs=True), "cuda_graphs=True needs mode='paged'"),
    ],
)
def test_cuda_graphs_configuration_errors(tiny_model, engine_args, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_model, dtype="fp32", **engine_args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_gpu(tiny_model):
    prompts = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12], [300, 4, 77, 77, 150]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eager = LLM(tiny_model, dtype="fp32", attention_backend="triton", cuda_graphs=False).generate(prompts, params)
    llm = LLM(tiny_model, dtype="fp32", attention_backend="triton", cuda_graphs=True, max_num_seqs=4)
    assert all(s.graph is not None for s in llm.engine.graphs.static.values())
    graphed = llm.generate(prompts, params)
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    memory = llm.engine.memory_report()
    assert memory["peak_allocated_bytes"] >= memory["kv_pool_bytes"]
