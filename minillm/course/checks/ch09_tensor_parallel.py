"""Chapter 09 (parallelism): a tensor-parallel MLP, and which heads a rank holds."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import minillm.hooks as hooks
from minillm.course.checks.ch09_ranks import AllReduceWatch, as_learner, learner_fn_from_source, run_on_ranks, source_of
from minillm.course.results import CheckFailed, LearnerRaised, check, learner_frames_of

# Exercise 1: a tensor-parallel MLP
# ---------------------------------------------------------------------------------------------

HIDDEN, INTER, TOKENS, WORLD = 32, 96, 5, 2  # I/ws = 48 differs from H, so a row/column mix-up cannot slip through


def _mlp(x, gate, up, down) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _tp_mlp_rank(rank, world, source, name, x, gate, up, down) -> dict:
    """One rank: run the learner's function, counting its all-reduces, and return what it
    returned — as a numpy array, which travels to the parent by value: a tensor would be shared
    through a file descriptor that the rank, exiting, may close before the parent reads it."""
    fn = as_learner(learner_fn_from_source, source, name)
    with AllReduceWatch() as watch:
        out = as_learner(fn, x.clone(), gate.clone(), up.clone(), down.clone(), rank, world)
    array = out.detach().float().cpu().numpy() if isinstance(out, torch.Tensor) else None
    return {"out": array, "type": type(out).__name__, "all_reduces": watch.shapes, "collectives": watch.others}


def _diagnose_mlp(results: list[dict], ref: torch.Tensor, partial: list[torch.Tensor], weights) -> None:
    per = INTER // WORLD
    slices = (
        f"rank r keeps gate[r*{per}:(r+1)*{per}], the same rows of up and the same columns down[:, r*{per}:(r+1)*{per}]"
    )
    if all(res["type"] == "NoneType" for res in results) and all(len(res["all_reduces"]) == 1 for res in results):
        raise CheckFailed(
            "every rank returned None after its one all-reduce: dist.all_reduce works in place — it adds the ranks' "
            "tensors into the one you pass and returns None. Call it, then return that tensor"
        )
    for r, res in enumerate(results):
        if res["out"] is None:
            raise CheckFailed(
                f"rank {r} returned {'None' if res['type'] == 'NoneType' else 'a ' + res['type']}: every rank must return the full [T, H] output — after the "
                "all-reduce every rank holds it, and the next layer runs on all of them, not only on rank 0"
            )
        if tuple(res["out"].shape) != tuple(ref.shape):
            raise CheckFailed(
                f"rank {r} returned shape {tuple(res['out'].shape)}, expected {tuple(ref.shape)} ([T, H])"
            )

    def close(a, b):
        return torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-4)

    outs, counts = [res["out"] for res in results], [len(res["all_reduces"]) for res in results]
    others = sorted({c for res in results for c in res.get("collectives", ())})
    if max(counts) == 0 and others:
        used = " and ".join(f"dist.{c}" for c in others)
        if all(close(o, ref) for o in outs):
            raise CheckFailed(
                f"the output is right, but you used {used}: one dist.all_reduce(out) adds the partial outputs and "
                "leaves the sum on every rank, in one collective — one all-reduce per MLP is all TP needs"
            )
        if "reduce" in others:
            dst = [r for r, o in enumerate(outs) if close(o, ref)]
            where = f"rank {dst[0]}" if len(dst) == 1 else "its dst rank"
            raise CheckFailed(
                f"you called dist.reduce instead of dist.all_reduce: reduce leaves the sum on {where} only; every "
                "rank needs the full output (the next layer runs on all of them): all_reduce leaves the sum on "
                "every rank"
            )
    if all(close(o, ref) for o in outs):
        if max(counts) == 0:
            raise CheckFailed(
                "each rank computed the whole MLP: no communication, but every rank holds all the weights — shard "
                f"them ({slices}) and add the partial results with one all-reduce"
            )
        if counts != [1] * WORLD:
            raise CheckFailed(
                f"the output is right, but the ranks called all_reduce {counts} times: one all-reduce "
                "per MLP, after the row-parallel down projection, is all tensor parallelism needs"
            )
        return
    if max(counts) == 0:
        if all(close(o, p) for o, p in zip(outs, partial)):
            raise CheckFailed(
                "rank outputs are partial sums: each rank's down[:, slice] @ its activations is only its slice's "
                "share of the output — the row-parallel down projection needs an all-reduce (dist.all_reduce(out)) "
                "to add them"
            )
        raise CheckFailed(
            f"without any all-reduce the ranks' outputs are neither the MLP's nor their slice's partial sum: {slices}"
        )
    odd = [s for res in results for s in res["all_reduces"] if s != tuple(ref.shape)]
    if odd:
        raise CheckFailed(
            f"you all-reduced a {list(odd[0])} tensor — the intermediate activation, before the down projection. "
            "All-reduce adds element by element, and the ranks' intermediate columns are different neurons (a sum "
            "of SiLU products is not the product of sums): the all-reduce goes after the row-parallel down "
            "projection, on its [T, H] partial sums"
        )
    if max(counts) > 1:
        raise CheckFailed(
            f"the ranks called all_reduce {counts} times: after the first one every rank already holds the full "
            "output, and a second one adds those complete copies again — one all-reduce per MLP"
        )
    if all(close(o, ref / WORLD) for o in outs):
        raise CheckFailed(
            f"the output is 1/{WORLD} of the MLP's: the all-reduce already sums the partial outputs into the full "
            "output; dividing by world_size averages them — return the all-reduced tensor as it is (its default "
            "op, a sum, is the one)"
        )
    x, gate, up, down = weights
    covered = [m for m in range(1, INTER) if all(close(o, _mlp(x, gate[:m], up[:m], down[:, :m])) for o in outs)]
    if covered:
        m = covered[0]
        why = f" (not from the hidden size H = {HIDDEN})" if m == HIDDEN else ""
        raise CheckFailed(
            f"after the all-reduce the output is the MLP over intermediate neurons 0..{m - 1} only, of I = {INTER}: "
            f"the ranks' slices must cover every intermediate neuron — size them from the intermediate dimension, "
            f"I // world_size = gate.shape[0] // world_size = {per}{why}"
        )
    if all(close(o, WORLD * ref) for o in outs):
        raise CheckFailed(
            f"the output is {WORLD}× the MLP's: every rank computed the whole MLP and the all-reduce added {WORLD} "
            f"copies — each rank must use only its slice: {slices}"
        )
    error = max(float((o - ref).abs().max()) for o in outs)
    raise CheckFailed(
        f"after the all-reduce the output differs from the MLP's by up to {error:.3g}: the slices do not pair — "
        f"a rank must keep the same intermediate neurons in all three matrices: {slices}"
    )


@check
def check_tp_mlp(tp_mlp) -> str:
    """``tp_mlp(x, gate, up, down, rank, world_size) -> Tensor``: one rank's share of a SwiGLU MLP
    (column-parallel gate/up, row-parallel down) and the one all-reduce that completes it."""
    source = source_of(tp_mlp, "tp_mlp")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    gate, up = (torch.randn(INTER, HIDDEN, generator=g) / HIDDEN**0.5 for _ in range(2))
    down = torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5
    ref = _mlp(x, gate, up, down)
    cut = [slice(r * INTER // WORLD, (r + 1) * INTER // WORLD) for r in range(WORLD)]
    partial = [_mlp(x, gate[s], up[s], down[:, s]) for s in cut]
    hint = (
        "gate and up are [I, H]: a rank keeps rows lo:hi of both; down is [H, I]: it keeps the matching "
        "columns down[:, lo:hi] (its input dimension)"
    )
    results = run_on_ranks(_tp_mlp_rank, WORLD, source, tp_mlp.__name__, x, gate, up, down, hints={"shapes": hint})
    for res in results:
        res["out"] = None if res["out"] is None else torch.from_numpy(res["out"])
    _diagnose_mlp(results, ref, partial, (x, gate, up, down))
    nbytes = TOKENS * HIDDEN * 4
    return (
        f"both ranks returned the full MLP output from half of the weights each and one all-reduce of the "
        f"[{TOKENS}, {HIDDEN}] output ({nbytes} bytes per rank) — all that TP costs an MLP"
    )


# ---------------------------------------------------------------------------------------------
# Exercise 2: which heads a rank holds
# ---------------------------------------------------------------------------------------------

#: (num_heads, num_kv_heads, tp_size, what): layouts every correct split must place.
HEAD_CASES = [
    (9, 3, 1, "SmolLM2 on one rank"),
    (9, 3, 3, "SmolLM2, one group per rank"),
    (9, 3, 2, "SmolLM2 on 2 ranks, the groups do not divide"),
    (8, 2, 4, "8 heads, 2 K/V heads, 4 ranks"),
    (9, 3, 9, "SmolLM2 on 9 ranks"),
    (32, 8, 3, "32 heads, 8 K/V heads, 3 ranks"),
    (32, 8, 8, "32 heads, 8 K/V heads, 8 ranks"),
    (32, 8, 16, "32 heads, 8 K/V heads, 16 ranks"),
    (4, 1, 2, "multi-query attention on 2 ranks"),
]
IMPOSSIBLE = [(9, 3, 6), (8, 2, 3)]  # replication whose ranks cannot share a group's query heads equally
#: (model, tp_size): TP 4 gives the 8M model one K/V head per rank and replicates the 1M model's two.
TOKEN_RUNS = [("tiny-shakespeare-8m", 4), ("tiny-shakespeare-1m", 4)]
PROMPT_IDS = [72, 1187, 15, 9, 301, 44, 1045, 12]
NEW_TOKENS = 6


def _heads(out, call: str) -> tuple[list[int], list[int]]:
    def ints(seq):
        if isinstance(seq, range) or (isinstance(seq, (list, tuple)) and all(type(h) is int for h in seq)):
            return list(seq)
        return None

    pair = list(out) if isinstance(out, (tuple, list)) and len(out) == 2 else None
    lists = [ints(s) for s in pair] if pair else [None]
    if None in lists:
        raise CheckFailed(
            f"{call} returned {out!r:.80}: return two ranges (or lists of ints) — that rank's query "
            "heads and its K/V heads"
        )
    return lists[0], lists[1]


def _deal_diagram(heads_of_rank, nh: int, nkv: int, tp: int) -> str:
    """The spec's dealing of one layout drawn against the learner's: a row per rank, a column per
    head (■ the rank holds it, · not), the query heads, then the K/V heads; ✗ marks a rank whose
    heads differ. Never raises: a rank whose call fails is drawn as such."""
    from minillm.layers.tensor_parallel import heads_of_rank as spec

    def theirs(r):
        try:
            return _heads(heads_of_rank(nh, nkv, r, tp), "")
        except LearnerRaised as err:
            return f"raised {type(err.__cause__).__name__}"
        except Exception:  # noqa: BLE001 (not a pair of head lists: the message says so already)
            return "not two lists of heads"

    def bar(heads, n: int) -> str:
        held = set(heads)
        outside = sorted(h for h in held if not 0 <= h < n)
        return "".join("■" if h in held else "·" for h in range(n)) + (f" and {outside}" if outside else "")

    expected = [tuple(list(h) for h in spec(nh, nkv, r, tp)) for r in range(tp)]
    got = [theirs(r) for r in range(tp)]
    width = len(str(tp - 1))
    lines = [f"heads_of_rank({nh}, {nkv}, rank, {tp}): ■ the rank holds the head, · it does not"]
    for i, (name, n) in enumerate((("query heads", nh), ("K/V heads", nkv))):
        lines.append(f"{name} 0..{n - 1}")
        for r in range(tp):
            mine = bar(got[r][i], n) if isinstance(got[r], tuple) else got[r]
            differs = not isinstance(got[r], tuple) or sorted(got[r][i]) != expected[r][i]
            lines.append(
                f"  rank {r:<{width}}  spec: {bar(expected[r][i], n)}  yours: {mine}" + ("  ✗" if differs else "")
            )
    return "\n".join(lines)


def _dealt_wrong(heads_of_rank, nh: int, nkv: int, tp: int, message: str) -> CheckFailed:
    """A wrong dealing of heads: the one-line message, the spec drawn against the learner's under it."""
    return CheckFailed(message, diagram=_deal_diagram(heads_of_rank, nh, nkv, tp))


def _check_layout(heads_of_rank, nh: int, nkv: int, tp: int, what: str) -> None:
    group, where = nh // nkv, f"(heads_of_rank({nh}, {nkv}, rank, {tp}): {what})"
    dealt_wrong = functools.partial(_dealt_wrong, heads_of_rank, nh, nkv, tp)
    q_of = []
    for r in range(tp):
        call = f"heads_of_rank({nh}, {nkv}, {r}, {tp})"
        try:
            out = heads_of_rank(nh, nkv, r, tp)
        except LearnerRaised as err:
            if isinstance(err.__cause__, TypeError) and "'float'" in str(err.__cause__):
                failure = CheckFailed(
                    f"{call} raised TypeError: {err.__cause__} — a head count or index became a float: in Python "
                    f"`/` always gives one ({nh} / {nkv} = {nh / nkv}). Use integer division, //, for heads"
                )
                failure.learner_frames = learner_frames_of(err.__cause__)
                raise failure from None
            raise
        q, kv = _heads(out, call)
        in_range = set(q) <= set(range(nh)) and set(kv) <= set(range(nkv))
        swapped = set(kv) <= set(range(nh)) and set(q) <= set(range(nkv)) and all(h // group in q for h in kv)
        if not in_range and swapped:
            raise CheckFailed(
                f"{call} returned {out!r:.80}: the pair is in the other order — return (q_heads, kv_heads), the "
                "query heads first"
            )
        base, extra = divmod(nkv, tp)
        if not in_range and nkv >= tp and len(kv) > base + (r < extra):
            more = f"and one more only to the first {extra} (rank < {extra})" if extra else "no rank gets one more"
            raise dealt_wrong(
                f"rank {r} got K/V heads {kv} {where}, more groups than its share: {nkv} groups over {tp} rank"
                f"{'s' if tp > 1 else ''} give each rank {base}, {more} — together the ranks hold each K/V head "
                "exactly once"
            )
        if not in_range:
            raise dealt_wrong(
                f"rank {r} got query heads {q} and K/V heads {kv} {where}: there are query heads 0..{nh - 1} and "
                f"K/V heads 0..{nkv - 1}"
            )
        if not q or not kv:
            missing = "no K/V head" if not kv else "no query head"
            raise dealt_wrong(
                f"rank {r} holds {missing} {where}: with fewer K/V heads ({nkv}) than ranks ({tp}), each K/V head is "
                f"replicated on {tp // nkv} ranks, which share its {group} query heads"
                if nkv < tp
                else f"rank {r} holds {missing} {where}: deal the {nkv} groups (a K/V head and its {group} query "
                f"heads) over all {tp} ranks"
            )
        for name, heads in (("query", q), ("K/V", kv)):
            if heads != list(range(heads[0], heads[0] + len(heads))):
                raise dealt_wrong(
                    f"rank {r}'s {name} heads {heads} are not consecutive {where}: a rank's shard is one "
                    "slice of the weight rows"
                )
        for h in q:
            if h // group not in kv:
                raise dealt_wrong(
                    f"query head {h} reads K/V head {h // group}, which rank {r} does not hold {where}: it was given "
                    f"query heads {q} and K/V heads {kv} (query head h reads K/V head h // {group})"
                )
        served = [sum(h // group == k for h in q) for k in kv]
        if len(set(served)) > 1:
            raise dealt_wrong(
                f"on rank {r} the K/V heads {kv} serve {served} query heads {where}: every K/V head on a rank must "
                "serve the same number (the attention kernel has one group size) — deal whole groups"
            )
        q_of.append(q)
    for h in range(nh):
        owners = [r for r in range(tp) if h in q_of[r]]
        if len(owners) != 1:
            raise dealt_wrong(
                f"query head {h} is on {'no rank' if not owners else f'ranks {owners}'} {where}: every query head must "
                "be computed exactly once (the row-parallel o projection adds the ranks' outputs)"
            )
    sizes = [len(q) for q in q_of]
    uneven = max(sizes) - min(sizes) > (group if nkv >= tp else 0)
    if uneven:
        a, b = sizes.index(max(sizes)), sizes.index(min(sizes))
        rule = (
            "deal whole groups as evenly as possible"
            if nkv >= tp
            else "the ranks sharing a K/V head take equal shares of its query heads"
        )
        raise dealt_wrong(f"rank {a} holds {sizes[a]} query heads and rank {b} {sizes[b]} {where}: {rule}")


def _check_extra_groups_first(heads_of_rank, nh: int, nkv: int, tp: int, what: str) -> None:
    """Who gets the extra groups when they do not divide: the chapter's stated rule (checked
    after every layout is otherwise sound, so a structural mistake is named first)."""
    from minillm.layers.tensor_parallel import split_evenly

    if nkv < tp or not nkv % tp:
        return
    where = f"(heads_of_rank({nh}, {nkv}, rank, {tp}): {what})"
    dealt_wrong = functools.partial(_dealt_wrong, heads_of_rank, nh, nkv, tp)
    kv_counts = [len(_heads(heads_of_rank(nh, nkv, r, tp), "")[1]) for r in range(tp)]
    expected = [len(split_evenly(nkv, tp, r)) for r in range(tp)]
    if kv_counts != expected:
        raise dealt_wrong(
            f"the ranks hold {kv_counts} K/V heads {where}; the rule gives the {nkv % tp} extra group"
            f"{'s' if nkv % tp > 1 else ''} to the first ranks: {expected} (split_evenly — rank r starts at "
            f"r × {nkv // tp} + min(r, {nkv % tp})), as pipeline stages split the layers (stage_layers)"
        )


def _check_impossible(heads_of_rank, nh: int, nkv: int, tp: int) -> None:
    for r in range(tp):
        try:
            out = heads_of_rank(nh, nkv, r, tp)
        except LearnerRaised as err:
            if isinstance(err.__cause__, ValueError):
                continue
            failure = CheckFailed(
                f"heads_of_rank({nh}, {nkv}, {r}, {tp}) raised {type(err.__cause__).__name__}: {err.__cause__}. This "
                f"layout cannot be split — {tp} ranks would replicate each of the {nkv} K/V heads on {tp / nkv:g} "
                f"ranks, which cannot share its {nh // nkv} query heads equally — and for it heads_of_rank must raise "
                "ValueError (raise ValueError(...)), the error a bad argument gets"
            )
            failure.learner_frames = learner_frames_of(err.__cause__)
            raise failure from None
        raise CheckFailed(
            f"heads_of_rank({nh}, {nkv}, {r}, {tp}) returned {out!r:.60} instead of raising ValueError: {tp} ranks "
            f"would replicate each of the {nkv} K/V heads on {tp / nkv:g} ranks, which cannot share its {nh // nkv} "
            "query heads equally"
        )


def _greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by recomputing the whole sequence each step: no cache to shard or size."""
    from minillm.attention.contiguous import ForwardBatch

    ids = list(prompt)
    for _ in range(steps):
        tokens = torch.tensor([ids])
        logits = model(ForwardBatch(tokens, torch.arange(len(ids))[None]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt) :]


def _kv_tokens_rank(rank, world, source, name, folder, prompt, steps):
    """One rank: build this rank's shard with the learner's head split in the model, then decode."""
    from minillm.layers.tensor_parallel import ParallelContext
    from minillm.models.loader import load_model

    fn = as_learner(learner_fn_from_source, source, name)

    def heads_of_rank(*args):  # the model slices weights with .start/.stop: hand it ranges
        q, kv = (list(h) for h in as_learner(fn, *args))
        return range(q[0], q[-1] + 1), range(kv[0], kv[-1] + 1)

    with hooks.override(heads_of_rank=heads_of_rank):  # every attention layer's shard
        model = load_model(folder, torch.float32, "cpu", 64, parallel=ParallelContext(tp_rank=rank, tp_size=world))
    tokens = _greedy(model, prompt, steps)
    return tokens if rank == 0 else None


@check
def check_kv_heads(heads_of_rank) -> str:
    """``heads_of_rank(num_heads, num_kv_heads, rank, tp_size) -> (q_heads, kv_heads)``: first on
    a table of layouts, then as the split the real model's shards are built with."""
    from minillm.assets import resolve_model
    from minillm.models.loader import load_model

    source = source_of(heads_of_rank, "heads_of_rank")
    for nh, nkv, tp, what in HEAD_CASES:
        _check_layout(heads_of_rank, nh, nkv, tp, what)
    for nh, nkv, tp in IMPOSSIBLE:
        _check_impossible(heads_of_rank, nh, nkv, tp)
    for nh, nkv, tp, what in HEAD_CASES:
        _check_extra_groups_first(heads_of_rank, nh, nkv, tp, what)
    for model, tp in TOKEN_RUNS:
        folder = resolve_model(model)
        expected = _greedy(load_model(folder, torch.float32, "cpu", 64), PROMPT_IDS, NEW_TOKENS)
        got = run_on_ranks(_kv_tokens_rank, tp, source, heads_of_rank.__name__, str(folder), PROMPT_IDS, NEW_TOKENS)[0]
        if got != expected:
            raise CheckFailed(
                f"built with your heads_of_rank at TP={tp}, {model} generated {got}; the single-process model "
                f"generates {expected}"
            )
    return (
        f"{len(HEAD_CASES)} layouts keep every query head with its K/V head, and models sharded with your split "
        f"(the 8M model at TP=4; the 1M model at TP=4, each K/V head on 2 ranks) generate the single-process tokens"
    )


# ---------------------------------------------------------------------------------------------
