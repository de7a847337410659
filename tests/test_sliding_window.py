"""Sliding-window attention (Mistral-style): every engine path agrees, and the paged pool gives
back the blocks that fall out of the window. (Parity of the masks with HF is in test_parity.)"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, LLMEngine, SamplingParams
from minillm.attention import triton_available
from minillm.kvcache.block_manager import RELEASED

PROMPTS = [list(range(20, 41)), [11, 12], [300, 4, 77, 77, 150, 9, 8, 7, 6, 5, 4]]
PARAMS = SamplingParams(max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def naive_tokens(tiny_models):
    llm = LLM(tiny_models["mistral_window"], dtype="fp32", mode="naive")
    assert llm.engine.sliding_window == 8  # read from the checkpoint's config
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(mode="contiguous"),
        dict(mode="contiguous", attention_backend="torch"),
        dict(block_size=4, max_num_batched_tokens=5),  # the C++ decode kernel (auto on CPU)
        dict(block_size=4, max_num_batched_tokens=5, attention_backend="sdpa"),  # gather + SDPA
        dict(block_size=2, attention_backend="torch"),
        dict(block_size=16),
    ],
)
def test_every_path_matches_the_naive_engine(tiny_models, naive_tokens, engine_args):
    llm = LLM(tiny_models["mistral_window"], dtype="fp32", **engine_args)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == naive_tokens


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_kernels_with_a_window(tiny_models, naive_tokens):
    llm = LLM(
        tiny_models["mistral_window"], dtype="fp32", attention_backend="triton", block_size=4, max_num_batched_tokens=6
    )
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == naive_tokens


def test_blocks_behind_the_window_are_released(tiny_models, naive_tokens):
    engine = LLMEngine(tiny_models["mistral_window"], dtype="fp32", block_size=2)
    rid = engine.add_request(PROMPTS[0], PARAMS)
    most = 0
    out = None
    while engine.has_unfinished_requests():
        for d in engine.step():
            out = d.output or out
        if engine.has_unfinished_requests():
            table = engine.block_manager.tables[rid]
            held = [b for b in table if b != RELEASED]
            most = max(most, len(held))
            assert len(table) > len(held)  # the beginning has been given back
            engine.block_manager.check_invariants()
    # A window of 8 tokens in blocks of 2: at most 5 blocks held (4 + the one being filled),
    # where the full sequence (21 + 30 tokens) would need 26.
    assert most <= 5
    assert out.token_ids == naive_tokens[0]
    assert engine.block_manager.num_used_blocks == 0


def test_engine_option_overrides_the_checkpoint(tiny_models):
    """Any model can run with a window; the paths still agree with each other."""
    folder = tiny_models["llama_gqa"]
    naive = LLM(folder, dtype="fp32", mode="naive", sliding_window=6).generate(PROMPTS, PARAMS)
    paged = LLM(folder, dtype="fp32", sliding_window=6, block_size=4).generate(PROMPTS, PARAMS)
    full = LLM(folder, dtype="fp32", mode="naive").generate(PROMPTS, PARAMS)
    assert [o.token_ids for o in paged] == [o.token_ids for o in naive]
    assert [o.token_ids for o in naive] != [o.token_ids for o in full]  # the window changes the answer
    with pytest.raises(ValueError, match="sliding_window=0"):
        LLM(folder, sliding_window=0)


def test_window_masks_in_the_reference():
    from minillm.attention.torch_ref import causal_mask

    mask = causal_mask(torch.tensor([[5, 6]]), 8, window=3)[0, 0]
    assert mask.int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 1, 0]]
