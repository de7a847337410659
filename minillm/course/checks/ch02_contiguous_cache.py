"""Chapter 02's batch-cache exercise: ``ContiguousKVCache``, the contiguous engine's cache for a
static batch — one slab per layer, a row per sequence; ``write`` (a slice when every row starts at
the same position, a scatter when rows are at different lengths), ``read`` (views, never copies)
and ``move_row`` (the last row takes a finished sequence's place).

The diagnosis drives the learner's class and the package's through the same steps of a small
batch (2 layers, 3 rows, 8 positions) and compares the whole slab after each, naming the step and
the first position that differs; a separate step checks that ``read`` returns views. The plug-in
run is the contiguous engine itself, on the learner's class: prompts of different lengths whose
answers end at different steps (ragged decodes, and rows moving into finished rows' places), with
the package's engine's greedy tokens to match.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

import minillm.hooks as hooks
from minillm.course.checks.common import DEFAULT_MODEL
from minillm.course.compare import compare_tokens
from minillm.course.results import CheckError, CheckFailed, check, learner_function

LAYERS, ROWS, MAX_LEN, KV, D = 2, 3, 8, 2, 4
CONFIG = SimpleNamespace(num_layers=LAYERS, num_kv_heads=KV, head_dim=D)
SCATTER = (
    "with same_start=None each row's tokens go to its own positions: rows = torch.arange(B)[:, None], then "
    "slab[rows, :, positions] = k.transpose(1, 2) (advanced indices around a slice put the [B, T] dims first)"
)


def _kv(batch: int, t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, KV, t, D, generator=gen), torch.randn(batch, KV, t, D, generator=gen) + 10


class GradedCache:
    """The learner's cache, built from their class: each method's exceptions are reported as
    theirs, and ``moves`` counts the rows moved (so the check knows the engine compacted)."""

    def __init__(self, cls, *args):
        self.inner = learner_function(cls)(*args)
        self.moves = 0

    def write(self, layer, positions, k, v, same_start=None):
        learner_function(self.inner.write)(layer, positions, k, v, same_start)

    def read(self, layer, batch, length):
        return learner_function(self.inner.read)(layer, batch, length)

    def move_row(self, src, dst, length):
        self.moves += 1
        learner_function(self.inner.move_row)(src, dst, length)


def _steps():
    """(what, call(cache), hint) in order: each changes the cache the way the engine does."""
    k1, v1 = _kv(3, 5, 1)
    k1b, v1b = _kv(3, 5, 2)
    k2, v2 = _kv(3, 1, 3)
    k3, v3 = _kv(2, 1, 4)
    k4, v4 = _kv(3, 2, 5)
    return [
        ("a prefill: rows 0-2 write 5 tokens at positions 0-4 of layer 0 (same_start=0)",
         lambda c: c.write(0, torch.arange(5).repeat(3, 1), k1, v1, 0),
         "with same_start the rows' tokens sit at same_start .. same_start+T-1: a slice of the layer's slab "
         "(your kv_write does it)"),
        ("the same for layer 1, with other values",
         lambda c: c.write(1, torch.arange(5).repeat(3, 1), k1b, v1b, 0),
         "each layer has its own K/V: write into the slab of layer `layer` only"),
        ("a decode where rows 0-2 are at positions 5, 3 and 6 (same_start=None)",
         lambda c: c.write(0, torch.tensor([[5], [3], [6]]), k2, v2, None), SCATTER),
        ("a decode of rows 0-1 only (a batch of 2), both at position 6 (same_start=6)",
         lambda c: c.write(1, torch.tensor([[6], [6]]), k3, v3, 6),
         "with same_start=6 each of rows 0 .. B-1 (B = positions.shape[0]) gets its token at position 6; the "
         "other rows belong to sequences not in this call"),
        ("row 0 finished: move_row(2, 0, 7) copies row 2's first 7 positions into row 0",
         lambda c: c.move_row(2, 0, 7),
         "move_row(src, dst, length) copies positions 0 .. length-1 of row src into row dst, in every layer"),
        ("two tokens per row, rows at positions 1-2, 3-4 and 0-1 (same_start=None)",
         lambda c: c.write(1, torch.tensor([[1, 2], [3, 4], [0, 1]]), k4, v4, None), SCATTER),
    ]  # fmt: skip


def _slab(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = cache.read(layer, ROWS, MAX_LEN)
    return k.detach().clone(), v.detach().clone()


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    b, h, p, _ = (int(i) for i in torch.nonzero((got - want).abs() > 1e-6)[0])
    return f"row {b}, K/V head {h}, position {p}"


def _compare(what: str, hint: str, mine, ref) -> None:
    for layer in range(LAYERS):
        got, want = _slab(mine, layer), _slab(ref, layer)
        for name, g, w, other in (("keys", got[0], want[0], want[1]), ("values", got[1], want[1], want[0])):
            if tuple(g.shape) != tuple(w.shape):
                raise CheckFailed(
                    f"read(layer={layer}, batch={ROWS}, length={MAX_LEN}) returned {name} of shape {tuple(g.shape)}, "
                    f"expected {tuple(w.shape)} [batch, kv_heads, length, head_dim]: the first `batch` rows and "
                    "`length` positions, heads before positions"
                )
            if not torch.allclose(g, w):
                swapped = " (they are the other tensor's: keys and values swapped)" if torch.allclose(g, other) else ""
                raise CheckFailed(
                    f"after {what}, layer {layer}'s {name} differ at {_first_difference(g, w)}{swapped}: {hint}"
                )


def _diagnose(cls) -> None:
    cpu = torch.device("cpu")
    mine = GradedCache(cls, CONFIG, ROWS, MAX_LEN, torch.float32, cpu)
    ref = hooks.default("contiguous_cache")(CONFIG, ROWS, MAX_LEN, torch.float32, cpu)
    _compare("building the cache", "a new cache holds zeros (torch.zeros of the slab's shape)", mine, ref)
    for what, call, hint in _steps():
        call(mine)
        call(ref)
        _compare(what, hint, mine, ref)
    k, v = mine.read(0, 2, 4)
    for name, got in (("keys", k), ("values", v)):
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (2, KV, 4, D):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise CheckFailed(
                f"read(layer=0, batch=2, length=4) returned {name} of shape {shape}, expected {(2, KV, 4, D)}: the "
                "first `batch` rows and `length` positions"
            )
    mine.write(0, torch.zeros(ROWS, 1, dtype=torch.long), *_kv(ROWS, 1, 6), 0)
    if not torch.equal(k[:, :, :1], mine.read(0, 2, 1)[0]):
        raise CheckFailed(
            "read returned a copy: a write made after it does not show in what it returned. Return views (slicing "
            "or narrow: no .clone(), no torch.cat) — a decode step reads the whole history in every layer, and "
            "copying it costs as much as the step itself"
        )


def _engine_tokens(model: str, cls=None) -> tuple[list[list[int]], int]:
    from minillm import LLM, SamplingParams

    llm = LLM(model, dtype="fp32", mode="contiguous", attention_backend="torch", max_num_seqs=4)
    prompts = [
        "ROMEO.\nBut soft, what light through yonder window breaks?",
        "KING.\nNow is",
        "HAMLET.\nTo be, or not to be, that is the question:",
        "FOOL.\nThe more pity, that fools may not speak wisely",
    ]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 14, 3, 10)]  # they end at different steps
    if cls is None:
        return [o.token_ids for o in llm.generate(prompts, params)], 0
    made = []

    def cache(*args):  # hook contiguous_cache: one cache per batch
        made.append(GradedCache(cls, *args))
        return made[-1]

    with hooks.override(contiguous_cache=cache):
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
    return tokens, sum(c.moves for c in made)


@check
def check_contiguous_cache(ContiguousKVCache, model: str = DEFAULT_MODEL) -> str:
    """``ContiguousKVCache(config, batch_size, max_len, dtype, device)`` with ``write(layer, positions,
    k, v, same_start=None)``, ``read(layer, batch, length)`` and ``move_row(src, dst, length)``."""
    _diagnose(ContiguousKVCache)
    expected, _ = _engine_tokens(model)
    got, moves = _engine_tokens(model, ContiguousKVCache)
    if not moves:
        raise CheckError("the batch was meant to end at different steps, but no row moved")
    for n, (mine, ref) in enumerate(zip(got, expected)):
        compare_tokens(mine, ref, f"request {n} of the contiguous engine on your cache",
                       "your cache matched every hand-made step: look at what the engine does more of (longer "
                       "batches, rows moving while others decode)")  # fmt: skip
    return (
        f"the contiguous engine ran a batch of 4 requests on your cache — prefill, ragged decodes, {moves} rows "
        "moved into finished rows' places — and every request got the package's greedy tokens"
    )
