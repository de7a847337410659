"""Kernels a decode step launches, counted on the CPU as a proxy for the GPU's.

On a GPU a batch-1 decode step of SmolLM2-135M is bound by launches, not bytes: the H200 run of
2026-12-04 counted 468 kernels a token (15.6 a layer) running for 1.2-1.8 ms inside a step of
2.4 ms or more (``benchmarks/results/gpu-2026-12-04/``). Each fusion removes launches, and a
refactor can silently add them back. This test runs the GPU's configuration — the Triton attention
backend with the fused element-wise kernels — under Triton's interpreter and counts, for one
decode step, the operations that launch work: PyTorch operations that compute (views, empty
allocations and no-op dtype conversions do not launch a kernel) and Triton kernel launches. The
interpreter's own tensor traffic inside a launch is not counted.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.attention import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

import minillm.triton_setup  # noqa: E402,F401  (triton, ready for this machine, before its interpreter module)

NO_KERNEL = {  # operations that only describe memory
    "aten::view", "aten::reshape", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::t",
    "aten::transpose", "aten::permute", "aten::expand", "aten::as_strided", "aten::split", "aten::detach",
    "aten::detach_", "aten::flatten", "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::empty",
    "aten::empty_like", "aten::empty_strided", "aten::alias", "aten::_unsafe_view", "aten::contiguous",
}  # fmt: skip
LAUNCH = "triton launch"


def launches_of(llm: LLM, max_tokens: int, monkeypatch) -> Counter:
    """Operations that launch work while ``llm`` generates ``max_tokens`` tokens of one prompt."""
    if not minillm.triton_setup.INTERPRETED:
        pytest.skip("counts Triton launches through the interpreter")
    from triton.runtime.interpreter import InterpretedFunction

    counted: Counter = Counter()
    run = InterpretedFunction.run

    def counting_run(self, *args, **kwargs):
        counted[self.fn.__name__] += 1
        with torch.profiler.record_function(LAUNCH):
            return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counting_run)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate([[5, 17, 42, 8, 9]], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    monkeypatch.setattr(InterpretedFunction, "run", run)

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::") or parent.name == LAUNCH:
                return True
            parent = parent.cpu_parent
        return False

    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in NO_KERNEL or nested(e):
            continue
        if e.name == "aten::to" and not e.cpu_children:  # already in that dtype: returns itself
            continue
        counted[e.name] += 1
    return counted


@pytest.fixture(scope="module")
def gpu_configured(tiny_models):
    llm = LLM(tiny_models["llama_gqa"], dtype="fp32", attention_backend="triton", block_size=4,
              enable_prefix_caching=False)  # fmt: skip
    llm.engine.model.set_fused_kernels(True)  # as a GPU runs it
    return llm


def one_decode_step(llm: LLM, monkeypatch) -> Counter:
    """The launches of one decode step: two more tokens' worth, halved."""
    launches_of(llm, 2, monkeypatch)  # warm: first-call work is not a step's
    return launches_of(llm, 4, monkeypatch) - launches_of(llm, 2, monkeypatch)


def test_a_decode_layer_launches_at_most_eleven_kernels(gpu_configured, monkeypatch):
    """Per layer: the input norm, the four matrix products (q/k/v, o, gate/up, down), RoPE with
    the K/V write in one kernel, paged decode and its split merge, the residual add fused with
    the second norm, SiLU × up, and the last residual add — 11, where the unfused step made 15
    (RoPE's two multiplies and roll, the write, a copy of the attention output into place)."""
    layers = gpu_configured.engine.model.config.num_layers
    step = one_decode_step(gpu_configured, monkeypatch)
    per_step = sum(step.values()) / 2
    for name in ("_rope_write_kv_kernel", "_paged_decode_kernel", "_add_rms_norm_kernel", "_silu_and_mul_kernel"):
        assert step[name] / 2 == layers, (name, step)
    assert step["aten::roll"] == step["aten::addcmul"] == step["_write_kv_kernel"] == step["aten::copy_"] == 0, step
    assert step["aten::mm"] / 2 == 4 * layers + 1  # and the LM head
    assert per_step <= 11 * layers + 16, dict(step)  # 16: the step's own (embedding, positions, final norm, head)


def test_a_course_rope_brings_the_separate_ops_back(gpu_configured, monkeypatch):
    """The fused path is the package's: with a learner's RoPE plugged in, RoPE runs as tensor
    ops again and the write as its own kernel — the count sees the difference."""
    from minillm import hooks
    from minillm.models.rope import apply_rope

    with hooks.override(apply_rope=lambda x, cos, sin: apply_rope(x, cos, sin)):
        step = one_decode_step(gpu_configured, monkeypatch)
    layers = gpu_configured.engine.model.config.num_layers
    assert step["_rope_write_kv_kernel"] == 0 and step["_write_kv_kernel"] / 2 == layers
    assert step["aten::roll"] / 2 == layers
