"""Chapter 05's whole piece: the learner's attention layer over the paged cache — one mixed step's
queries, each sequence against its own keys read through its block table, grouped K/V heads,
the causal mask at the right positions, and the sliding window.

1. **diagnosis on a hand-made step** — a random pool of block size 4, three sequences (a decode,
   a fresh prompt, a prompt chunk continuing a cached prefix), 4 query heads over 2 K/V heads,
   with and without a window of 3: against the textbook computation and its classic variants
   (K/V heads tiled, keys past the context read, the chunk masked from position 0, the window
   one key short or ignored, the scale ignored);
2. **the plug-in run** — the learner's function as the attention of every layer of the real
   paged engine (hook ``paged_attention``), chunked prompts mixing with decodes, with a sliding
   window of 12 keys: greedy tokens equal to the naive engine's with the same window.
"""

from __future__ import annotations

import torch

import minillm.hooks as hooks
from minillm.course.compare import compare_requests, compare_tensors, name_the_slip
from minillm.course.results import CheckFailed, check

WINDOW = 12  # the plug-in run's sliding window (keys), short enough to bite on the check's prompts


def reference_paged_attention(q, k_slots, v_slots, query_lens, context_lens, block_tables, block_size: int,
                              scale: float, window: int | None = None, mistake: str | None = None) -> torch.Tensor:  # fmt: skip
    """The textbook computation, or one of its wrong variants (``MISTAKES``)."""
    heads, kv_heads = q.shape[1], k_slots.shape[1]
    out, row = [], 0
    for n, ctx, table in zip(query_lens, context_lens, block_tables):
        seen = len(table) * block_size if mistake == "past_context" else ctx
        slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in range(seen)])
        k, v = k_slots[slots], v_slots[slots]  # [seen, KV, D]
        if mistake == "tiled":
            k, v = k.repeat(1, heads // kv_heads, 1), v.repeat(1, heads // kv_heads, 1)
        else:
            k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        qs = q[row : row + n]
        used_scale = 1.0 if mistake == "no_scale" else scale
        scores = torch.einsum("thd,shd->hts", qs, k) * used_scale  # [H, n, seen]
        first = 0 if mistake == "from_zero" else ctx - n
        pos = torch.arange(first, first + n)[:, None]
        keys = torch.arange(seen)[None, :]
        allowed = keys <= pos
        if mistake == "past_context" and n == 1:  # "a decode sees everything": no mask for one query
            allowed = torch.ones_like(allowed)
        if window is not None and mistake != "no_window":
            allowed = allowed & (keys >= pos - window if mistake == "window_plus_one" else keys > pos - window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out.append(torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v))
        row += n
    return torch.cat(out)


MISTAKES = {
    "tiled": "K/V heads were repeated as [0, 1, 0, 1]: query head h reads K/V head h // (H // KV) — "
    "repeat_interleave along the heads",
    "past_context": "a decode read every key of its table's blocks, past its context: read positions "
    "0..context_len-1 only (the rest of the last block is empty or another sequence's, and padding entries point "
    "at a block someone else may own)",
    "from_zero": "the causal mask put a chunk's queries at positions 0..n-1: they sit at context_len - n .. "
    "context_len - 1 (a chunk continuing a cached prefix sees all of it)",
    "window_plus_one": "the window lets a query see window + 1 keys: it sees its last `window` keys, positions "
    "pos - window + 1 .. pos",
    "no_window": "the sliding window was ignored: with window w, a query at position pos sees only keys "
    "pos - w + 1 .. pos",
    "no_scale": "the scores were not multiplied by `scale` (1/sqrt(head_dim), passed in)",
}


def example_step(window: int | None = None, seed: int = 0):
    """A random pool (8 blocks of 4 slots, 2 K/V heads of 8 dims) and a step of three sequences:
    a decode at context 7, a fresh 5-token prompt, a 3-token chunk continuing to context 10."""
    gen = torch.Generator().manual_seed(seed)
    k_slots, v_slots = torch.randn(32, 2, 8, generator=gen), torch.randn(32, 2, 8, generator=gen)
    query_lens, context_lens = [1, 5, 3], [7, 5, 10]
    block_tables = torch.tensor([[5, 2, 0], [1, 7, 0], [3, 6, 4]])  # 0 pads (an unused block here)
    q = torch.randn(sum(query_lens), 4, 8, generator=gen)
    return dict(q=q, k_slots=k_slots, v_slots=v_slots, query_lens=query_lens, context_lens=context_lens,
                block_tables=block_tables, block_size=4, scale=8**-0.5, window=window)  # fmt: skip


def _check_example(paged_attention) -> None:
    for window in (None, 3):
        args = example_step(window)
        frozen = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
        got = paged_attention(**args)
        if any(not torch.equal(args[k], v) for k, v in frozen.items()):
            raise CheckFailed("paged_attention changed one of its inputs in place: the pool and q are read-only here")
        expected = reference_paged_attention(**args)
        what = "paged_attention on the example step" + (f" with a window of {window}" if window else "")
        slips = ((reference_paged_attention(**args, mistake=m), why) for m, why in MISTAKES.items())
        if name_the_slip(got, expected, slips):
            bad = _first_bad_sequence(got, expected, args["query_lens"])
            raise CheckFailed(
                f"{what}: sequence {bad} ({['the decode at context 7', 'the fresh 5-token prompt', 'the 3-token chunk continuing to context 10'][bad]}) "
                f"differs from the reference by up to {float((got - expected).abs().max()):.3g}"
            )  # fmt: skip
        compare_tensors(got, expected, what)


def _first_bad_sequence(got, expected, query_lens) -> int:
    row = 0
    for i, n in enumerate(query_lens):
        if not torch.allclose(got[row : row + n], expected[row : row + n], atol=1e-5):
            return i
        row += n
    return 0


def attention_adapter(paged_attention, counts: dict):
    """Fit a learner's function into hook ``paged_attention`` (the step's pool and layout as
    plain tensors and lists); ``counts`` records the steps that mixed decodes with prompt chunks."""

    def run(step, layer, q, k, v, scale):
        layout, pool = step.layout, step.pool
        if layer == 0:
            counts["steps"] = counts.get("steps", 0) + 1
            if 0 < layout.num_decodes < len(layout.query_lens):
                counts["mixed"] = counts.get("mixed", 0) + 1
        return paged_attention(q, pool.k_slots[layer], pool.v_slots[layer], list(layout.query_lens),
                               list(layout.context_lens), layout.block_tables, pool.block_size, scale,
                               layout.window)  # fmt: skip

    return run


PROMPTS = (
    "ROMEO.\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun.",
    "KING.\nNow is the winter of our discontent made glorious summer",
)


@check
def check_paged_attention(paged_attention, model: str = "tiny-shakespeare-1m") -> str:
    """``paged_attention(q[N, H, D], k_slots, v_slots[num_slots, KV, D], query_lens, context_lens,
    block_tables[S, W], block_size, scale, window=None) -> [N, H, D]``."""
    from minillm import LLM, SamplingParams

    _check_example(paged_attention)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    naive = LLM(model, dtype="fp32", mode="naive", sliding_window=WINDOW)
    expected = [o.token_ids for o in naive.generate(list(PROMPTS), params)]
    llm = LLM(model, dtype="fp32", attention_backend="torch", compile=False, sliding_window=WINDOW, block_size=4,
              max_num_batched_tokens=16, enable_prefix_caching=False)  # fmt: skip
    counts: dict = {}
    with hooks.override(paged_attention=attention_adapter(paged_attention, counts)):
        got = [o.token_ids for o in llm.generate(list(PROMPTS), params)]
    compare_requests(
        got,
        expected,
        f"request {{i}} of the paged engine running your attention (window {WINDOW})",
        "your function matched the example step: what differs on the engine's own steps?",
    )
    if counts.get("mixed", 0) == 0:
        raise CheckFailed("internal: the check's run had no step mixing decodes with prompt chunks")
    return (
        f"your attention ran in every layer of the paged engine for {counts['steps']} steps ({counts['mixed']} "
        f"mixing decodes with prompt chunks), with a {WINDOW}-key sliding window, and gave the naive engine's "
        "greedy tokens"
    )
