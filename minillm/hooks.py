"""Hook points: the named places where the engine calls a function the course may replace.

Why this module exists: every exercise of the course is checked by plugging the learner's
function into the real engine — their slot mapping writes the K/V, their allocator hands out
the blocks, their acceptance rule decides which proposals stay. The checks used to do that by
patching private methods and module globals, so renaming a method or moving a call silently
unplugged a chapter (the check then graded the package's own code). Now each plug-in point is
declared here, once, with its signature, the chapter that plugs into it and the engine file
that calls it; the engine calls it *by name*, and a check installs the learner's function for
the duration of a ``with``::

    from minillm import hooks

    with hooks.override(block_hash=learner_block_hash):
        engine.step()  # every block the engine names is named by the learner's function

Three roles:

- this module **declares** each hook (``HookPoint``: doc, signature, chapter, caller, owner);
- the module that owns the package's own implementation **registers** it as the hook's
  reference (``@hooks.reference("block_hash")`` above its ``def``), so this module imports
  nothing from the package and stays on the lowest floor;
- the engine **calls** ``hooks.<name>(...)``.

Cost on the hot path: a hook is a plain module global holding the current implementation, so
a call is one module-attribute lookup and a direct call — no wrapper object, no per-call
allocation. ``override`` rebinds that global and always restores it. That is also why engine
code must call ``hooks.block_hash(...)`` and never ``from minillm.hooks import block_hash``: the
imported name would freeze the function at import time and an override would not reach it
(``tests/test_architecture.py`` refuses such imports).

Overrides are process-wide (every engine and thread of the process sees them) and nest: the
innermost one wins, and leaving a ``with`` — normally or by an exception — brings back what was
there before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class HookPoint:
    """One place where the engine calls a replaceable function."""

    name: str
    signature: str  # the call the engine makes, e.g. "block_hash(parent_hash, token_ids) -> int"
    doc: str  # what the function decides, and what the engine relies on
    chapter: str  # the course chapter whose exercise plugs in here
    owner: str  # the module whose function is the reference (it registers it)
    caller: str  # the engine file that makes the call
    default: Callable | None = None  # the package's reference implementation, once registered
    overrides: list[Callable] = field(default_factory=list)  # innermost last

    def current(self) -> Callable:
        """What a call runs now: the innermost override, else the reference."""
        if self.overrides:
            return self.overrides[-1]
        return self.default if self.default is not None else self.unregistered

    def unregistered(self, *args, **kwargs):
        raise RuntimeError(
            f"hook {self.name!r} has no implementation: its reference is registered when {self.owner} is imported"
        )


_POINTS: dict[str, HookPoint] = {}


def _declare(name: str, signature: str, chapter: str, owner: str, caller: str, doc: str) -> Callable:
    """Declare hook ``name``; returns the placeholder the module global starts as."""
    point = HookPoint(name, signature, " ".join(doc.split()), chapter, owner, caller)
    _POINTS[name] = point
    return point.unregistered


def _install(point: HookPoint) -> None:
    """Point the module global at what a call must run now."""
    globals()[point.name] = point.current()


def _point(name: str) -> HookPoint:
    if name not in _POINTS:
        raise ValueError(f"no hook named {name!r}; the hooks are: {', '.join(sorted(_POINTS))}")
    return _POINTS[name]


def reference(name: str) -> Callable[[Callable], Callable]:
    """Decorator: the decorated function is the package's implementation of hook ``name``
    (what runs when nothing overrides it). Returns the function unchanged."""
    point = _point(name)

    def register(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"the reference of hook {name!r} must be callable, got {type(fn).__name__}")
        point.default = fn
        _install(point)
        return fn

    return register


@contextlib.contextmanager
def override(**implementations: Callable) -> Iterator[None]:
    """Run the given hooks with these functions inside the ``with``; restore them on the way
    out, also when the body raises. ``override(block_hash=mine, blocks_to_roll_back=mine_too)``.

    Unknown names raise ``ValueError`` (naming the known hooks) and non-callables ``TypeError``,
    before anything is installed."""
    points = [_point(name) for name in implementations]
    for point, fn in zip(points, implementations.values()):
        if not callable(fn):
            raise TypeError(f"hooks.override({point.name}=...) needs a function, got {type(fn).__name__}")
    installed: list[tuple[HookPoint, Callable]] = []
    try:
        for point, fn in zip(points, implementations.values()):
            point.overrides.append(fn)
            installed.append((point, fn))
            _install(point)
        yield
    finally:
        for point, fn in reversed(installed):
            # by identity from the end: correct even if an inner override was left out of order
            for i in range(len(point.overrides) - 1, -1, -1):
                if point.overrides[i] is fn:
                    del point.overrides[i]
                    break
            _install(point)


def default(name: str) -> Callable:
    """The package's reference implementation of hook ``name`` (a learner's wrapper may delegate to it)."""
    point = _point(name)
    if point.default is None:
        raise RuntimeError(f"hook {name!r} has no reference yet: it is registered when {point.owner} is imported")
    return point.default


def current(name: str) -> Callable:
    """What a call of hook ``name`` runs now (the innermost override, else the reference)."""
    return _point(name).current()


def points() -> dict[str, HookPoint]:
    """Every hook point by name, in declaration order (chapter by chapter)."""
    return dict(_POINTS)


# ---------------------------------------------------------------------------------------------
# The hook points, in course order. Each module global below is the function a call runs now.
# ---------------------------------------------------------------------------------------------

torch_attention = _declare(
    "torch_attention",
    "torch_attention(q[B, H, T, D], k[B, KV, S, D], v, mask, is_causal, scale) -> [B, H, T, D]",
    "01 prefill and decode (causal attention); 05 attention variants (grouped-query attention)",
    "minillm.attention.backend",
    "minillm/attention/backend.py",
    """The ``torch`` attention backend's arithmetic: causal scaled-dot-product attention with
    grouped K/V heads, the T queries being the last T of the S key positions. Every layer of
    the naive and contiguous engines, and the paged reference step, call it.""",
)
decoder_layer = _declare(
    "decoder_layer",
    "decoder_layer(layer, x[B, T, hidden], cos, signed_sin, step) -> [B, T, hidden]",
    "01 prefill and decode (the whole model)",
    "minillm.models.llama",
    "minillm/models/llama.py",
    """One transformer block: RMSNorm, attention (q/k/v, RoPE, the step's attention, o), the
    residual, RMSNorm, the SwiGLU MLP, the residual. The model's forward calls it once per layer
    with the cos/sin rows of the step's positions and the step's attention (which knows the cache).""",
)
filter_logits = _declare(
    "filter_logits",
    "filter_logits(logits[R, V] fp32, temperature, top_k, top_p) -> [R, V]",
    "01 prefill and decode (sampling)",
    "minillm.sampling",
    "minillm/sampling.py",
    """Temperature, top-k and top-p for R sampled rows that share these settings: the logits a
    row is drawn from, excluded tokens at -inf. Every sampled token of every engine (and the
    speculative target's and draft's distributions) comes through it.""",
)
sample = _declare(
    "sample",
    "sample(logits[R, V], params, generators, seen | None) -> list[int]",
    "01 prefill and decode (the sampler)",
    "minillm.sampling",
    "minillm/engine/llm_engine.py",
    """One token per row, each request by its own settings: the repetition penalty over the
    tokens it has seen, argmax for a greedy request, else a draw from its filtered distribution
    with its own generator (the exponential race, so that a seed gives the same tokens in any
    batch). Every token the engine samples outside speculative verification comes from it.""",
)
append_token = _declare(
    "append_token",
    "append_token(seq, token_id) -> 'stop' | 'length' | None",
    "01 prefill and decode (when a request ends)",
    "minillm.sequence",
    "minillm/sequence.py",
    """Every generated token of every request is appended here: the token id, its text (through
    the sequence's detokenizer), and the decision whether the request ends — a stop token or EOS
    (unless ignore_eos) without its text, a stop string with the text cut before it, or the
    length limit. The engine finishes the request with the reason it returns. (While the
    package's own runs, a request without stop strings appends only its ids on the step and
    its text is made when a delta is read: ``sequence.py``, "Text off the step".)""",
)
take_stream_text = _declare(
    "take_stream_text",
    "take_stream_text(seq) -> str",
    "01 prefill and decode (when a request ends)",
    "minillm.sequence",
    "minillm/sequence.py",
    """The text a stream may show after a step: all new text, less a tail that could still grow
    into a stop string while the request runs. Every streamed delta's text comes from it.""",
)
kv_write = _declare(
    "kv_write",
    "kv_write(k_cache[B, KV, L, D], v_cache, k_new[B, KV, T, D], v_new, start) -> None",
    "02 the KV cache",
    "minillm.kvcache.contiguous",
    "minillm/kvcache/contiguous.py",
    """Store new keys and values at positions ``start .. start+T-1`` of a contiguous cache, in
    place (the rows of a batch that write the same span: a prefill, an equal-length decode).""",
)
contiguous_cache = _declare(
    "contiguous_cache",
    "contiguous_cache(config, batch_size, max_len, dtype, device) -> cache (write, read, move_row)",
    "02 the KV cache (the batch's cache)",
    "minillm.kvcache.contiguous",
    "minillm/runtime/contiguous_runner.py",
    """The contiguous engine's cache for one static batch: one slab per layer, a row per
    sequence, made when the batch starts. Every step writes the new K/V at each row's positions
    (a slice when all rows start alike, else a scatter) and reads the rows' history back as views;
    when a sequence finishes, the last row moves into its place.""",
)
rope_tables = _declare(
    "rope_tables",
    "rope_tables(inv_freq[D/2], max_positions) -> (cos fp32 [P, D], sin fp32 [P, D])",
    "02 the KV cache (rotary positions)",
    "minillm.models.rope",
    "minillm/models/rope.py",
    """Every position's rotary angles ``p * inv_freq[i]``, cos and sin, dimension ``i`` paired
    with ``i + D/2``: built once when a model is loaded (outside the compiled step); every
    forward pass looks its tokens' rows up by absolute position.""",
)
apply_rope = _declare(
    "apply_rope",
    "apply_rope(x[B, T, heads, D], cos[B, T, 1, D], signed_sin[B, T, 1, D]) -> [B, T, heads, D]",
    "02 KV cache (the cached model)",
    "minillm.models.rope",
    "minillm/models/llama.py",
    """Rotate each head's (i, i + D/2) pairs of q and k by their positions' angles, before the
    keys are cached: every layer of every engine calls it once per step, on q and k together.
    The sin table has rotate_half's minus sign folded into its first half.""",
)
slot_mapping = _declare(
    "slot_mapping",
    "slot_mapping(block_table, start, num_tokens, block_size) -> list[int]",
    "03 paged KV cache",
    "minillm.kvcache.addressing",
    "minillm/runtime/fast_path.py",
    """The flat pool slots of a sequence's positions ``start ..``: where the paged runner writes
    every new token's K/V.""",
)
grow_table = _declare(
    "grow_table",
    "grow_table(table, num_computed, num_new, block_size, ref_count, take, release) -> [(src, dst)]",
    "03 paged KV cache (the block table)",
    "minillm.kvcache.block_manager",
    "minillm/kvcache/block_manager.py",
    """Make a sequence's block table, in place, hold its positions up to ``num_computed +
    num_new``: a shared block about to be written is first replaced by a private copy (the
    copies returned, for the runner to do before the step), then new blocks are appended. The
    block manager has checked that the pool has room; every block comes from ``take`` and every
    reference given up goes to ``release``.""",
)
gather_kv = _declare(
    "gather_kv",
    "gather_kv(pool, layer, block_tables[B, n], by_slot=False) -> (k, v) [B, KV, n*block_size, D]",
    "03 paged KV cache",
    "minillm.attention.paged",
    "minillm/attention/paged.py",
    """Copy the K/V of each row's blocks out of the pool, in block-table order: what the paged
    reference attention attends over.""",
)
block_hash = _declare(
    "block_hash",
    "block_hash(parent_hash | None, token_ids) -> int",
    "03 paged KV cache (prefix caching)",
    "minillm.kvcache.block_manager",
    "minillm/kvcache/block_manager.py",
    """The name of a full block, chained to its prefix: the prefix cache finds, registers and
    imports blocks by it.""",
)
block_pool = _declare(
    "block_pool",
    "block_pool(num_blocks) -> BlockPool (allocate, ref, release, register, lookup, forget)",
    "03 paged KV cache (the block allocator)",
    "minillm.kvcache.block_manager",
    "minillm/kvcache/block_manager.py",
    """The allocator every block manager is built on: the free list, the reference counts, the
    prefix cache's hash table and its LRU of unreferenced cached blocks. Every block of every
    sequence is taken, shared, named, found and given back through it.""",
)
tokens_to_run = _declare(
    "tokens_to_run",
    "tokens_to_run(scheduler, seq, budget, out: SchedulerOutput) -> int",
    "04 batching (chunked prefill)",
    "minillm.engine.scheduler",
    "minillm/engine/scheduler.py",
    """How many of a sequence's uncomputed tokens run this step, given what is left of the
    token budget (0: none).""",
)
choose_victim = _declare(
    "choose_victim",
    "choose_victim(scheduler, seq, candidates) -> Sequence",
    "04 batching (preemption)",
    "minillm.engine.scheduler",
    "minillm/engine/scheduler.py",
    """Who gives up its blocks when ``seq`` needs one and the pool is empty: a candidate, or
    ``seq`` itself.""",
)
schedule = _declare(
    "schedule",
    "schedule(scheduler, now) -> SchedulerOutput",
    "04 batching (continuous batching)",
    "minillm.engine.scheduler",
    "minillm/engine/scheduler.py",
    """One step's decisions: which running sequences run how many tokens, who is admitted. The
    policy is written with the scheduler's building blocks (tokens_to_run, reserve, try_admit).""",
)
reserve = _declare(
    "reserve",
    "reserve(scheduler, seq, n, out, drafts=()) -> bool",
    "04 batching (continuous batching)",
    "minillm.engine.scheduler",
    "minillm/engine/scheduler.py",
    """Schedule n tokens of a running sequence, preempting (choose_victim) until the pool has
    room; False when the sequence itself was preempted.""",
)
try_admit = _declare(
    "try_admit",
    "try_admit(scheduler, seq, budget, out) -> int",
    "04 batching (continuous batching)",
    "minillm.engine.scheduler",
    "minillm/engine/scheduler.py",
    """Start a waiting sequence if its first chunk fits the budget and the pool; the tokens
    scheduled (0: it keeps waiting, nothing changed).""",
)
step_layout = _declare(
    "step_layout",
    "step_layout(runner, chunks) -> StepLayout",
    "04 batching (the runner's inputs)",
    "minillm.runtime.paged_runner",
    "minillm/runtime/paged_runner.py",
    """The paged runner's inputs for one mixed step: every chunk's new tokens flat (the decodes
    first), their positions and pool slots, each sequence's query and context length, the block
    tables padded to one width, and which rows' logits the step returns, in the chunks' order.""",
)
paged_attention = _declare(
    "paged_attention",
    "paged_attention(step, layer, q[N, H, D], k[N, KV, D], v[N, KV, D], scale) -> [N, H, D]",
    "05 attention variants (the attention layer over the paged cache)",
    "minillm.attention.paged",
    "minillm/attention/paged.py",
    """The reference backend's attention for one layer of a mixed step: the step's new K/V
    written into the pool at their slots, then each sequence's queries against its keys read
    through its block table, grouped K/V heads, causal, and the sliding window when the model has
    one.""",
)
pool_heads = _declare(
    "pool_heads",
    "pool_heads(weight[H*D, in], num_heads, num_kv_heads) -> [KV*D, in]",
    "05 attention variants (pooling K/V heads)",
    "minillm.kv_head_pooling",
    "minillm/kv_head_pooling.py",
    """One K or V projection's H heads mean-pooled into KV shared ones, each the mean of a group
    of H/KV consecutive heads: how an MHA checkpoint becomes a GQA/MQA one (a bias is passed as
    an [H*D, 1] column).""",
)
blocks_behind_window = _declare(
    "blocks_behind_window",
    "blocks_behind_window(num_computed_tokens, window, block_size) -> int",
    "05 attention variants (sliding window)",
    "minillm.kvcache.block_manager",
    "minillm/kvcache/block_manager.py",
    """How many leading blocks no future query can see under a sliding window: the block
    manager gives them back after every step.""",
)
quantize_int8 = _declare(
    "quantize_int8",
    "quantize_int8(weight[out, in]) -> (q int8 [out, in], scale fp32 [out])",
    "07 quantization (per-channel int8 weights)",
    "minillm.quantization.int8",
    "minillm/quantization/int8.py",
    """Quantize one linear layer's weight when a model is loaded with quantization="int8" (called
    with the weight alone; a row-parallel shard, which needs its whole rows' maxima, is
    quantized by the reference directly).""",
)
quantize_int4 = _declare(
    "quantize_int4",
    "quantize_int4(weight[out, in], group_size) -> (q uint8 [out, in], scale fp32 [out, groups], minimum)",
    "07 quantization (group-wise int4 weights)",
    "minillm.quantization.int4",
    "minillm/quantization/int4.py",
    """Quantize one linear layer's weight when a model is loaded with quantization="int4": each
    row cut into groups of ``group_size`` consecutive input weights, each group mapped from its
    [min, max] onto 0..15 (a row-parallel shard is cut on group boundaries, so it is quantized
    by the same call).""",
)
pack_int4 = _declare(
    "pack_int4",
    "pack_int4(q uint8 [out, in]) -> uint8 [out, in/2]",
    "07 quantization (int4 storage)",
    "minillm.quantization.int4",
    "minillm/quantization/checkpoint.py",
    """Two 4-bit values per byte, low nibble first: how a quantized checkpoint stores int4 weights.""",
)
unpack_int4 = _declare(
    "unpack_int4",
    "unpack_int4(packed uint8 [out, in/2]) -> uint8 [out, in]",
    "07 quantization (int4 storage)",
    "minillm.quantization.int4",
    "minillm/quantization/checkpoint.py",
    """The inverse of pack_int4: how a quantized checkpoint's int4 weights are read back.""",
)
quantize_kv = _declare(
    "quantize_kv",
    "quantize_kv(x[tokens, kv_heads, head_dim], kind) -> (q, scale fp32 [tokens, kv_heads])",
    "07 quantization (the KV cache's quantize-on-write)",
    "minillm.kvcache.quantization",
    "minillm/attention/paged.py",
    """Quantize new K or V rows as the paged reference path writes them into an int8/fp8 pool.""",
)
accept_greedy = _declare(
    "accept_greedy",
    "accept_greedy(target_tokens[k+1], draft_tokens[k]) -> list[int]",
    "08 speculative decoding",
    "minillm.speculative.acceptance",
    "minillm/speculative/speculator.py",
    """The tokens a greedy verify pass emits: the proposals the target agrees with, then its own token.""",
)
accept_sampled = _declare(
    "accept_sampled",
    "accept_sampled(target_probs[k+1, V], draft_probs[k, V] | None, draft_tokens, generator) -> list[int]",
    "08 speculative decoding",
    "minillm.speculative.acceptance",
    "minillm/speculative/speculator.py",
    """Rejection sampling: the tokens a sampled verify pass emits, distributed exactly as the target's.""",
)
blocks_to_roll_back = _declare(
    "blocks_to_roll_back",
    "blocks_to_roll_back(table, num_tokens, block_size) -> (kept, freed)",
    "08 speculative decoding (rollback)",
    "minillm.kvcache.block_manager",
    "minillm/kvcache/block_manager.py",
    """Split a block table when rejected proposals are rolled back: the blocks kept, and those
    given back (tail first).""",
)
tree_attention_mask = _declare(
    "tree_attention_mask",
    "tree_attention_mask(parents[N]) -> bool [N, N]",
    "08 speculative decoding (tree drafting)",
    "minillm.speculative.tree",
    "minillm/speculative/tree.py",
    """Which nodes of a draft tree each node may attend to in the one verify pass: itself and its
    ancestors, never another branch.""",
)
accept_tree = _declare(
    "accept_tree",
    "accept_tree(parents[N], drafts[N], target_tokens[N+1]) -> (path: list[int], emitted: list[int])",
    "08 speculative decoding (verifying a tree)",
    "minillm.speculative.tree",
    "minillm/speculative/tree.py",
    """A tree verify pass's verdict: the nodes accepted, root to leaf (the longest branch whose
    every token is the target's choice after its parent), and the tokens it emits — theirs, then
    the target's own token after the last of them.""",
)
verify = _declare(
    "verify",
    "verify(speculator, seq, draft_tokens, logits[k+1, V]) -> list[int]",
    "08 speculative decoding (the acceptance timeline, minillm.viz.spec)",
    "minillm.speculative.speculator",
    "minillm/speculative/speculator.py",
    """One verify chunk's verdict: the tokens it emits, by the acceptance rule the request's
    sampling calls for. A recorder wrapped around it sees every proposal and its fate.""",
)
heads_of_rank = _declare(
    "heads_of_rank",
    "heads_of_rank(num_heads, num_kv_heads, rank, tp_size) -> (q_heads: range, kv_heads: range)",
    "09 parallelism (the K/V-head split)",
    "minillm.layers.tensor_parallel",
    "minillm/models/llama.py",
    """Which query and K/V heads a tensor-parallel rank holds: each attention layer's shard is
    built with it.""",
)
detokenize_step = _declare(
    "detokenize_step",
    "detokenize_step(decode, ids, prefix_offset, read_offset) -> (delta: str, prefix_offset, read_offset)",
    "10 serving (streaming text)",
    "minillm.tokenizer",
    "minillm/tokenizer.py",
    """The text a new token makes visible: every generated token of every request passes through
    it (``IncrementalDetokenizer.add``), and what it returns is the text a stream sends. It
    holds back an incomplete UTF-8 character and keeps a token's leading space. For a request
    without stop strings it runs when the delta's text is read (off the step), and the one in
    force when the token came is the one that runs.""",
)
propose_ngram = _declare(
    "propose_ngram",
    "propose_ngram(tokens, k, max_n, min_n) -> list[int]",
    "08 speculative decoding (prompt lookup)",
    "minillm.speculative.ngram",
    "minillm/speculative/speculator.py",
    """The n-gram proposer (speculative_config={"method": "ngram"}): up to k tokens that followed
    the most recent earlier occurrence of the sequence's last n tokens, the longest n from max_n
    down to min_n first. Every proposal the engine verifies under prompt lookup comes from it. With
    prompt_lookup_scaled (the default) the engine calls it only on steps where something matches,
    with k = min(k, 2^(n-1)) for an n-token match (ngram.reach).""",
)
response_cache = _declare(
    "response_cache",
    "response_cache(capacity) -> cache (key, get, put, hits, misses, nbytes, len)",
    "10 serving (the response cache)",
    "minillm.server.response_cache",
    "minillm/server/launch.py",
    """The server's exact-match cache of whole greedy responses (``minillm serve --response-cache
    N``): a bounded LRU — at most N entries and a byte budget — that hands out copies, so a hit's
    id and timestamp can be set without touching the kept answer.""",
)
stream_events = _declare(
    "stream_events",
    "stream_events(streams, fmt, n, include_usage, prompt_tokens, abort) -> async iterator of bytes",
    "10 serving (the streaming endpoint)",
    "minillm.server.streaming",
    "minillm/server/app.py",
    """A streamed request's response body: its prompts' delta streams read concurrently and
    turned into server-sent events in the order the deltas arrive (a chat's role chunk first,
    one chunk per delta, the usage chunk, ``[DONE]``; an error event instead when a stream
    fails), and on the way out an abort for every prompt that had not finished.""",
)
