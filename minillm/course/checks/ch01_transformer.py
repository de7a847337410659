"""Chapter 01's whole piece: the learner's RMSNorm, decoder layer and forward pass.

The check works in three stages, each naming the part that is wrong:

1. **diagnosis on hand-made inputs** — ``rms_norm`` on rows chosen so that each classic slip
   (no weight, LayerNorm's mean, eps outside the root, a zero row) gives a different answer;
   ``decoder_layer`` on a small random layer whose hidden size differs from ``heads × head_dim``
   (a missing transpose cannot pass by luck), compared with the textbook block and with that
   block's common variants, then half by half (the MLP switched off, then the attention) when
   no variant matches;
2. **the plug-in run** — the learner's block as every layer of the real engine (hook
   ``decoder_layer``, the naive engine, so every step is a full pass from position 0), greedy
   tokens compared with the engine's own;
3. **the forward pass** — ``transformer_forward`` on the tiny model's weights, logits within
   1e-4 of the engine's and the same greedy tokens, without running the package's model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.nn.functional as F

import minillm.hooks as hooks
from minillm.course.compare import compare_tensors, compare_tokens, name_the_slip
from minillm.course.helpers import forward_logits
from minillm.course.results import CheckFailed, LearnerRaised, check
from minillm.course.weights import LayerWeights, apply_rotary, layer_weights, rope_cos_sin

LOGITS_ATOL = 1e-4  # fp32 on CPU: the learner's plain matmuls against the engine's fused ones
TOKENS = 16

# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the last dim (each token's vector on its own)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def _rms_norm_mistakes(x, weight, eps):
    ms = x.pow(2).mean(dim=-1, keepdim=True)
    centred = x - x.mean(dim=-1, keepdim=True)
    yield x * torch.rsqrt(ms + eps), "rms_norm never multiplied by `weight`: scale each channel by it at the end"
    yield (
        centred * torch.rsqrt(centred.pow(2).mean(dim=-1, keepdim=True) + eps) * weight,
        "rms_norm subtracted the mean first: that is LayerNorm. RMSNorm only divides by the root of the mean "
        "square, x / sqrt(mean(x²) + eps)",
    )
    yield (
        x / (ms.sqrt() + eps) * weight,
        "rms_norm added eps after the square root: it goes inside, sqrt(mean(x²) + eps)",
    )
    yield x / (ms + eps) * weight, "rms_norm divided by the mean square itself: take its square root"
    yield (
        x * torch.rsqrt(ms) * weight,
        "rms_norm has no eps: add it inside the root, sqrt(mean(x²) + eps) (a quiet token's mean square is near "
        "eps, and an all-zero one would divide by 0)",
    )
    yield (
        x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + eps) * weight,
        "rms_norm divided by the root of the *sum* of squares: RMSNorm uses the mean (divide by the hidden size)",
    )
    yield (
        x * torch.rsqrt(x.pow(2).mean(dim=0, keepdim=True) + eps) * weight,
        "rms_norm averaged over the tokens (dim 0): each token's vector is normalised on its own, over the last dim",
    )
    yield x * torch.sqrt(ms + eps) * weight, "rms_norm multiplied by the root mean square: divide by it"


def _check_rms_norm(rms_norm) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=gen) * 3
    x[1] *= 1e-3  # a quiet token: eps matters here
    x[2] += 4.0  # a token with a large mean: LayerNorm differs here
    weight = torch.rand(16, generator=gen) + 0.5
    eps = 1e-5
    given = x.clone()
    got = rms_norm(given, weight, eps)
    if not torch.equal(given, x):
        raise CheckFailed("rms_norm changed its input x in place: compute on new tensors")
    expected = reference_rms_norm(x, weight, eps)
    name_the_slip(got, expected, _rms_norm_mistakes(x, weight, eps))
    compare_tensors(got, expected, "rms_norm(x[5, 16], weight, eps=1e-5)")
    zero = rms_norm(torch.zeros(2, 16), weight, eps)
    if not isinstance(zero, torch.Tensor) or not bool(torch.isfinite(zero).all()):
        raise CheckFailed(
            "rms_norm of an all-zero vector is not finite: add eps *inside* the root so it never divides by 0"
        )
    batched = rms_norm(x[None].expand(2, -1, -1), weight, eps)  # [B, T, hidden]: the engine's shape
    compare_tensors(
        batched, expected[None].expand(2, -1, -1), "rms_norm on a [2, 5, 16] batch (normalise the last dim)"
    )


# ---------------------------------------------------------------------------------------------
# The decoder layer
# ---------------------------------------------------------------------------------------------

#: The variants of the textbook block a learner writes by mistake, each with its message.
LAYER_MISTAKES: dict[str, str] = {
    "no_attention_residual": "the attention's output replaced x: add it to the residual stream, x = x + o_proj(...)",
    "no_mlp_residual": "the MLP's output replaced x: add it to the residual stream, x = x + down_proj(...)",
    "no_input_norm": "the attention read x itself: normalise it with input_layernorm first (pre-norm)",
    "no_post_norm": "the MLP read x itself: normalise it with post_attention_layernorm first (pre-norm)",
    "swapped_norms": "the norms are swapped: input_layernorm goes before the attention, post_attention_layernorm "
    "before the MLP",
    "post_norm": "the norm went after the residual (x = norm(x + f(x))): Llama normalises what each half *reads* "
    "and adds the half's raw output to x (pre-norm)",
    "silu_on_up": "SiLU went on up_proj's output: SwiGLU is silu(x @ gate_projᵀ) * (x @ up_projᵀ)",
    "relu": "the MLP's activation is ReLU: Llama's SwiGLU uses SiLU, F.silu(gate) = gate * sigmoid(gate)",
    "gelu": "the MLP's activation is GELU: Llama's SwiGLU uses SiLU, F.silu(gate) = gate * sigmoid(gate)",
    "no_rope": "q and k were never rotated: apply_rotary(q, cos, sin) and apply_rotary(k, cos, sin) before attention",
    "rope_q_only": "only q was rotated: rotate k too, or the scores depend on absolute positions, not distances",
    "rope_k_only": "only k was rotated: rotate q too",
    "rope_on_v": "v was rotated too: RoPE turns only q and k (positions shape the scores, not the values)",
    "gqa_tiled": "K/V heads were repeated as [0, 1, 0, 1, ...] (repeat or expand over a new leading dim): query "
    "head h reads K/V head h // (num_heads // num_kv_heads), [0, 0, 1, 1, ...] — repeat_interleave",
    "heads_split_wrong": "the projections were cut into heads the wrong way round: view(T, heads, head_dim) — "
    "each head is a run of head_dim consecutive columns — then transpose(0, 1)",
    "merge_without_transpose": "the attention output [heads, T, head_dim] was reshaped to [T, heads·head_dim] "
    "without moving the heads back: transpose(0, 1) first, then reshape",
    "not_causal": "every position saw the later ones: the attention needs the causal mask",
    "scale_by_head_dim": "the scores were divided by head_dim: divide by its square root",
    "no_scale": "the scores were never scaled: divide q·kᵀ by sqrt(head_dim)",
}


def reference_layer(x, w: LayerWeights, cos, sin, config, mistake: str | None = None) -> torch.Tensor:
    """The textbook Llama block on ``x[T, hidden]`` (positions 0..T-1), or one of its wrong
    variants (``LAYER_MISTAKES``). ``tests/test_course_checks.py`` holds the plain one to the
    engine's own layer."""
    m = mistake
    T = x.shape[0]
    H, KV, D = config.num_heads, config.num_kv_heads, config.head_dim
    eps = config.rms_norm_eps
    norm1, norm2 = (
        (w.post_attention_layernorm, w.input_layernorm)
        if m == "swapped_norms"
        else (w.input_layernorm, w.post_attention_layernorm)
    )
    h = x if m in ("no_input_norm", "post_norm") else reference_rms_norm(x, norm1, eps)

    def heads(y, n):
        if m == "heads_split_wrong":
            return y.view(T, D, n).permute(2, 0, 1)
        return y.view(T, n, D).transpose(0, 1)

    q, k, v = heads(h @ w.q_proj.T, H), heads(h @ w.k_proj.T, KV), heads(h @ w.v_proj.T, KV)
    if m not in ("no_rope", "rope_k_only"):
        q = apply_rotary(q, cos, sin)
    if m not in ("no_rope", "rope_q_only"):
        k = apply_rotary(k, cos, sin)
    if m == "rope_on_v":
        v = apply_rotary(v, cos, sin)
    if m == "gqa_tiled":
        k, v = k.repeat(H // KV, 1, 1), v.repeat(H // KV, 1, 1)
    else:
        k, v = k.repeat_interleave(H // KV, dim=0), v.repeat_interleave(H // KV, dim=0)
    scale = {"scale_by_head_dim": D, "no_scale": 1}.get(m, math.sqrt(D))
    scores = q @ k.transpose(-1, -2) / scale
    if m != "not_causal":
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.softmax(scores, dim=-1) @ v  # [H, T, D]
    a = a.reshape(T, H * D) if m == "merge_without_transpose" else a.transpose(0, 1).reshape(T, H * D)
    attn = a @ w.o_proj.T
    if m == "post_norm":
        x = reference_rms_norm(x + attn, norm1, eps)
    else:
        x = attn if m == "no_attention_residual" else x + attn
    h = x if m in ("no_post_norm", "post_norm") else reference_rms_norm(x, norm2, eps)
    gate, up = h @ w.gate_proj.T, h @ w.up_proj.T
    act = {
        "silu_on_up": lambda: gate * F.silu(up),
        "relu": lambda: F.relu(gate) * up,
        "gelu": lambda: F.gelu(gate) * up,
    }
    mlp = act.get(m, lambda: F.silu(gate) * up)() @ w.down_proj.T
    if m == "post_norm":
        return reference_rms_norm(x + mlp, norm2, eps)
    return mlp if m == "no_mlp_residual" else x + mlp


def small_config(config):
    """A small layer shape for hand-made checks: 4 query heads over 2 K/V heads of 8 dims, a
    hidden size of 24 — not heads × head_dim, so a missing transpose fails loudly."""
    return dataclasses.replace(config, hidden_size=24, intermediate_size=40, num_heads=4, num_kv_heads=2, head_dim=8)


def random_layer(config, seed: int = 0) -> LayerWeights:
    gen = torch.Generator().manual_seed(seed)
    hid, inter = config.hidden_size, config.intermediate_size
    qd, kvd = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def mat(rows, cols):
        return torch.randn(rows, cols, generator=gen) / math.sqrt(cols)

    norm = lambda: torch.rand(hid, generator=gen) + 0.5  # noqa: E731
    return LayerWeights(
        norm(),
        mat(qd, hid),
        mat(kvd, hid),
        mat(kvd, hid),
        mat(hid, qd),
        norm(),
        mat(inter, hid),
        mat(inter, hid),
        mat(hid, inter),
    )


def _run_layer(decoder_layer, x, w, cos, sin, config, what: str) -> torch.Tensor:
    given = x.clone()
    try:
        got = decoder_layer(given, w, cos, sin, config)
    except LearnerRaised as err:
        if "cannot be multiplied" not in str(err):
            raise
        raise CheckFailed(
            f"decoder_layer on {what} (hidden {x.shape[1]}, {config.num_heads} heads of {config.head_dim}): {err}. "
            "The matrices are [out_features, in_features], as the checkpoint stores them: multiply by the "
            "transpose, h @ w.q_proj.T"
        ) from None
    if not torch.equal(given, x):
        raise CheckFailed(f"decoder_layer changed its input x in place ({what}): write x = x + ..., not x += ...")
    if got is None:
        raise CheckFailed("decoder_layer returned None: return the layer's output [T, hidden]")
    return got


def _check_layer(decoder_layer, config) -> None:
    cfg = small_config(config)
    w = random_layer(cfg)
    T = 6
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    cos, sin = rope_cos_sin(cfg, T)
    expected = reference_layer(x, w, cos, sin, cfg)
    got = _run_layer(decoder_layer, x, w, cos, sin, cfg, "a random layer")
    slips = ((reference_layer(x, w, cos, sin, cfg, m), f"your RMSNorm is right; in decoder_layer, {why}")
             for m, why in LAYER_MISTAKES.items())  # fmt: skip
    if name_the_slip(got, expected, slips):
        _localise(decoder_layer, x, w, cos, sin, cfg)
    compare_tensors(
        got,
        expected,
        f"decoder_layer on a random layer (T = {T}, hidden {cfg.hidden_size}, 4 query "
        "heads over 2 K/V heads of 8 dims)",
    )


def _localise(decoder_layer, x, w, cos, sin, cfg) -> None:
    """No known variant matched: run each half alone (the other one's output projection at
    zero) and say which half differs."""
    halves = {
        "attention half (MLP off: down_proj = 0)": dataclasses.replace(w, down_proj=torch.zeros_like(w.down_proj)),
        "MLP half (attention off: o_proj = 0)": dataclasses.replace(w, o_proj=torch.zeros_like(w.o_proj)),
    }
    verdicts = []
    for name, half in halves.items():
        got = _run_layer(decoder_layer, x, half, cos, sin, cfg, name)
        right = (
            isinstance(got, torch.Tensor)
            and got.shape == x.shape
            and torch.allclose(got, reference_layer(x, half, cos, sin, cfg), atol=1e-5)
        )
        verdicts.append((name, right))
    wrong = [n for n, ok in verdicts if not ok]
    right = [n for n, ok in verdicts if ok]
    if len(wrong) == 1:
        raise CheckFailed(
            f"your RMSNorm is right; in decoder_layer the {right[0]} matches the reference and the {wrong[0]} does "
            "not. Compare that half with the block's recipe, line by line, on the test-sized example"
        )


# ---------------------------------------------------------------------------------------------
# The plug-in run and the forward pass
# ---------------------------------------------------------------------------------------------


def layer_adapter(decoder_layer, config):
    """Fit a learner's ``decoder_layer(x[T, hidden], w, cos[T, D], sin[T, D], config)`` into hook
    ``decoder_layer``: one row of the padded batch at a time (right padding never reaches a real
    token through a causal mask), with the engine's sign-folded sin unfolded back."""
    from minillm.attention.contiguous import ContiguousStep

    def run(layer, x, cos, signed_sin, step):
        if not isinstance(step, ContiguousStep) or step.batch.cache is not None:
            raise CheckFailed("internal: the learner's decoder layer runs only in full passes without a cache")
        w = layer_weights(layer)
        half = cos.shape[-1] // 2
        rows = []
        for b in range(x.shape[0]):
            c, s = cos[b, :, 0], signed_sin[b, :, 0]
            s = torch.cat([-s[:, :half], s[:, half:]], dim=-1)
            rows.append(decoder_layer(x[b], w, c, s, config))
        return torch.stack(rows)

    return run


@contextlib.contextmanager
def refusing_model_calls(model, message: str):
    """Inside the ``with``, running the package's model or any of its layers (``model(...)``,
    ``forward_logits``, ``forward_step``, ``model.layers[i](...)``) fails the check with
    ``message``: forward pre-hooks, removed on the way out."""

    def refuse(module, args):
        raise CheckFailed(message)

    handles = [m.register_forward_pre_hook(refuse) for m in (model, *model.layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _check_forward(transformer_forward, llm, expected_tokens: list[int]) -> None:
    model = llm.model
    ids = llm.tokenizer.encode("ROMEO.\nBut soft, what light")
    expected = forward_logits(model, ids)
    refused = (
        "transformer_forward ran the package's model (model(...), forward_logits or a layer module): build the "
        "forward from model_weights(model) and your own decoder_layer"
    )
    with refusing_model_calls(model, refused):
        got = transformer_forward(model, list(ids))
        if isinstance(got, torch.Tensor) and got.dim() == 1 and got.shape[0] == expected.shape[1]:
            raise CheckFailed(
                f"transformer_forward returned one row [{got.shape[0]}]: return every position's logits, [T, vocab]"
            )
        if isinstance(got, torch.Tensor) and tuple(got.shape) == (len(ids), model.config.hidden_size):
            raise CheckFailed(
                "transformer_forward returned the hidden states [T, hidden]: apply the final norm (w.norm) and the "
                "LM head (@ w.lm_head.T) to get logits [T, vocab]"
            )
        if (
            isinstance(got, torch.Tensor)
            and got.shape == expected.shape
            and not torch.allclose(got.float(), expected, atol=LOGITS_ATOL)
        ):
            _diagnose_forward(got, model, ids, expected)
        compare_tensors(
            got.float() if isinstance(got, torch.Tensor) else got,
            expected,
            f"transformer_forward on the {len(ids)}-token prompt (logits [T, vocab])",
            atol=LOGITS_ATOL,
        )
        tokens, seq = [], list(ids)
        for _ in range(TOKENS):
            tokens.append(int(transformer_forward(model, seq)[-1].argmax()))
            seq.append(tokens[-1])
    compare_tokens(
        tokens,
        expected_tokens,
        "greedy tokens from your transformer_forward",
        "the logits matched on the prompt: does your forward depend on anything but the ids it is given?",
    )


def _diagnose_forward(got, model, ids, expected) -> None:
    from minillm.course.weights import model_weights

    w = model_weights(model)
    cfg = model.config
    x = w.embed_tokens[torch.tensor(ids)]
    cos, sin = rope_cos_sin(model, len(ids))
    states = [x]
    for layer in w.layers:
        states.append(reference_layer(states[-1], layer, cos, sin, cfg))
    final = states[-1]
    candidates = [
        (
            final @ w.lm_head.T,
            "transformer_forward skipped the final norm: logits = rms_norm(x, w.norm, eps) @ w.lm_head.T",
        ),
    ]
    for n in range(len(w.layers)):
        candidates.append(
            (
                reference_rms_norm(states[n], w.norm, cfg.rms_norm_eps) @ w.lm_head.T,
                f"transformer_forward ran {n} of the model's {len(w.layers)} layers: run every layer in w.layers, in order",
            )
        )
    for logits, why in candidates:
        if torch.allclose(got.float(), logits.float(), atol=LOGITS_ATOL):
            raise CheckFailed(f"your RMSNorm and decoder layer are right; {why}")
    worst = float((got.float() - expected).abs().nan_to_num(float("inf")).max())
    raise CheckFailed(
        f"your RMSNorm and decoder layer are right, but transformer_forward's logits on the {len(ids)}-token prompt "
        f"differ from the engine's by up to {worst:.3g}: look at its own steps — the embedding rows (nothing else "
        "done to them), the RoPE rows for positions 0..T-1, every layer in order, the final norm, the LM head"
    )


@check
def check_transformer(rms_norm, decoder_layer, transformer_forward, model: str = "tiny-shakespeare-1m") -> str:
    """``rms_norm(x, weight, eps)``, ``decoder_layer(x[T, hidden], w, cos, sin, config)`` and
    ``transformer_forward(model, ids) -> logits[T, vocab]``: the whole model from its weights."""
    from minillm import SamplingParams
    from minillm.course.checks.common import engine, prompt_ids, reference_tokens

    _check_rms_norm(rms_norm)
    llm = engine(model, "naive")
    _check_layer(decoder_layer, llm.model.config)
    expected = reference_tokens(model, TOKENS)
    with hooks.override(decoder_layer=layer_adapter(decoder_layer, llm.model.config)):
        got = llm.generate([prompt_ids(llm)], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0].token_ids
    compare_tokens(
        got,
        expected,
        "the engine running your decoder_layer as every layer",
        "your layer matched on a random small layer: check what differs on the real model's shapes",
    )
    _check_forward(transformer_forward, llm, expected)
    n = llm.model.config.num_layers
    return (
        f"your decoder layer ran as all {n} layers of the engine and your forward pass, from the embedding to the "
        f"logits, matched it within {LOGITS_ATOL:g} and generated the same {TOKENS} tokens"
    )
