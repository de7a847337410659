"""How checks report beyond right and wrong answers (those are in test_check_catalogue.py): an
exercise not attempted yet is reported quietly, also when the skeleton's NotImplementedError is
raised inside a Triton kernel, and every verdict reaches the learner's grade log."""

from __future__ import annotations

import pytest
import torch

from minillm.attention import triton_available
from minillm.course import CheckFailed, check_flash_kernel, check_generate_naive
from minillm.course.results import FAIL, GRADE_LOG_ENV, NOT_ATTEMPTED


def test_not_attempted_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(GRADE_LOG_ENV, str(log))

    def unfinished(model, prompt_ids, max_new_tokens):
        raise NotImplementedError()

    assert check_generate_naive(unfinished).status == NOT_ATTEMPTED
    assert "not attempted" in capsys.readouterr().out
    with pytest.raises(CheckFailed):
        check_generate_naive(lambda model, prompt_ids, max_new_tokens: 1 / 0)  # a crash in learner code is a failure with its error
    lines = log.read_text().splitlines()
    assert [NOT_ATTEMPTED, FAIL] == [__import__("json").loads(line)["status"] for line in lines]
    assert "ZeroDivisionError" in lines[1]


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_unwritten_triton_kernel_is_not_attempted():
    """The student notebook's kernel raises NotImplementedError inside @triton.jit; the interpreter
    wraps it, and the check must still say "not attempted", not "failed"."""
    import triton
    import triton.language as tl

    @triton.jit
    def skeleton(X, N: tl.constexpr):
        offs = tl.arange(0, N)
        raise NotImplementedError()
        tl.store(X + offs, offs)

    def flash_forward(q, k, v, causal):
        skeleton[(1,)](torch.zeros(16), N=16)
        return q

    assert check_flash_kernel(flash_forward).status == NOT_ATTEMPTED


def tp_mlp_skeleton(x, gate, up, down, rank, world_size):
    raise NotImplementedError()


def test_an_unwritten_function_run_on_other_processes_is_not_attempted():
    """The skeleton raises on the ranks (the check sends its source there), not here."""
    from minillm.course import check_tp_mlp

    assert check_tp_mlp(tp_mlp_skeleton).status == NOT_ATTEMPTED


# ---- chapter 01's whole model: the check's own reference and the weights view -------------------


def test_the_checks_textbook_layer_is_the_engines_layer(tiny_model):
    """``reference_layer`` (what a learner's block is compared with on hand-made inputs) computes
    what the engine's ``DecoderLayer`` computes, on every layer of a real forward pass."""
    import minillm.hooks as hooks
    from minillm import LLM, SamplingParams
    from minillm.course.checks.ch01_transformer import reference_layer
    from minillm.course.weights import layer_weights, rope_cos_sin

    llm = LLM(tiny_model, dtype="fp32", mode="naive", attention_backend="torch")
    seen = []
    inner = hooks.current("decoder_layer")

    def record(layer, x, cos, sin, step):
        out = inner(layer, x, cos, sin, step)
        seen.append((layer, x[0].clone(), out[0].clone()))
        return out

    with hooks.override(decoder_layer=record):
        llm.generate(["To be, or not to be"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(seen) == 2 * llm.model_config.num_layers
    for layer, x, out in seen:
        cos, sin = rope_cos_sin(llm.model, x.shape[0])
        torch.testing.assert_close(
            reference_layer(x, layer_weights(layer), cos, sin, llm.model_config), out, atol=1e-5, rtol=1e-5
        )


def test_the_tp_attention_checks_reference_rotates_as_the_engine_does():
    """``check_tp_attention`` grades against its own one-process attention: at positions with a gap
    and the 8M model's rope_theta, its RoPE is the engine's (``RotaryEmbedding`` + ``apply_rope``) and
    the whole layer is SDPA's causal GQA attention over the engine-rotated heads."""
    import torch.nn.functional as F

    from minillm.assets import resolve_model
    from minillm.config import ModelConfig
    from minillm.course.checks.ch09_tp_attention import _model_case, attention
    from minillm.models.rope import RotaryEmbedding, apply_rope

    x, _, wq, wk, wv, wo, heads, kv_heads, theta = _model_case()
    config = ModelConfig.from_folder(resolve_model("tiny-shakespeare-8m"))
    positions = torch.tensor([3, 4, 5, 7, 8, 9])
    cos, signed_sin = RotaryEmbedding(config, 16, torch.device("cpu")).lookup(positions[None], torch.float32)
    t, d = x.shape[0], config.head_dim

    def engine_rotated(w, n):
        return apply_rope((x @ w.T).view(1, t, n, d), cos, signed_sin)[0].transpose(0, 1)

    q, k = engine_rotated(wq, heads), engine_rotated(wk, kv_heads)
    v = (x @ wv.T).view(t, kv_heads, d).transpose(0, 1)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(0, 1).reshape(t, -1)
    got = attention(x, positions, wq, wk, wv, wo, heads, kv_heads, theta)
    torch.testing.assert_close(got, expected @ wo.T, atol=1e-5, rtol=1e-5)


def test_model_weights_reads_the_same_matrices_through_any_weight_method(tiny_model):
    """The bf16 default engine keeps no plain matrix (oneDNN-packed): the view reads it back
    through the layer itself, bit for bit the checkpoint's bf16 values."""
    from minillm import LLM
    from minillm.course import model_weights

    plain = model_weights(LLM(tiny_model, dtype="fp32", mode="naive").model)
    packed_model = LLM(tiny_model, dtype="bf16").model
    packed = model_weights(packed_model)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        a, b = getattr(plain.layers[1], name), getattr(packed.layers[1], name)
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name
    assert torch.equal(plain.lm_head.to(torch.bfloat16), packed.lm_head)
    assert model_weights(packed_model).layers[0] is packed.layers[0]  # read once, then cached


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_an_out_of_bounds_store_is_named_and_the_interpreter_is_restored():
    """Under the interpreter a store past the tensor would overwrite the heap; inside the guard it
    raises before writing, and leaving the guard puts the interpreter back as it was."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    from minillm.course.triton_guard import OutOfBounds, bounds_checked, out_of_bounds_in

    @triton.jit
    def one_too_many(X, N: tl.constexpr):
        offs = tl.arange(0, 16)
        tl.store(X + offs, offs.to(tl.float32), mask=offs <= N)

    before = interpreter.GridExecutor.__call__
    guard_memory = torch.zeros(32)
    x = guard_memory[:8]  # the storage is 32 floats: row 8 is inside it, row 9 too
    with bounds_checked():
        one_too_many[(1,)](x, N=7)  # mask <= 7: rows 0-7, all inside
        with pytest.raises(Exception) as err:
            one_too_many[(1,)](torch.zeros(8), N=8)  # row 8 of an 8-float tensor: outside
    assert isinstance(out_of_bounds_in(err.value), OutOfBounds)
    assert "tl.store touched 1 address" in str(out_of_bounds_in(err.value))
    assert interpreter.GridExecutor.__call__ is before
    builder = interpreter.interpreter_builder
    assert builder.create_masked_store.__func__ is interpreter.InterpreterBuilder.create_masked_store
    assert builder.create_masked_load.__func__ is interpreter.InterpreterBuilder.create_masked_load
    assert x.tolist() == list(range(8))


def test_time_limit_stops_an_endless_loop_and_resumes_the_timer_outside():
    import signal

    from minillm.course.results import time_limit

    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    outer, interval = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's, when it runs with signals
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with pytest.raises(CheckFailed, match="never ends"):
            with time_limit(0.2, "never ends"):
                while True:
                    pass
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 2.0 < left < 3.0 and not fired  # the outer timer runs on, with what was left of it
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.setitimer(signal.ITIMER_REAL, outer, interval)
