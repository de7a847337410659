"""The 8-bit KV cache in the Triton kernels against the PyTorch reference (``kvcache/quantization.py``).

``write_kv`` must store exactly what ``quantize_kv`` computes — the same int8 values or e4m3 bit
patterns, the same fp32 scales, ties rounded half to even — so the kernels and the reference
backends read the same pool. The attention kernels dequantize in registers; they are compared
with dequantize-then-attend in fp32. Without CUDA everything runs under Triton's interpreter,
so the shapes are small.
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention import triton_available
from minillm.attention.torch_ref import attention, causal_mask
from minillm.config import KVCacheDtype
from minillm.kvcache.quantization import FP8_MAX, dequantize_kv, quantize_kv

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from minillm.attention.triton_kernels import _e4m3_value, flash_attention, paged_decode, write_kv  # noqa: E402
from minillm.triton_setup import tl, triton  # noqa: E402  (triton ready for this machine)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 2e-3 if DEVICE.type == "cuda" else 1e-4
KINDS = ["int8", "fp8"]
BLOCK = 16


def empty_pool(kind: str, num_slots: int, kv_heads: int, dim: int):
    k = torch.zeros(num_slots, kv_heads, dim, dtype=KVCacheDtype(kind).storage, device=DEVICE)
    scales = torch.zeros(num_slots, kv_heads, device=DEVICE)
    return k, torch.zeros_like(k), scales, torch.zeros_like(scales)


def quantized_pool(kind, seqs_k, seqs_v, num_blocks, gen):
    """Each sequence's K/V quantized by the reference and scattered over random pool blocks.
    Returns the pool, the block tables, and the dequantized K/V the kernels should attend to."""
    kv_heads, dim = seqs_k[0].shape[1:]
    k_pool, v_pool, k_scales, v_scales = empty_pool(kind, num_blocks * BLOCK, kv_heads, dim)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, stored = [], []
    for k, v in zip(seqs_k, seqs_v):
        table = [free.pop() for _ in range(-(-k.shape[0] // BLOCK))]
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(k.shape[0])], device=DEVICE)
        (kq, ks), (vq, vs) = quantize_kv(k, kind), quantize_kv(v, kind)
        k_pool[slots], k_scales[slots], v_pool[slots], v_scales[slots] = kq, ks, vq, vs
        stored.append((dequantize_kv(kq, ks, torch.float32), dequantize_kv(vq, vs, torch.float32)))
        tables.append(table)
    width = max(map(len, tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    return (k_pool, v_pool, k_scales, v_scales), tables, stored


def reference(q, k, v, window=None, causal=True):
    """``q[T, H, D]`` — the last T of S positions — against ``k, v[S, KV, D]``, in fp32."""
    t, s = q.shape[0], k.shape[0]
    mask = causal_mask(torch.arange(s - t, s, device=q.device)[None], s, window) if causal else None
    out = attention(
        q.float().transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, q.shape[-1] ** -0.5
    )
    return out[0].transpose(0, 1)


# ---- (a) write_kv stores what quantize_kv computes ------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_quantizes_like_the_reference(kind):
    gen = torch.Generator().manual_seed(0)
    n, kv_heads, dim = 24, 2, 24  # head_dim not a power of two: masked lanes must not count
    # magnitudes from 1e-6 to 1e3, so scales span the range and fp8 meets its subnormals
    spread = torch.logspace(-6, 3, n)[:, None, None]
    k = (torch.randn(n, kv_heads, dim, generator=gen) * spread).to(DEVICE)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(DEVICE)
    k[3, 1] = 0.0  # an all-zero head: the scale's floor (1e-8) keeps it finite
    k_pool, v_pool, k_scales, v_scales = empty_pool(kind, 64, kv_heads, dim)
    slots = torch.randperm(64, generator=gen)[:n].to(DEVICE)
    write_kv(k, v, k_pool, v_pool, slots, k_scales, v_scales, kind)
    for x, pool, scales in ((k, k_pool, k_scales), (v, v_pool, v_scales)):
        q, scale = quantize_kv(x, kind)
        assert torch.equal(pool[slots], q)  # bit for bit: IEEE division, the same rounding
        torch.testing.assert_close(scales[slots], scale, rtol=1e-6, atol=0)
    untouched = torch.ones(64, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert not k_pool[untouched].any() and not k_scales[untouched].any()


def _rows_with_scale_one(values: torch.Tensor, top: float, dim: int) -> torch.Tensor:
    """``values`` laid out as ``[N, 1, dim]`` rows that each start with ``top``, so every row's
    scale is exactly 1 and the values reach the rounding unchanged."""
    per_row = dim - 1
    pad = (-values.numel()) % per_row
    body = torch.cat([values, torch.zeros(pad)]).view(-1, per_row)
    return torch.cat([torch.full((body.shape[0], 1), top), body], dim=1)[:, None].to(DEVICE)


@pytest.mark.parametrize("kind", KINDS)
def test_write_kv_rounds_ties_half_to_even(kind):
    """Every tie, and the values either side of it: int8 halves ``k + 0.5``; for fp8 the midpoints
    between all neighbouring e4m3 values — subnormals, and carries into the next power of two
    (where the interpreter's own float→fp8 cast goes wrong: 124 → 64)."""
    if kind == "int8":
        top, grid = 127.0, torch.arange(-127, 127, dtype=torch.float32) + 0.5
    else:
        top = FP8_MAX
        codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # every finite value up to 448
        grid = codes.view(torch.float8_e4m3fn).float()
        grid = torch.cat([grid, (grid[:-1] + grid[1:]) / 2])
        grid = torch.cat([grid, -grid])
    grid = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    grid = grid.clamp(-top, top)
    k = _rows_with_scale_one(grid, top, 32)
    k_pool, v_pool, k_scales, v_scales = empty_pool(kind, k.shape[0], 1, 32)
    slots = torch.arange(k.shape[0], device=DEVICE)
    write_kv(k, k, k_pool, v_pool, slots, k_scales, v_scales, kind)
    q, scale = quantize_kv(k, kind)
    assert bool((scale == 1.0).all())
    assert torch.equal(k_pool, q) and torch.equal(v_pool, q)


@triton.jit
def _decode_codes(Codes, Out, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(Out + offs, _e4m3_value(tl.load(Codes + offs).to(tl.int32)))


def test_e4m3_decoding_in_registers_is_exact():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    out = torch.empty(256, device=DEVICE)
    _decode_codes[(1,)](codes, out, N=256)
    expected = codes.view(torch.float8_e4m3fn).float()
    finite = ~expected.isnan()  # 0x7F and 0xFF: NaN, never stored (values are clamped to ±448)
    assert int(finite.sum()) == 254
    assert torch.equal(out[finite], expected[finite])
    assert torch.equal(out[finite].signbit(), expected[finite].signbit())  # -0.0 too


# ---- (b) paged decode over an 8-bit pool -----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "splits", "window"),
    [(2, 2, 16, 1, None), (4, 2, 32, 3, None), (4, 1, 32, 2, 12)],  # MHA; GQA split-K; MQA + window
)
def test_paged_decode_dequantizes_in_registers(kind, heads, kv_heads, dim, splits, window):
    gen = torch.Generator().manual_seed(1)
    contexts = [1, 17, 50]
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for s in contexts]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for s in contexts]
    (k_pool, v_pool, k_scales, v_scales), tables, stored = quantized_pool(kind, ks, vs, 12, gen)
    q = torch.randn(len(contexts), heads, dim, generator=gen).to(DEVICE)
    out = paged_decode(
        q, k_pool, v_pool, tables, torch.tensor(contexts, device=DEVICE), dim**-0.5, BLOCK, max(contexts),
        num_splits=splits, block_n=16, window=window, k_scales=k_scales, v_scales=v_scales, kv_cache_dtype=kind,
    )  # fmt: skip
    for i, (k, v) in enumerate(stored):
        torch.testing.assert_close(out[i : i + 1], reference(q[i : i + 1], k, v, window), atol=TOL, rtol=TOL)


# ---- (c) paged prefill over an 8-bit pool ----------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("window", [None, 6])
def test_paged_prefill_continues_an_8bit_prefix(kind, window):
    """Prefill chunks whose cached prefix (and own new tokens) are read from an 8-bit pool."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 4, 2, 32
    lengths = [(5, 20), (16, 16), (1, 9)]  # (new tokens, total keys)
    qs = [torch.randn(t, heads, dim, generator=gen).to(DEVICE) for t, _ in lengths]
    ks = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    vs = [torch.randn(s, kv_heads, dim, generator=gen).to(DEVICE) for _, s in lengths]
    (k_pool, v_pool, k_scales, v_scales), tables, stored = quantized_pool(kind, ks, vs, 8, gen)
    cu_q = torch.tensor([0] + torch.tensor([t for t, _ in lengths]).cumsum(0).tolist(), device=DEVICE)
    out = flash_attention(
        torch.cat(qs), k_pool, v_pool, cu_q, torch.tensor([s for _, s in lengths], device=DEVICE),
        max(t for t, _ in lengths), dim**-0.5, block_tables=tables, block_size=BLOCK, block_m=16, block_n=16,
        window=window, k_scales=k_scales, v_scales=v_scales, kv_cache_dtype=kind,
    )  # fmt: skip
    for i, (k, v) in enumerate(stored):
        expected = reference(qs[i], k, v, window)
        torch.testing.assert_close(out[cu_q[i] : cu_q[i + 1]], expected, atol=TOL, rtol=TOL)


def test_an_8bit_pool_without_scales_is_refused():
    k_pool = torch.zeros(16, 1, 16, dtype=torch.int8, device=DEVICE)
    k = torch.randn(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="needs k_scales and v_scales"):
        write_kv(k, k, k_pool, k_pool.clone(), torch.zeros(1, dtype=torch.long, device=DEVICE), kv_cache_dtype="int8")


# ---- (d) the engine ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_triton_backend_on_an_8bit_pool_reproduces_the_torch_backend(tiny_model, kind):
    """Greedy tokens identical to the reference backend on the same 8-bit pool: chunked prefill,
    scattered blocks, decodes, prefix-cache hits (prefills that read a quantized prefix)."""
    prompts = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12], [300, 4, 77, 77, 150, 20, 21, 22, 23]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    args = dict(dtype="fp32", block_size=4, max_num_batched_tokens=7, device=DEVICE.type, kv_cache_dtype=kind)
    ref = LLM(tiny_model, attention_backend="torch", **args).generate(prompts, params)
    llm = LLM(tiny_model, attention_backend="triton", **args)
    assert llm.model.attention_backend.name == "triton"
    for _ in range(2):  # the second round hits the prefix cache
        out = llm.generate(prompts, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert sum(o.num_cached_tokens for o in out) > 0
