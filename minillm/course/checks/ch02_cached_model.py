"""Chapter 02's whole piece: the learner's RoPE, KV cache class and cached forward step.

Three stages, each naming the part that is wrong:

1. **diagnosis on hand-made inputs** — ``apply_rope`` on random heads against the Hugging Face
   rotation and its classic variants (pairs (2i, 2i+1), the turn the wrong way, cos and sin
   swapped); ``KVCache`` through a short life — two layers, a prefill, two decode appends —
   checking what each append returns (the positions so far, as views of one preallocated
   buffer, each layer on its own);
2. **the plug-in run** — the learner's ``apply_rope`` as the rotation of every layer of the
   real engine (hook ``apply_rope``, the contiguous engine with its KV cache), greedy tokens
   compared with the naive engine's;
3. **the cached model** — ``cached_forward`` with the learner's own cache: the prefill's and
   every decode step's logits within 1e-4 of the engine's ``forward_step`` at the same
   position, and the same greedy tokens as the naive engine, without running the package's model.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.course.checks.ch01_transformer import refusing_model_calls
from minillm.course.compare import compare_tensors, compare_tokens, name_the_slip
from minillm.course.helpers import forward_step, new_cache
from minillm.course.results import CheckFailed, check, learner_function

LOGITS_ATOL = 1e-4
TOKENS = 16

# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def reference_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``: pairs ``(i, i + D/2)``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rope_mistakes(x, cos, sin):
    half = x.shape[-1] // 2
    pairs = x.unflatten(-1, (-1, 2))  # (2i, 2i+1)
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    interleaved_cos = cos[..., :half].repeat_interleave(2, dim=-1)
    interleaved_sin = sin[..., :half].repeat_interleave(2, dim=-1)
    yield (
        x * interleaved_cos + turned * interleaved_sin,
        "your RoPE rotates pairs (0, 1), (2, 3), ... (the GPT-NeoX/Meta layout of the original paper) where this model "
        "pairs (i, i + D/2): rotate_half([x1, x2]) = [-x2, x1] with x1, x2 the two halves",
    )
    yield (
        x * cos + turned * sin,
        "your RoPE rotates pairs (0, 1), (2, 3), ... where this model pairs (i, i + D/2): rotate_half([x1, x2]) = "
        "[-x2, x1] with x1, x2 the two halves",
    )
    yield (
        x * cos - torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin,
        "your RoPE turns the wrong way: rotate_half([x1, x2]) is [-x2, x1] (the minus on the second half), added "
        "with + sin",
    )
    yield x * sin + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * cos, "your RoPE swapped cos and sin"
    yield x * cos, "your RoPE dropped the rotate_half(x)·sin term: x·cos alone only shrinks x"
    yield (
        x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin,
        "your RoPE swaps the halves without the minus sign: rotate_half([x1, x2]) = [-x2, x1]",
    )


def _check_apply_rope(apply_rope, config) -> None:
    import dataclasses

    from minillm.course.weights import rope_cos_sin

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 8, generator=gen)  # [heads, T, head_dim]
    cos, sin = rope_cos_sin(dataclasses.replace(config, head_dim=8), 7)
    given = x.clone()
    got = apply_rope(given, cos, sin)
    if not torch.equal(given, x):
        raise CheckFailed("apply_rope changed its input x in place: compute on new tensors")
    expected = reference_apply_rope(x, cos, sin)
    name_the_slip(got, expected, _rope_mistakes(x, cos, sin))
    compare_tensors(got, expected, "apply_rope(x[3 heads, 7 positions, 8 dims], cos, sin)")
    batched = apply_rope(x[None], cos, sin)  # [1, heads, T, D]: any leading dims
    compare_tensors(batched, expected[None], "apply_rope on x[1, 3, 7, 8] (rotate the last dim, whatever comes before)")


def rope_adapter(apply_rope):
    """Fit a learner's ``apply_rope(x[heads, T, D], cos[T, D], sin[T, D])`` into hook
    ``apply_rope`` (``x[B, T, heads, D]`` with broadcast tables and the sign folded into sin)."""

    def run(x, cos, signed_sin):
        half = cos.shape[-1] // 2
        sin = torch.cat([-signed_sin[..., :half], signed_sin[..., half:]], dim=-1)
        rows = [apply_rope(x[b].transpose(0, 1), cos[b, :, 0], sin[b, :, 0]).transpose(0, 1) for b in range(x.shape[0])]
        return torch.stack(rows)

    return run


# ---------------------------------------------------------------------------------------------
# The cache class
# ---------------------------------------------------------------------------------------------


def _kv(seed: int, heads: int, t: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, t, d, generator=gen), torch.randn(heads, t, d, generator=gen)


def _check_cache_class(KVCache) -> None:
    heads, d, max_len = 2, 4, 10
    try:
        cache = KVCache(2, heads, max_len, d)
    except TypeError as err:
        raise CheckFailed(f"KVCache(num_layers=2, num_kv_heads=2, max_len=10, head_dim=4) failed: {err}") from None
    append = learner_function(cache.append)  # what it raises is the learner's, not the check's
    k0, v0 = _kv(0, heads, 3, d)  # layer 0's prefill of 3 tokens
    k1, v1 = _kv(1, heads, 3, d)  # layer 1's
    got = append(0, 0, k0, v0)
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailed(f"KVCache.append should return (k, v), two tensors; it returned {type(got).__name__}")
    if tuple(got[0].shape) == (heads, max_len, d):
        raise CheckFailed(
            "KVCache.append returned the whole buffer (max_len positions, the unwritten ones too): return positions "
            "0..start+T-1 only, or attention reads empty slots"
        )
    if got[0].dim() == 3 and got[0].shape[1] != 3:
        raise CheckFailed(
            f"KVCache.append(layer 0, start 0, 3 tokens) returned positions 0..{got[0].shape[1] - 1}: return every "
            "position written so far, 0..start+T-1 (here 0..2)"
        )
    compare_tensors(got[0], k0, "the keys append(layer 0, start 0, 3 tokens) returned")
    compare_tensors(got[1], v0, "the values append(layer 0, start 0, 3 tokens) returned")
    append(1, 0, k1, v1)
    k_new, v_new = _kv(2, heads, 1, d)  # layer 0's first decode token, at position 3
    first_k, _ = append(0, 3, k_new, v_new)
    if tuple(first_k.shape) == (heads, 1, d):
        raise CheckFailed(
            "KVCache.append returned only the new token's keys: return every position so far, 0..start+T-1"
        )
    if tuple(first_k.shape) == (heads, 4, d) and torch.equal(first_k[:, :3], k1):
        raise CheckFailed(
            "layer 0's keys after layer 1's prefill are layer 1's: the layers share one buffer ([buffer] * num_layers "
            "repeats one tensor). Each layer keeps its own: make a new tensor per layer"
        )
    compare_tensors(first_k, torch.cat([k0, k_new], dim=1), "the keys of layer 0 after a decode append at position 3")
    k_next, v_next = _kv(3, heads, 1, d)
    second_k, second_v = append(0, 4, k_next, v_next)
    compare_tensors(second_v, torch.cat([v0, v_new, v_next], dim=1), "the values of layer 0 after appends at 3 and 4")
    if second_k.untyped_storage().data_ptr() != first_k.untyped_storage().data_ptr():
        raise CheckFailed(
            "KVCache.append returned a new tensor each step (torch.cat copies the whole history for every token): "
            "allocate each layer's [kv_heads, max_len, head_dim] once in __init__, write into it, return slices"
        )
    k1_view, _ = append(1, 3, *_kv(4, heads, 1, d))
    compare_tensors(k1_view[:, :3], k1, "layer 1's first 3 keys after layer 0's appends (each layer keeps its own)")
    before = k_new.clone()
    k_new.add_(100.0)  # the caller reuses its tensor: the cache must hold its own copy
    again, _ = append(0, 5, *_kv(5, heads, 1, d))
    if not torch.allclose(again[:, 3], before[:, 0]):
        raise CheckFailed(
            "KVCache kept a reference to the k it was given, not its values: write them into the cache's own buffer"
        )


# ---------------------------------------------------------------------------------------------
# The cached forward step
# ---------------------------------------------------------------------------------------------


REFUSED = (
    "cached_forward ran the package's model (model(...), forward_step or a layer module): build the step from "
    "model_weights(model), your apply_rope and your KVCache"
)


def _check_cached_forward(cached_forward, KVCache, llm, expected_tokens: list[int]) -> None:
    from minillm.course.checks.common import prompt_ids

    model, cfg = llm.model, llm.model.config
    prompt = prompt_ids(llm)
    max_len = len(prompt) + TOKENS
    theirs = KVCache(cfg.num_layers, cfg.num_kv_heads, max_len, cfg.head_dim)
    ours = new_cache(model, max_len)
    steps = [(list(prompt), 0)]
    tokens: list[int] = []
    for i in range(TOKENS):
        ids, start = steps[-1]
        expected = forward_step(model, ids, start, ours)
        with refusing_model_calls(model, REFUSED):
            got = cached_forward(model, list(ids), start, theirs)
        what = (
            f"the prefill ({len(ids)} tokens at 0..{len(ids) - 1})"
            if start == 0
            else f"decode step {i} (one token at position {start})"
        )
        if (
            isinstance(got, torch.Tensor)
            and got.shape == expected.shape
            and not torch.allclose(got.float(), expected, atol=LOGITS_ATOL)
        ):
            _diagnose_step(got, expected, start, i)
        compare_tensors(
            got.float() if isinstance(got, torch.Tensor) else got,
            expected,
            f"cached_forward's logits for {what}",
            atol=LOGITS_ATOL,
        )
        tokens.append(int(got[-1].argmax()))
        steps.append(([tokens[-1]], start + len(ids)))
    compare_tokens(
        tokens,
        expected_tokens,
        "greedy tokens from your cached_forward and KVCache",
        "every step's logits matched: do you feed each step the token the last one chose?",
    )


def _diagnose_step(got, expected, start: int, i: int) -> None:
    if start == 0:
        raise CheckFailed(
            "your RoPE and KVCache are right, but cached_forward's prefill logits differ from the engine's by up to "
            f"{float((got.float() - expected).abs().max()):.3g}: check the layer's recipe (as in chapter 01) and the "
            "causal mask over the cache"
        )
    raise CheckFailed(
        f"your prefill matches the engine's, but decode step {i} (one token at position {start}) differs by up to "
        f"{float((got.float() - expected).abs().max()):.3g}: a decode step rotates its token by the RoPE row of "
        f"*its* position ({start}, not 0), appends its K/V at that position, and attends over all {start + 1} cached "
        "positions (a one-token query sees every cached key)"
    )


@check
def check_cached_model(apply_rope, KVCache, cached_forward, model: str = "tiny-shakespeare-1m") -> str:
    """``apply_rope(x[..., T, D], cos, sin)``, a ``KVCache(num_layers, num_kv_heads, max_len,
    head_dim)`` with ``append(layer, start, k, v) -> (k, v)`` so far, and ``cached_forward(model,
    ids, start, cache) -> logits[T, vocab]``: the model with a KV cache, from its weights."""
    from minillm import SamplingParams
    from minillm.course.checks.common import engine, prompt_ids, reference_tokens

    llm = engine(model, "contiguous")
    _check_apply_rope(apply_rope, llm.model.config)
    expected = reference_tokens(model, TOKENS)
    with hooks.override(apply_rope=rope_adapter(apply_rope)):
        got = llm.generate([prompt_ids(llm)], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0].token_ids
    compare_tokens(
        got,
        expected,
        "the cached engine rotating q and k with your apply_rope",
        "your apply_rope matched on small tensors: does it depend on the shapes it was given?",
    )
    _check_cache_class(KVCache)
    _check_cached_forward(cached_forward, KVCache, llm, expected)
    return (
        f"your apply_rope rotated q and k in every layer of the cached engine, and your KVCache and cached_forward "
        f"ran the prefill and {TOKENS - 1} decode steps with the engine's logits (within {LOGITS_ATOL:g}) and the "
        f"naive engine's {TOKENS} greedy tokens"
    )
