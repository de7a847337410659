"""Speculative decoding (chapter 08): a cheap proposer guesses the next k tokens, the target
model checks them all in one forward pass, and the output is exactly the target's own.

- ``acceptance.py`` — the greedy and the rejection-sampling acceptance rules;
- ``ngram.py`` — prompt lookup: proposals copied from earlier in the same request;
- ``draft_model.py`` — a small model with the same tokenizer, on its own paged pool;
- ``speculator.py`` — the engine's side: propose before scheduling, verify after the pass;
- ``distill.py`` — a draft trained on the target's distributions (chapter 08's experiment).

    LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    LLM("tiny-shakespeare-8m", speculative_config={"method": "draft", "model": "tiny-shakespeare-1m",
                                                   "num_speculative_tokens": 4})
"""

from minillm.speculative.acceptance import accept_greedy, accept_sampled, residual_distribution
from minillm.speculative.ngram import propose_ngram

__all__ = ["accept_greedy", "accept_sampled", "propose_ngram", "residual_distribution"]
