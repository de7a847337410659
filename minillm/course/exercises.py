"""The course's exercises in one table: chapter, check, size, difficulty, points and hints.

Everything that needs to know the exercises reads this table — the grader (which checks a
chapter expects, and the exact check cell to restore), the notebook build (nbgrader metadata:
points and grade ids) and ``hint()`` in the notebooks — so adding an exercise is one entry here,
one solved function and one check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Exercise:
    chapter: str  # the notebook's stem, e.g. "01_prefill_and_decode"
    check: str  # the check function's name in minillm.course
    call: str  # the check cell exactly as the course ships it
    lines: int  # roughly how many lines a solution takes
    difficulty: int  # 1 = warm-up, 2 = core, 3 = stretch
    points: int
    hints: tuple[str, str]  # a nudge, then nearly the answer

    @property
    def functions(self) -> list[str]:
        """The names the check cell passes: the functions the learner writes."""
        return [name.strip() for name in self.call[self.call.index("(") + 1 : -1].split(",")]

    @property
    def references(self) -> tuple[str, ...]:
        """The package's own implementations of this exercise (dotted paths where they are
        defined): a learner's code that calls one is reported, not graded (``isolated.py``)."""
        return REFERENCES.get(self.check, ())

    @property
    def stars(self) -> str:
        return "★" * self.difficulty + "☆" * (3 - self.difficulty)


EXERCISES: list[Exercise] = [
    Exercise(
        "01_prefill_and_decode",
        "check_generate_naive",
        "check_generate_naive(generate_naive)",
        6,
        1,
        2,
        (
            "Keep one growing list: prompt + generated. Each step runs the model on all of it and takes the most "
            "likely token after the *last* position.",
            "`ids = list(prompt_ids)`; loop `max_new_tokens` times: `logits = forward_logits(model, ids)`, "
            "`ids.append(int(logits[-1].argmax()))`; return `ids[len(prompt_ids):]` (only the new tokens).",
        ),
    ),
    Exercise(
        "01_prefill_and_decode",
        "check_stopping",
        "check_stopping(append_token, take_stream_text)",
        20,
        2,
        3,
        (
            "append_token: append the id first. A stop id (params.stop_token_ids, or seq.eos_token_ids unless "
            "params.ignore_eos) ends with 'stop' and adds only seq.detokenizer.flush(). Otherwise add "
            "seq.detokenizer.add(token_id), look for the stop strings from just before the new text (earliest match "
            "wins, cut before it), then the length (seq.max_output). take_stream_text: while running with stop "
            "strings hold back len(longest) - 1 characters; never move seq.num_emitted_chars back.",
            "`seq.output_token_ids.append(token_id)`; `if token_id in p.stop_token_ids or (not p.ignore_eos and "
            "token_id in seq.eos_token_ids)`: `seq.text += seq.detokenizer.flush()`, `return 'stop'`; `before = "
            "len(seq.text)`; `seq.text += seq.detokenizer.add(token_id)`; `if p.stop`: `start = max(0, before - "
            "max(map(len, p.stop)) + 1)`, `hits = [i for s in p.stop if (i := seq.text.find(s, start)) != -1]`, "
            "`if hits: seq.text = seq.text[:min(hits)]; return 'stop'`; `if len(seq.output_token_ids) >= "
            "seq.max_output`: flush, `return 'length'`; `return None`. take_stream_text: `hold = max(map(len, "
            "p.stop)) - 1 if p.stop and not seq.is_finished else 0`; `end = max(seq.num_emitted_chars, len(seq.text) - "
            "hold)`; `delta = seq.text[seq.num_emitted_chars:end]`; `seq.num_emitted_chars = end`; `return delta`.",
        ),
    ),
    Exercise(
        "01_prefill_and_decode",
        "check_filter_logits",
        "check_filter_logits(filter_logits)",
        10,
        2,
        2,
        (
            "Work along the last dim, each row on its own. Subtract the row max, divide by the temperature; top-k "
            "keeps logits >= the k-th largest (ties too); top-p sorts the probabilities and keeps a token while the "
            "mass ranked above it is below top_p (the top one always), then maps that mask back to the vocabulary.",
            "`x = (logits - logits.max(-1, keepdim=True).values) / temperature`; `if 0 < top_k < x.shape[-1]`: "
            "`x = x.masked_fill(x < x.topk(top_k, dim=-1).values[..., -1:], -inf)`; `if top_p < 1`: "
            "`probs, order = x.softmax(-1).sort(-1, descending=True)`, `drop = probs.cumsum(-1) - probs >= top_p`, "
            "`drop[..., 0] = False`, `x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), -inf)`.",
        ),
    ),
    Exercise(
        "01_prefill_and_decode",
        "check_sample",
        "check_sample(sample)",
        14,
        2,
        3,
        (
            "Work on a float copy of the logits. For each row with a repetition penalty, the tokens it has seen "
            "(each once): positive logits / penalty, negative * penalty. Greedy rows: argmax. Sampled rows: "
            "filtered_logits(row, [params]).softmax(-1), then the exponential race with the row's own generator.",
            "`logits = logits.float().clone()`; for each row i with `seen is not None and p.repetition_penalty != 1`: "
            "`ids = torch.tensor(sorted(set(seen[i])))`, `v = logits[i, ids]`, `logits[i, ids] = torch.where(v > 0, "
            "v / p.repetition_penalty, v * p.repetition_penalty)`; `tokens = logits.argmax(-1).tolist()`; for each "
            "row with `not p.greedy`: `probs = filtered_logits(logits[i:i+1], [p])[0].softmax(-1)`, `noise = "
            "torch.empty_like(probs).exponential_(generator=generators[i])`, `tokens[i] = int((probs / "
            "noise).argmax())`; `return tokens`.",
        ),
    ),
    Exercise(
        "01_prefill_and_decode",
        "check_causal_attention",
        "check_causal_attention(causal_attention)",
        5,
        2,
        2,
        (
            "Scores q·kᵀ / √d, hide the future (j > i) with -inf, softmax over the keys, multiply by v.",
            "`s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])`; "
            "`mask = torch.ones(T, T, dtype=torch.bool).tril()`; "
            "`return torch.softmax(s.masked_fill(~mask, float('-inf')), dim=-1) @ v`.",
        ),
    ),
    Exercise(
        "01_prefill_and_decode",
        "check_transformer",
        "check_transformer(rms_norm, decoder_layer, transformer_forward)",
        24,
        3,
        4,
        (
            "Three pieces. rms_norm: divide x by sqrt(mean(x²) + eps) over the last dim, times weight. decoder_layer "
            "(pre-norm, two residual halves): h = norm(x); q, k, v = h @ W.T for each, cut into heads [heads, T, "
            "head_dim]; rotate q and k; repeat each K/V head for its group of query heads; your causal attention; "
            "merge the heads; x + o_proj; then h = norm(x) and x + down(silu(gate(h)) * up(h)). "
            "transformer_forward: embedding rows → every layer → final norm → LM head.",
            "`h = rms_norm(x, w.input_layernorm, eps)`; `q = (h @ w.q_proj.T).view(T, H, D).transpose(0, 1)` (k, v "
            "with KV heads); `q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)`; "
            "`k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)`; "
            "`a = causal_attention(q[None], k[None], v[None])[0]`; `x = x + a.transpose(0, 1).reshape(T, H * D) @ "
            "w.o_proj.T`; `h = rms_norm(x, w.post_attention_layernorm, eps)`; `return x + (F.silu(h @ w.gate_proj.T) "
            "* (h @ w.up_proj.T)) @ w.down_proj.T`. Forward: `w = model_weights(model)`, `x = w.embed_tokens["
            "torch.tensor(ids)]`, `cos, sin = rope_cos_sin(model, len(ids))`, loop the layers, `return rms_norm(x, "
            "w.norm, eps) @ w.lm_head.T`.",
        ),
    ),
    Exercise(
        "02_kv_cache",
        "check_kv_write",
        "check_kv_write(kv_write)",
        2,
        1,
        1,
        (
            "The caches are [B, H, S_max, D]; the new K/V are [B, H, T, D] and go to positions start..start+T-1.",
            "Write in place along dim 2: `k_cache[:, :, start:start + T] = k_new` (and the same for v).",
        ),
    ),
    Exercise(
        "02_kv_cache",
        "check_contiguous_cache",
        "check_contiguous_cache(ContiguousKVCache)",
        16,
        2,
        3,
        (
            "One slab per K and V of shape [layers, batch, kv_heads, max_len, head_dim], zeros. write: with "
            "same_start the rows' tokens are a slice (your kv_write on the layer's rows 0..B-1); without it, scatter "
            "each row's tokens to its own positions. read: slices (views) of rows 0..batch-1 and positions "
            "0..length-1. move_row: copy positions 0..length-1 of row src into row dst in every layer.",
            "`self.k = torch.zeros(layers, batch, kv_heads, max_len, head_dim, dtype=dtype, device=device)` (and v); "
            "write: `B = positions.shape[0]`; if same_start is not None: `kv_write(self.k[layer, :B], self.v[layer, "
            ":B], k, v, same_start)`; else `rows = torch.arange(B)[:, None]`, `self.k[layer][rows, :, positions] = "
            "k.transpose(1, 2)` (and v); read: `return self.k[layer, :batch, :, :length], self.v[layer, :batch, :, "
            ":length]`; move_row: `self.k[:, dst, :, :length] = self.k[:, src, :, :length]` (and v).",
        ),
    ),
    Exercise(
        "02_kv_cache",
        "check_rope_tables",
        "check_rope_tables(rope_tables)",
        4,
        2,
        2,
        (
            "Row p holds position p's D/2 angles p·inv_freq[i] (float32); each angle turns the pair of "
            "dimensions (i, i + D/2), so it appears twice along the row. Return their cos and their sin.",
            "`angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)`; "
            "`angles = torch.cat([angles, angles], dim=-1)`; `return angles.cos(), angles.sin()`.",
        ),
    ),
    Exercise(
        "02_kv_cache",
        "check_generate_cached",
        "check_generate_cached(generate_cached)",
        8,
        2,
        2,
        (
            "One prefill over the whole prompt gives the first token; then each step feeds only the newest "
            "token at its own position.",
            "`cache = new_cache(model, len(prompt_ids) + max_new_tokens)`; "
            "`tok = int(forward_step(model, prompt_ids, 0, cache)[-1].argmax())`; then for each further token: "
            "`tok = int(forward_step(model, [tok], len(prompt_ids) + i, cache)[-1].argmax())` with i = 0, 1, ...",
        ),
    ),
    Exercise(
        "02_kv_cache",
        "check_cached_model",
        "check_cached_model(apply_rope, KVCache, cached_forward)",
        33,
        3,
        4,
        (
            "apply_rope: x·cos + rotate_half(x)·sin, rotate_half([x1, x2]) = [-x2, x1] over the two halves of the last "
            "dim. KVCache: one [kv_heads, max_len, head_dim] buffer per layer for K and one for V, made once; append "
            "writes positions start..start+T-1 and returns the slices 0..start+T-1. cached_forward: chapter 01's "
            "layer, with the RoPE rows of positions start..start+T-1, K/V through the cache, and a mask that lets "
            "query i see keys 0..start+i.",
            "`half = x.shape[-1] // 2`; `return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin`. "
            "`self.k = [torch.zeros(num_kv_heads, max_len, head_dim, dtype=dtype) for _ in range(num_layers)]` (and "
            "v); append: `self.k[layer][:, start:start + T] = k`, `return self.k[layer][:, :start + T], ...`. In "
            "cached_forward: `cos, sin = (t[start:] for t in rope_cos_sin(model, start + T))`; `visible = "
            "torch.arange(start + T)[None] <= torch.arange(start, start + T)[:, None]`; per layer `k, v = "
            "cache.append(i, start, k, v)` after rotating k, then repeat_interleave the K/V heads and "
            "`softmax((q @ k.mT / sqrt(D)).masked_fill(~visible, -inf)) @ v`.",
        ),
    ),
    Exercise(
        "03_paged_kv_cache",
        "check_block_table",
        "check_block_table(grow_table, slot_mapping)",
        12,
        2,
        2,
        (
            "grow_table: the first new token goes to block num_computed // block_size; if that block is already in "
            "the table and shared (ref_count > 1), swap in a private copy first. Then append blocks until the table "
            "covers num_computed + num_new positions. slot_mapping: position p lives in block p // block_size, at "
            "offset p % block_size.",
            "grow_table: `first = num_computed // block_size`; `if first < len(table) and ref_count(table[first]) > 1:` "
            "`private = take()`, `copies.append((table[first], private))`, `release(table[first])`, "
            "`table[first] = private`; then `while len(table) * block_size < num_computed + num_new: "
            "table.append(take())`; `return copies`. slot_mapping: `[block_table[p // block_size] * block_size + "
            "p % block_size for p in range(start, start + num_tokens)]`.",
        ),
    ),
    Exercise(
        "03_paged_kv_cache",
        "check_gather_kv",
        "check_gather_kv(gather_kv)",
        3,
        2,
        2,
        (
            "View the flat slots as [num_blocks, block_size, KV, D]; a block table row lists which blocks, in order.",
            "`blocks = slots.view(-1, block_size, *slots.shape[1:])`; `out = blocks[block_tables]` is [B, n, block_size, KV, D]; `.reshape(B, n * block_size, KV, D).transpose(1, 2)`.",
        ),
    ),
    Exercise(
        "03_paged_kv_cache",
        "check_block_hash",
        "check_block_hash(block_hash)",
        4,
        2,
        1,
        (
            "Python's `hash()` of a str or None changes between processes; use a real hash function over "
            "bytes, and chain the parent's hash in.",
            "`h = hashlib.sha256(); h.update((parent_hash or 0).to_bytes(8, 'little')); "
            "h.update(struct.pack(f'<{len(ids)}q', *ids))`; return `int.from_bytes(h.digest()[:8], 'little')`.",
        ),
    ),
    Exercise(
        "03_paged_kv_cache",
        "check_block_pool",
        "check_block_pool(BlockPool)",
        45,
        3,
        3,
        (
            "Keep blocks (Block objects), free_ids (a deque), cached (hash -> id) and evictable (an OrderedDict, "
            "oldest first). allocate: the free list first, else evict the oldest evictable block (forgetting its "
            "name), ref_count 1, RuntimeError when neither. ref: +1, out of evictable if it was unreferenced. "
            "release: -1 (RuntimeError at 0); at 0 a named block goes to evictable, any other to the free list. "
            "register: name an unnamed block unless the hash is taken. lookup: the named block only if its stored "
            "parent and tokens match. forget: drop the name; unreferenced, the block becomes free.",
            "allocate: `if self.free_ids: b = self.free_ids.popleft()` / `elif self.evictable: b, _ = "
            "self.evictable.popitem(last=False)`, `del self.cached[blk.hash]`, `blk.hash, blk.parent_hash, "
            "blk.token_ids = None, None, ()` / `else: raise RuntimeError(...)`; `self.blocks[b].ref_count = 1`. "
            "release: `if blk.ref_count <= 0: raise RuntimeError`; `blk.ref_count -= 1`; at 0 `self.evictable[b] = "
            "None` if `blk.hash is not None` else `self.free_ids.append(b)`. lookup: `b = self.cached.get(h)`; None "
            "unless `blk.parent_hash == parent and blk.token_ids == tuple(token_ids)`.",
        ),
    ),
    Exercise(
        "04_batching",
        "check_chunk_tokens",
        "check_chunk_tokens(chunk_tokens)",
        5,
        1,
        1,
        (
            "With chunked prefill a sequence takes min(what it needs, what is left of the budget). Without it, a prompt runs whole or waits — except that one larger than the whole budget must be allowed to run alone.",
            "`if chunked_prefill: return min(remaining, budget)`; `return remaining if remaining <= budget or step_is_empty else 0`.",
        ),
    ),
    Exercise(
        "04_batching",
        "check_choose_victim",
        "check_choose_victim(choose_victim)",
        3,
        2,
        2,
        (
            "Every sequence has a `sort_key` (priority, arrival, ...): smaller runs first. Preempt the one that ranks last — unless seq itself ranks below all of them.",
            "`victim = max(candidates, key=lambda s: s.sort_key, default=seq)`; `return seq if victim.sort_key < seq.sort_key else victim`.",
        ),
    ),
    Exercise(
        "04_batching",
        "check_reserve_admit",
        "check_reserve_admit(reserve, try_admit)",
        25,
        3,
        3,
        (
            "reserve: loop until `scheduler.block_manager.allocate_slots(seq, n + len(drafts))` is not None; each "
            "time it is None, preempt `scheduler.choose_victim(seq, candidates)` — the running sequences that are "
            "neither seq nor in out.chunks — and return False if the victim was seq. Then append the chunk and the "
            "copies. try_admit: match the prefix first, ask tokens_to_run, allocate; on failure undo everything.",
            "reserve: `copies = bm.allocate_slots(seq, n + len(drafts))`; while None: `scheduled = [c.seq for c in "
            "out.chunks]`, `victim = scheduler.choose_victim(seq, [s for s in scheduler.running if s is not seq and "
            "s not in scheduled])`, `scheduler.preempt(victim, out)`, `if victim is seq: return False`; then "
            "`out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, n + len(drafts), list(drafts)))`, "
            "`out.copies.extend(copies)`, `return True`. try_admit: `bm.match_prefix(seq)`; `n = "
            "scheduler.tokens_to_run(seq, budget, out)`; `copies = bm.allocate_slots(seq, n) if n else None`; if "
            "None: `bm.cancel_prefix(seq)`, `return 0`; else `scheduler.waiting.remove(seq)`, "
            "`scheduler.start(seq, out)`, append `ScheduledChunk(seq, seq.num_computed_tokens, n)`, extend the "
            "copies, `return n`.",
        ),
    ),
    Exercise(
        "04_batching",
        "check_continuous_schedule",
        "check_continuous_schedule(schedule_continuous)",
        16,
        2,
        2,
        (
            "Running sequences first (skip any preempted earlier this step), each as many tokens as the budget "
            "allows; then admit waiting ones in order — but not in a step that preempted.",
            "Loop `scheduler.running_in_order()`: `n = scheduler.tokens_to_run(seq, budget, out)`, "
            "`if n and scheduler.reserve(seq, n, out): budget -= n`. Then, if `not out.preempted`, loop "
            "`waiting_in_order()` while seats and budget remain; `n = scheduler.try_admit(...)`; stop at the "
            "first 0 (first come, first served).",
        ),
    ),
    Exercise(
        "04_batching",
        "check_prepare_inputs",
        "check_prepare_inputs(prepare_inputs)",
        22,
        2,
        3,
        (
            "Put the one-token chunks (decodes) first, then the rest. Walk them in that order: every token adds its id, "
            "its position (start + i) and its slot (the id of the block holding that position × block_size + the "
            "offset); every chunk adds its query length n and context length start + n. Pad each block table with "
            "null_block to the blocks the longest context needs. Logit rows: each chunk's last num_logits flat rows, "
            "listed in the order of `chunks`.",
            "`order = [c for c in chunks if len(c.token_ids) == 1] + [c for c in chunks if len(c.token_ids) > 1]`; "
            "slot `c.block_table[p // block_size] * block_size + p % block_size`; `width = max(-(-n // block_size) for "
            "n in context_lens)`; table `(c.block_table + [null_block] * width)[:width]`; keep each chunk's end row "
            "`ends[id(c)]` and `logit_rows = [ends[id(c)] - k for c in chunks for k in range(c.num_logits, 0, -1)]`.",
        ),
    ),
    Exercise(
        "05_attention_variants",
        "check_gqa_attention",
        "check_gqa_attention(gqa_attention)",
        8,
        3,
        3,
        (
            "Query head h uses K/V head h // G. Fold the G query heads of a group into the query axis "
            "instead of copying K/V G times.",
            "`scores = q.reshape(B, KV, G*T, D) @ k.transpose(-1, -2)` (fp32, × scale); the mask [B, 1, T, S] "
            "lines up after `scores.view(B, KV, G, T, S)` with `mask.unsqueeze(2)`; softmax, `@ v`, "
            "`.reshape(B, H, T, D)`.",
        ),
    ),
    Exercise(
        "05_attention_variants",
        "check_head_pooling",
        "check_head_pooling(pool_heads)",
        4,
        2,
        2,
        (
            "The rows are H heads of D rows each, in head order; pooled head j averages the G = H / KV "
            "consecutive heads j·G .. j·G+G-1 (query head h uses K/V head h // G).",
            "`D, G = rows // num_heads, num_heads // num_kv_heads`; "
            "`weight.float().view(num_kv_heads, G, D, cols).mean(dim=1)`, then `.reshape(num_kv_heads * D, cols)` "
            "and `.to(weight.dtype)`.",
        ),
    ),
    Exercise(
        "05_attention_variants",
        "check_window_release",
        "check_window_release(blocks_behind_window)",
        1,
        2,
        2,
        (
            "The next query sits at position num_computed_tokens and sees the last `window` positions, itself included. A block may go only when all of its positions are before that.",
            "The first visible position is `num_computed_tokens - window + 1`; whole blocks before it: `max(0, num_computed_tokens - window + 1) // block_size`.",
        ),
    ),
    Exercise(
        "05_attention_variants",
        "check_paged_attention",
        "check_paged_attention(paged_attention)",
        21,
        3,
        3,
        (
            "First refuse heads that cannot be grouped (H % KV) with a ValueError. Walk the sequences; row by row "
            "of q, n = query_lens[i] of them. Their keys run from first = 0 (with a window: the first query's "
            "window edge, ctx - n - window + 1, at least 0; the blocks before it were released) to ctx - 1. "
            "Write their new k and v rows into the pool at the slots of positions ctx-n..ctx-1 (the queries read "
            "their own keys from it too), then read positions first..ctx-1 through the sequence's block table, "
            "repeat_interleave the K/V heads up to H, score q·kᵀ·scale, and mask: the queries sit at ctx-n..ctx-1, "
            "each sees keys up to itself (and with a window w, only its last w). Softmax, times v; concatenate "
            "the sequences.",
            "`if H % KV: raise ValueError(...)`; `first = 0 if window is None else max(0, ctx - n - window + 1)`; "
            "`slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(first, "
            "ctx)])`; `k_slots[slots[-n:]] = k[row:row + n]` (and v); "
            "`keys = k_slots[slots].repeat_interleave(H // KV, dim=1)`, `values` likewise from v_slots; `scores = "
            "torch.einsum('thd,shd->hts', q[row:row + n], keys) * scale`; `pos = torch.arange(ctx - n, ctx)[:, None]`, "
            "`key_pos = torch.arange(first, ctx)[None, :]`, `allowed = key_pos <= pos` (`& (key_pos > pos - window)`); "
            "`torch.einsum('hts,shd->thd', "
            "scores.masked_fill(~allowed, -inf).softmax(-1), values)`.",
        ),
    ),
    Exercise(
        "06_flash_attention",
        "check_online_softmax",
        "check_online_softmax(online_softmax_update)",
        6,
        2,
        2,
        (
            "A new tile may raise the running max; everything accumulated so far was scaled by the old max.",
            "`m_new = max(m, scores.max(-1))`; `alpha = exp(m - m_new)`; `p = exp(scores - m_new[:, None])`; "
            "`l = l * alpha + p.sum(-1)`; `acc = acc * alpha[:, None] + p @ v`.",
        ),
    ),
    Exercise(
        "06_flash_attention",
        "check_flash_kernel",
        "check_flash_kernel(flash_forward)",
        36,
        3,
        3,
        (
            "One program owns query tile program_id(0) of head program_id(1): load its queries once, keep m/l/acc "
            "per query row, loop over key tiles doing the online softmax of the previous exercise, and store "
            "acc / l at the end. Causal masking compares key positions with each query's position (queries are "
            "the *last* T of S). The launcher's grid is (cdiv(T, block), H).",
            "`offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)`; `q = tl.load(Q + offs_m[:, None] * stride_qt + head "
            "* stride_qh + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0).to(tl.float32)`; `m_i = tl.full("
            "[BLOCK_M], float('-inf'), tl.float32)`, `l_i`/`acc` zeros. Per tile: `s = tl.dot(q, tl.trans(k)) * "
            "scale`; mask `offs_n < S` and, if causal, `offs_n[None, :] <= (S - T + offs_m)[:, None]` with -inf; "
            "the m/l/acc update with `tl.exp`, `tl.max`, `tl.sum`; after the loop `tl.store(..., acc / l_i[:, "
            "None], mask=offs_m[:, None] < T)`. Launch `flash_kernel[(triton.cdiv(t, block), heads)](q, k, v, out, "
            "t, s, q.stride(0), q.stride(1), k.stride(0), k.stride(1), dim**-0.5, BLOCK_M=block, ...)`.",
        ),
    ),
    Exercise(
        "07_quantization",
        "check_quantize_per_channel",
        "check_quantize_per_channel(quantize_per_channel)",
        4,
        1,
        2,
        (
            "One scale per output row: the row's largest *magnitude* maps to 127. Divide, round to the nearest "
            "integer, keep it inside [-127, 127], store as int8.",
            "`scale = weight.float().abs().amax(dim=1) / 127`; "
            "`q = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)`; `return q, scale`.",
        ),
    ),
    Exercise(
        "07_quantization",
        "check_quantize_int4",
        "check_quantize_int4(quantize_int4_groups)",
        7,
        2,
        2,
        (
            "View the row-major weight as [out, in // group_size, group_size]: the last axis is one group of "
            "consecutive input weights. Its min maps to level 0, its max to 15; a constant group has max = min. "
            "First refuse a group_size that does not divide the inputs (ValueError naming both).",
            "`if weight.shape[1] % group_size: raise ValueError(f'group_size={group_size} does not divide "
            "{weight.shape[1]} inputs')`; `w = weight.float().reshape(weight.shape[0], -1, group_size)`; `minimum = w.amin(-1)`; "
            "`scale = ((w.amax(-1) - minimum) / 15).clamp(min=1e-12)`; `q = torch.round((w - minimum[..., None]) / "
            "scale[..., None]).clamp(0, 15).to(torch.uint8)`; `return q.reshape(weight.shape), scale, minimum`.",
        ),
    ),
    Exercise(
        "07_quantization",
        "check_pack_int4",
        "check_pack_int4(pack_int4, unpack_int4)",
        4,
        2,
        2,
        (
            "Columns 2j and 2j+1 of a row share byte j: the even one in the low 4 bits, the odd one shifted "
            "into the high 4. Unpacking masks and shifts, then interleaves the two halves again.",
            "Pack: `(q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)`. Unpack: `low = packed & 0xF`, "
            "`high = packed >> 4`, `torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)`.",
        ),
    ),
    Exercise(
        "07_quantization",
        "check_int4_linear",
        "check_int4_linear(Int4Linear)",
        25,
        3,
        3,
        (
            "__init__: first refuse what cannot be stored (group_size below 1, in_features not a multiple of it, or "
            "odd) with ValueError; reshape the weight to [out, groups, group_size], take each group's min and (max - min) / 15, "
            "round to levels 0..15, pack the even columns in the low nibble and the odd ones in the high; keep only "
            "the packed bytes, the scales and the minima, and a copy of the bias if there is one. __call__: refuse x "
            "whose last dimension is not in_features (ValueError), unpack "
            "(& 0x0F, >> 4, interleaved back), q * scale + minimum per group, then x @ Ŵᵀ (+ bias) in x's dtype.",
            "`self.minimum = w.amin(-1)`; `self.scale = ((w.amax(-1) - self.minimum) / 15).clamp(min=1e-12)`; "
            "`q = torch.round((w - self.minimum[..., None]) / self.scale[..., None]).clamp(0, 15).to(torch.uint8)"
            ".reshape(out, cols)`; `self.packed = q[:, 0::2] | (q[:, 1::2] << 4)`. Call: `q = torch.stack([p & 0x0F, "
            "p >> 4], dim=-1).reshape(out, -1)`; `w = q.float().reshape(out, -1, g) * self.scale[..., None] + "
            "self.minimum[..., None]`; `y = x @ w.reshape(out, cols).to(x.dtype).T`, plus `self.bias.to(x.dtype)` "
            "when there is one. Refuse with `if group_size < 1 or cols % group_size or cols % 2: raise ValueError(...)` "
            "and, in the call, `if x.shape[-1] != cols: raise ValueError(...)` (cols = 2 bytes per packed byte); tensors() "
            "adds `[self.bias]` when there is one.",
        ),
    ),
    Exercise(
        "07_quantization",
        "check_quantize_kv",
        "check_quantize_kv(quantize_kv_on_write)",
        4,
        2,
        2,
        (
            "x is [tokens, kv_heads, head_dim]: each (token, head) vector gets its own scale, from that vector "
            "alone, so reduce over the last dim only. Work in float32 whatever x's dtype.",
            "`scale = x.float().abs().amax(dim=-1) / 127`; "
            "`q = torch.round(x.float() / scale[..., None]).clamp(-127, 127).to(torch.int8)`; `return q, scale` "
            "(scale stays float32).",
        ),
    ),
    Exercise(
        "08_speculative_decoding",
        "check_accept_greedy",
        "check_accept_greedy(accept_greedy)",
        6,
        1,
        2,
        (
            "Walk the proposals with their index i: draft i is right when it equals target_tokens[i]. At the first "
            "one that is not, the target's own token replaces it and the step ends; if none fails, the last row "
            "(target_tokens[k]) gives a bonus token.",
            "`out = []`; `for i, d in enumerate(draft_tokens):` `if d != target_tokens[i]: return out + "
            "[target_tokens[i]]`, else `out.append(d)`; after the loop `return out + [target_tokens[len(draft_tokens)]]`.",
        ),
    ),
    Exercise(
        "08_speculative_decoding",
        "check_accept_sampled",
        "check_accept_sampled(accept_sampled)",
        14,
        3,
        3,
        (
            "For each proposal d at position i: p = target_probs[i], q = draft_probs[i] (or one-hot at d when "
            "draft_probs is None). Keep d with probability min(1, p[d] / q[d]); otherwise draw the replacement from "
            "normalize(max(0, p − q)) and stop. All kept: one more token from target_probs[k]. Every random number "
            "comes from `generator`.",
            "`u = torch.rand((), generator=generator)`; `if u * q[d] < p[d]: out.append(d); continue`; "
            "`r = (p - q).clamp(min=0)`; `return out + [int(torch.multinomial(r / r.sum(), 1, generator=generator))]`; "
            "after the loop `return out + [int(torch.multinomial(target_probs[k], 1, generator=generator))]`.",
        ),
    ),
    Exercise(
        "08_speculative_decoding",
        "check_rollback",
        "check_rollback(blocks_to_roll_back)",
        3,
        2,
        2,
        (
            "num_tokens tokens need ceil(num_tokens / block_size) blocks — the last may be partly filled and stays. "
            "Everything after them goes back, the last block first; entries equal to RELEASED (-1) are no blocks.",
            "`keep = -(-num_tokens // block_size)`; `return table[:keep], [b for b in reversed(table[keep:]) if b != "
            "RELEASED]`.",
        ),
    ),
    Exercise(
        "08_speculative_decoding",
        "check_speculative_decode",
        "check_speculative_decode(propose_ngram, speculative_decode)",
        20,
        2,
        3,
        (
            "propose_ngram: for n from min(max_n, len(tokens) - 1) down to 1, search backwards for an earlier "
            "occurrence of the last n tokens (starting before len(tokens) - n) and return the up to k tokens after it. "
            "The loop: one cache for the whole run. Prefill the prompt in one pass and take its last row's argmax. "
            "Then, until max_new_tokens are made: propose up to k tokens with propose_ngram(ids, k), run the last "
            "token and the proposals in one pass at position len(ids) - 1, keep what accept_greedy says, and start "
            "the next pass after the kept tokens — that overwrites the rejected proposals' K/V (the rollback). The "
            "EOS ends the answer wherever it comes: the prefill's token, or any of the tokens a pass keeps (not only "
            "the last): keep it, drop what follows, run no more passes. Count every pass, the prefill too.",
            "`for n in range(min(max_n, len(tokens) - 1), 0, -1)`: `suffix = tokens[-n:]`; `for start in "
            "range(len(tokens) - n - 1, -1, -1)`: `if tokens[start:start + n] == suffix: return tokens[start + n:"
            "start + n + k]`; after the loops `return []`. The loop: `cache = new_cache(model, len(ids) + "
            "max_new_tokens + k + 1)`; `logits = forward_step(model, ids, 0, cache)`; `ids.append(int(logits[-1]"
            ".argmax()))`; loop: `drafts = propose_ngram(ids, k)`, `logits = forward_step(model, [ids[-1]] + drafts, "
            "len(ids) - 1, cache)`, `kept = accept_greedy(logits.argmax(-1).tolist(), drafts)`, `if eos_token_id in "
            "kept: kept = kept[:kept.index(eos_token_id) + 1]`, `ids += kept`; loop while `len(ids) - "
            "len(prompt_ids) < max_new_tokens and ids[-1] != eos_token_id`; return "
            "`(ids[len(prompt_ids):][:max_new_tokens], passes)`.",
        ),
    ),
    Exercise(
        "08_speculative_decoding",
        "check_tree_attention_mask",
        "check_tree_attention_mask(tree_attention_mask)",
        5,
        2,
        2,
        (
            "Row i is node i's query. It sees itself (the diagonal) and every ancestor — its parent, the parent's "
            "parent, ... up to -1. Parents come before children, so when you reach row i its parent's row is done.",
            "`mask = torch.eye(len(parents), dtype=torch.bool)`; `for i, p in enumerate(parents):` "
            "`if p >= 0: mask[i] |= mask[p]`; `return mask`.",
        ),
    ),
    Exercise(
        "08_speculative_decoding",
        "check_accept_tree",
        "check_accept_tree(accept_tree)",
        10,
        2,
        2,
        (
            "Walk down from the root (node -1). At each level the target's token after the current node is "
            "target_tokens[node + 1]; look among the current node's children (parents[i] == node) for one whose draft "
            "is that token. Found: it joins the path and becomes the current node. None: emit the target's token and "
            "stop. The emitted tokens are the path's drafts and then that last target token.",
            "`path, emitted, node = [], [], -1`; `while True:` `want = target_tokens[node + 1]`; `emitted.append(want)`; "
            "`child = next((i for i, p in enumerate(parents) if p == node and drafts[i] == want), None)`; "
            "`if child is None: return path, emitted`; `path.append(child)`; `node = child`.",
        ),
    ),
    Exercise(
        "09_parallelism",
        "check_tp_mlp",
        "check_tp_mlp(tp_mlp)",
        8,
        2,
        3,
        (
            "Keep rows rank*I/ws … (rank+1)*I/ws of gate AND of up (the same rows, so they pair up), and the same "
            "range of down's columns; the product with down is only a partial sum until the ranks add it up.",
            "`rows = slice(rank * part, (rank + 1) * part)`; `h = F.silu(x @ gate[rows].T) * (x @ up[rows].T)`; "
            "`out = h @ down[:, rows].T`; `dist.all_reduce(out)`; `return out` (one all-reduce, after down).",
        ),
    ),
    Exercise(
        "09_parallelism",
        "check_tp_attention",
        "check_tp_attention(tp_attention)",
        21,
        3,
        3,
        (
            "Split the heads, not the hidden size: a rank keeps num_heads // world_size query heads and "
            "num_kv_heads // world_size K/V heads (whole groups, so its query heads read only its K/V heads): rows "
            "of wq, wk, wv; rotates its queries and keys with RoPE (pair (i, i + d/2) of row t by positions[t] · "
            "rope_theta^(-2i/d): each head alone, so each rank its own); attends causally with GQA (query head j reads "
            "K/V head j // group); multiplies by its columns of wo — a partial [T, H] sum — and all-reduces that.",
            "`d = wq.shape[0] // num_heads`; `nq, nkv = num_heads // world_size, num_kv_heads // world_size`; "
            "`q = (x @ wq[rank*nq*d:(rank+1)*nq*d].T).view(t, nq, d).transpose(0, 1)`, k and v likewise with "
            "nkv; RoPE: `inv_freq = rope_theta ** (-torch.arange(0, d, 2).float() / d)`, `angles = "
            "positions.float()[:, None] * inv_freq`, doubled with `torch.cat([angles, angles], -1)`, then "
            "`z * angles.cos() + torch.cat([-z[..., d//2:], z[..., :d//2]], -1) * angles.sin()` for q and k; "
            "`k, v = k.repeat_interleave(nq // nkv, 0), ...`; scores `q @ k.transpose(1, 2) / math.sqrt(d)` "
            "with -inf above the diagonal; `out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, nq * d) @ "
            "wo[:, rank*nq*d:(rank+1)*nq*d].T`; `dist.all_reduce(out)`; `return out`.",
        ),
    ),
    Exercise(
        "09_parallelism",
        "check_kv_heads",
        "check_kv_heads(heads_of_rank)",
        10,
        2,
        3,
        (
            "Query head h reads K/V head h // group. With num_kv_heads >= tp_size deal out whole K/V heads (groups) "
            "as evenly as possible; with fewer, rank r holds K/V head r // (tp_size // num_kv_heads) and a share of "
            "its group's query heads.",
            "`base, extra = divmod(num_kv_heads, tp_size)`; `first = rank * base + min(rank, extra)`; "
            "`kv = range(first, first + base + (rank < extra))`; q heads `range(kv.start * group, kv.stop * group)`. "
            "Replicated: `kv_head, part = divmod(rank, replicas)`; `per = group // replicas`; raise ValueError if "
            "tp_size % num_kv_heads or group % replicas.",
        ),
    ),
    Exercise(
        "09_parallelism",
        "check_prefix_rule",
        "check_prefix_rule(prefix_rule)",
        5,
        1,
        2,
        (
            "First keep the replicas whose load is at most max_imbalance above the lightest one; among them, the "
            "most matched blocks wins, then the lower load, then the lower index.",
            "`lightest = min(load)`; `eligible = [i for i in range(len(load)) if load[i] - lightest <= "
            "max_imbalance]`; `return max(eligible, key=lambda i: (matched_blocks[i], -load[i], -i))`.",
        ),
    ),
    Exercise(
        "10_serving",
        "check_detokenize_step",
        "check_detokenize_step(detokenize_step)",
        6,
        2,
        2,
        (
            "Decode the window twice, without and with the new tokens: decode(ids[prefix_offset:read_offset]) and "
            "decode(ids[prefix_offset:]); the new text is what the second has beyond the first — unless the second "
            "ends in '\\ufffd' (a character still incomplete): then emit nothing and keep the offsets.",
            "`before = decode(ids[prefix_offset:read_offset])`; `after = decode(ids[prefix_offset:])`; "
            "`if len(after) > len(before) and not after.endswith('\\ufffd'): return after[len(before):], "
            "read_offset, len(ids)`; else `return '', prefix_offset, read_offset`.",
        ),
    ),
    Exercise(
        "10_serving",
        "check_stream_events",
        "check_stream_events(stream_events)",
        36,
        3,
        3,
        (
            "Start one reader task per prompt that copies its stream's deltas (or the exception it raises) into one "
            "asyncio.Queue as (p, delta); then loop on the queue until every prompt's request_finished delta came: "
            "one chunk per delta for choice p * n + delta.index, in arrival order. A chat starts with a role chunk "
            "for every choice; usage (if asked) and DONE come last; an exception becomes error_event(exc) and ends "
            "the stream. In a finally, cancel the readers that are not done and abort(p) their prompts.",
            "`pump(p, deltas)`: `try: async for d in deltas: await q.put((p, d))` / `except Exception as exc: await "
            "q.put((p, exc))`; `tasks = [asyncio.ensure_future(pump(p, s)) for p, s in enumerate(streams)]`. Loop: "
            "`p, d = await q.get()`; an exception: `yield error_event(d); return`; else `k = p * n + d.index`, `yield "
            "sse(fmt.chunk([fmt.delta_choice(k, d.text, d.finish_reason, d.logprobs, False, offsets[k])]))`, "
            "`offsets[k] += len(d.text)`, add `len(d.output.token_ids)` when `d.output`, count `d.request_finished`. "
            "`finally: for p, t in enumerate(tasks): if not t.done(): t.cancel(); abort(p)`.",
        ),
    ),
    Exercise(
        "10_serving",
        "check_cache_key",
        "check_cache_key(cache_key)",
        6,
        1,
        2,
        (
            "Only a greedy request (temperature given as 0 — the API's default is 1) that is not streamed may "
            "be cached; the key must be the same for the same request written in any field order.",
            "Return None unless `body.get('temperature', 1) == 0` and not `body.get('stream')`; else "
            "`endpoint + json.dumps({k: v for k, v in body.items() if k not in ('stream', 'stream_options', "
            "'user')}, sort_keys=True)`.",
        ),
    ),
    Exercise(
        "10_serving",
        "check_response_cache",
        "check_response_cache(ResponseCache)",
        25,
        2,
        3,
        (
            "An OrderedDict of key -> (response, size), least recently used first, and a lock. get: a miss counts "
            "and returns None; a hit moves the key to the end, counts, and returns a deep copy. put: an entry costs "
            "its key and JSON bytes; over max_bytes // 4 it is not kept; otherwise replace any old entry (and its "
            "bytes), then pop from the front while over capacity or over max_bytes.",
            "`__init__`: `if capacity < 1 or max_bytes < 1: raise ValueError(...)`; `self.key = key or cache_key`; "
            "`self.entries = OrderedDict()`; `self.lock = threading.Lock()`; `self.hits = self.misses = self.nbytes = "
            "0`. `get`: `with self.lock:` `entry = self.entries.get(key)`; None → `self.misses += 1; return None`; "
            "`self.entries.move_to_end(key)`; `self.hits += 1`; `return copy.deepcopy(entry[0])`. `put`: `size = "
            "len(key.encode()) + len(json.dumps(response, ensure_ascii=False).encode())`; `if size > self.max_bytes "
            "// 4: return`; `with self.lock:` `old = self.entries.pop(key, None)`; `if old: self.nbytes -= old[1]`; "
            "`self.entries[key] = (copy.deepcopy(response), size)`; `self.nbytes += size`; `while len(self.entries) "
            "> self.capacity or self.nbytes > self.max_bytes: _, (_, n) = self.entries.popitem(last=False); "
            "self.nbytes -= n`.",
        ),
    ),
]

BY_CHECK: dict[str, Exercise] = {e.check: e for e in EXERCISES}

#: Check → the package functions that already solve its exercise (``Exercise.references``). Only
#: what does the exercise's job: helpers the solutions call themselves are never listed here.
#: Library functions that compute an exercise's whole answer, as ``(module, attribute)``: the
#: check refuses a learner's function that names one (``results.check``), and while grading, the
#: stand-ins refuse a call of one made for the learner (``guard.py``).
LIBRARY_ANSWERS: dict[str, tuple[tuple[str, str], ...]] = {
    "check_causal_attention": (
        ("torch.nn.functional", "scaled_dot_product_attention"),
        ("torch._C._nn", "scaled_dot_product_attention"),
        ("torch.nn.functional", "multi_head_attention_forward"),
    ),
}

REFERENCES: dict[str, tuple[str, ...]] = {
    "check_stopping": ("minillm.sequence.append_token", "minillm.sequence.take_stream_text"),
    "check_speculative_decode": ("minillm.speculative.ngram.propose_ngram",),
    "check_filter_logits": ("minillm.sampling.filter_logits",),
    "check_sample": ("minillm.sampling.sample", "minillm.sampling.apply_repetition_penalty"),
    "check_causal_attention": (
        "minillm.attention.torch_attention",
        "minillm.attention.torch_ref.attention",
        "minillm.attention.sdpa_attention",
    ),
    "check_transformer": (
        "minillm.models.llama.LlamaForCausalLM.forward",
        "minillm.models.llama.DecoderLayer.forward",
        "minillm.course.helpers.forward_logits",
        "minillm.course.helpers.forward_step",
        "minillm.course.checks.ch01_transformer.reference_layer",
        "minillm.course.checks.ch01_transformer.reference_rms_norm",
    ),
    "check_kv_write": ("minillm.kvcache.contiguous.kv_write",),
    "check_contiguous_cache": (
        "minillm.kvcache.contiguous.ContiguousKVCache.write",
        "minillm.kvcache.contiguous.ContiguousKVCache.read",
        "minillm.kvcache.contiguous.ContiguousKVCache.move_row",
        "minillm.kvcache.contiguous.contiguous_cache",
    ),
    "check_rope_tables": ("minillm.models.rope.rope_tables",),
    "check_cached_model": (
        "minillm.models.rope.apply_rope",
        "minillm.models.rope.rotate_half",
        "minillm.course.weights.apply_rotary",
        "minillm.course.checks.ch02_cached_model.reference_apply_rope",
        "minillm.kvcache.ContiguousKVCache.write",
        "minillm.kvcache.ContiguousKVCache.read",
        "minillm.models.llama.LlamaForCausalLM.forward",
        "minillm.models.llama.DecoderLayer.forward",
        "minillm.course.helpers.forward_step",
        "minillm.course.helpers.forward_logits",
    ),
    "check_block_table": ("minillm.kvcache.block_manager.grow_table", "minillm.kvcache.addressing.slot_mapping"),
    "check_gather_kv": ("minillm.attention.paged.gather_kv",),
    "check_block_pool": tuple(
        f"minillm.kvcache.block_manager.BlockPool.{name}"
        for name in ("__init__", "allocate", "ref", "release", "register", "lookup", "forget")
    ),
    "check_block_hash": ("minillm.kvcache.block_manager.block_hash",),
    "check_chunk_tokens": ("minillm.engine.scheduler.tokens_to_run",),
    "check_choose_victim": ("minillm.engine.scheduler.choose_victim",),
    "check_reserve_admit": ("minillm.engine.scheduler.reserve", "minillm.engine.scheduler.try_admit"),
    "check_continuous_schedule": ("minillm.engine.scheduler.schedule",),
    "check_prepare_inputs": (
        "minillm.runtime.paged_runner.PagedRunner.layout",
        "minillm.runtime.fast_path.flat_inputs",
        "minillm.runtime.runner.select_logit_rows",
        "minillm.course.checks.ch04_runner.reference_inputs",
    ),
    "check_gqa_attention": (
        "minillm.attention.torch_ref.attention",
        "minillm.attention.torch_attention",
        "minillm.attention.sdpa_attention",
    ),
    "check_paged_attention": (
        "minillm.attention.paged.paged_attention",
        "minillm.attention.paged.ReferencePagedStep.attend_written",
        "minillm.attention.paged.gather_kv",
        "minillm.attention.torch_ref.attention",
        "minillm.attention.torch_attention",
        "minillm.attention.sdpa_attention",
        "minillm.attention.cpu_paged.paged_decode_attention",
        "minillm.course.checks.ch05_paged_attention.reference_paged_attention",
    ),
    "check_head_pooling": ("minillm.kv_head_pooling.pool_heads",),
    "check_window_release": ("minillm.kvcache.block_manager.blocks_behind_window",),
    "check_flash_kernel": (
        "minillm.attention.triton_kernels.flash_attention",
        "minillm.attention.triton_kernels._flash_attention_kernel",
    ),
    "check_quantize_per_channel": (
        "minillm.quantization.int8.quantize_int8",
        "minillm.quantization.w8a8.quantize_activations",
        "minillm.kvcache.quantization.quantize_kv",
    ),
    "check_quantize_int4": ("minillm.quantization.int4.quantize_int4",),
    "check_pack_int4": ("minillm.quantization.int4.pack_int4", "minillm.quantization.int4.unpack_int4"),
    "check_int4_linear": (
        "minillm.quantization.int4.quantize_int4",
        "minillm.quantization.int4.dequantize_int4",
        "minillm.quantization.int4.pack_int4",
        "minillm.quantization.int4.unpack_int4",
        "minillm.quantization.int4.Int4Method.apply",
        "minillm.course.checks.ch07_int4_linear.reference_weight",
    ),
    "check_quantize_kv": (
        "minillm.kvcache.quantization.quantize_kv",
        "minillm.quantization.int8.quantize_int8",
        "minillm.quantization.w8a8.quantize_activations",
    ),
    "check_accept_greedy": ("minillm.speculative.acceptance.accept_greedy", "minillm.speculative.tree.accept_tree"),
    "check_accept_sampled": ("minillm.speculative.acceptance.accept_sampled",),
    "check_rollback": ("minillm.kvcache.block_manager.blocks_to_roll_back",),
    "check_tree_attention_mask": ("minillm.speculative.tree.tree_attention_mask",),
    "check_accept_tree": ("minillm.speculative.tree.accept_tree", "minillm.course.checks.ch08_tree_verify.reference_accept_tree"),
    "check_tp_attention": ("minillm.course.checks.ch09_tp_attention.attention",),
    "check_kv_heads": ("minillm.layers.tensor_parallel.heads_of_rank",),
    "check_prefix_rule": ("minillm.cluster.router.Router.route",),
    "check_detokenize_step": ("minillm.tokenizer.detokenize_step",),
    "check_stream_events": ("minillm.server.streaming.stream_events",),
    "check_cache_key": ("minillm.server.response_cache.cache_key",),
    "check_response_cache": ("minillm.server.response_cache.ResponseCache", "minillm.server.response_cache.response_cache"),
}


def chapters() -> dict[str, list[str]]:
    """Every chapter's checks, in the order the notebook meets them (chapter 00 has none)."""
    out: dict[str, list[str]] = {"00_welcome": []}
    for e in EXERCISES:
        out.setdefault(e.chapter, []).append(e.check)
    return out


def hint(exercise: str, level: int = 1) -> None:
    """Print a hint for ``exercise`` (a check name, or the function the exercise asks for):
    level 1 nudges, level 2 all but gives the answer."""
    e = (
        BY_CHECK.get(exercise)
        or BY_CHECK.get(f"check_{exercise}")
        or next((x for x in EXERCISES if exercise in x.functions), None)
    )
    if e is None:
        names = ", ".join(sorted(f for x in EXERCISES for f in x.functions))
        raise ValueError(f"no exercise called {exercise!r}; the exercises are: {names}")
    if level not in (1, 2):
        raise ValueError(f"hint level must be 1 or 2, got {level!r}")
    print(f"💡 {e.check} (hint {level}/2): {e.hints[level - 1]}")
    if level == 1:
        print(f"   still stuck? hint({exercise!r}, 2)")
