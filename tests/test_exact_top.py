"""Half-precision logits that round to a tie are decided in fp32 (``minillm/layers/exact_top.py``):
greedy decoding picks the token exact arithmetic picks, not the lower id of two rounded equals."""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.layers import Linear
from minillm.layers.exact_top import refine_top_logits


def _head() -> Linear:
    """A 10-token head whose rows 3 and 7 give 20.0 and ~20.05 for the input (1, 1): one bf16
    step at 20 is 0.125, so both round to 20.0 and argmax picks 3; exactly, 7 is larger."""
    head = Linear(2, 10)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[float(i), 0.0] for i in range(10)]))
        head.weight[3] = torch.tensor([20.0, 0.0])
        head.weight[7] = torch.tensor([20.0, 0.05])
    return head.to(torch.bfloat16).requires_grad_(False)


def test_a_bf16_tie_is_decided_in_fp32():
    head = _head()
    hidden = torch.ones(2, 2, dtype=torch.bfloat16)
    rounded = head(hidden).float()
    assert rounded[0, 3] == rounded[0, 7]  # the tie the rounding made
    refined = refine_top_logits(rounded.clone(), hidden, head)
    assert refined.argmax(-1).tolist() == [7, 7]
    assert refined[0, 7] == pytest.approx(20.0 + torch.tensor(0.05, dtype=torch.bfloat16).item(), abs=1e-5)
    assert torch.equal(refined[:, :3], rounded[:, :3])  # far from the top: left as they were


def test_the_band_is_refined_from_the_hidden_state_before_the_norm():
    """The compiled step hands over the last layer's output; the norm is applied to the rows refined."""
    head = _head()
    hidden = torch.full((1, 2), 3.0, dtype=torch.bfloat16)
    to_ones = lambda x: x / x  # noqa: E731  (a "norm" that maps every row to (1, 1))
    refined = refine_top_logits(head(to_ones(hidden)).float(), hidden, head, norm=to_ones)
    assert refined.argmax(-1).tolist() == [7]


def test_fp32_and_quantized_heads_are_left_alone():
    head = _head().float()
    hidden = torch.ones(1, 2)
    logits = head(hidden)
    assert refine_top_logits(logits.clone(), hidden, head).equal(logits)  # fp32: nothing rounded


@pytest.mark.slow
def test_smollm2_in_bf16_answers_as_in_fp32(smollm2_dir):
    """The field case: asked for France's capital, bf16 logits of "The" and "L" tied on an AMD
    EPYC without AVX-512, and greedy decoding answered "L'Étoile, ..."."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(max_tokens=8)
    answers = [LLM(smollm2_dir, dtype=dtype, compile=False).generate(chat, params)[0].text for dtype in ("fp32", "bf16")]
    assert answers[0].startswith("The capital of France is Paris")
    assert answers[1] == answers[0]
