"""The fused element-wise kernels (``minillm/models/triton_fused.py``) against PyTorch's ops.

Without CUDA they run under Triton's interpreter: fp32, where the arithmetic is exact but for
summation order (1e-5). The engine turns them on only for the Triton backend on a GPU; the last
test forces them on here and checks the greedy tokens are the torch backend's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm import LLM, SamplingParams
from minillm.attention import triton_available

if not triton_available():
    pytest.skip("triton is not installed", allow_module_level=True)

from minillm.models import triton_fused  # noqa: E402
from minillm.models.llama import LlamaForCausalLM  # noqa: E402
from minillm.models.triton_fused import add_rms_norm, silu_and_mul  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = dict(atol=2e-3, rtol=2e-3) if DEVICE.type == "cuda" else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (2, 5, 576)])
def test_add_rms_norm_is_the_add_then_the_norm(shape):
    gen = torch.Generator().manual_seed(sum(shape))
    delta, residual = (torch.randn(shape, generator=gen).to(DEVICE) for _ in range(2))
    weight = torch.randn(shape[-1], generator=gen).to(DEVICE)
    normed, new_residual = add_rms_norm(delta, residual, weight, 1e-5)
    expected = residual + delta
    torch.testing.assert_close(new_residual, expected, atol=0, rtol=0)
    torch.testing.assert_close(normed, F.rms_norm(expected, (shape[-1],), weight, 1e-5), **TOL)
    assert normed.shape == new_residual.shape == delta.shape


def test_add_rms_norm_names_mismatched_shapes():
    with pytest.raises(ValueError, match=r"delta \(2, 8\), residual \(2, 8\), weight \(7,\)"):
        add_rms_norm(torch.zeros(2, 8), torch.zeros(2, 8), torch.ones(7), 1e-6)


@pytest.mark.parametrize("shape", [(1, 2 * 48), (4, 2 * 1536), (2, 3, 2 * 100)])
def test_silu_and_mul_is_silu_of_gate_times_up(shape):
    gen = torch.Generator().manual_seed(shape[-1])
    gate_up = (torch.randn(shape, generator=gen) * 3).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(gate_up), F.silu(gate) * up, **TOL)


def test_silu_and_mul_reads_a_strided_view_and_refuses_odd_widths():
    wide = torch.randn(4, 300, device=DEVICE)
    view = wide[:, :200]  # rows 300 apart
    gate, up = view.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(view), F.silu(gate) * up, **TOL)
    with pytest.raises(ValueError, match="last dimension 7"):
        silu_and_mul(torch.zeros(2, 7))


def test_the_model_with_fused_kernels_gives_the_same_tokens(tiny_model, monkeypatch):
    """Forced on (the builder turns them on only on a GPU): chunked prefill and decodes, the
    Triton backend with fused layers against the plain torch backend, greedy, fp32."""
    calls = {"add_rms_norm": 0, "silu_and_mul": 0}
    for name in calls:
        original = getattr(triton_fused, name)

        def counted(*args, name=name, original=original):
            calls[name] += 1
            return original(*args)

        monkeypatch.setattr(triton_fused, name, counted)
    prompts = [[5, 17, 42, 8, 99, 3, 250, 61, 7], [11, 12]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    args = dict(dtype="fp32", block_size=4, max_num_batched_tokens=7, device=DEVICE.type)
    ref = LLM(tiny_model, attention_backend="torch", **args).generate(prompts, params)
    assert calls == {"add_rms_norm": 0, "silu_and_mul": 0}  # off unless Triton on a GPU (or forced)
    plain_set = LlamaForCausalLM.set_fused_kernels
    monkeypatch.setattr(LlamaForCausalLM, "set_fused_kernels", lambda self, on: plain_set(self, True))
    out = LLM(tiny_model, attention_backend="triton", **args).generate(prompts, params)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert calls["add_rms_norm"] > 0 and calls["add_rms_norm"] == calls["silu_and_mul"]
