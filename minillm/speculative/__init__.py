"""Speculative decoding (chapter 08): a cheap proposer guesses the next k tokens, the target
model checks them all in one forward pass, and the output is exactly the target's own.

- ``acceptance.py`` — the greedy and the rejection-sampling acceptance rules;
- ``ngram.py`` — prompt lookup: proposals copied from earlier in the same request;
- ``draft_model.py`` — a small model with the same tokenizer, on its own paged pool;
- ``speculator.py`` — the engine's side: propose before scheduling, verify after the pass;
- ``eagle.py`` — a feature-level draft head that reads the target's hidden states (EAGLE);
- ``tree.py`` — tree drafting: several branches verified in one pass under a tree mask;
- ``distill.py`` — a draft trained on the target's distributions (chapter 08's experiment).

    LLM("smollm2-135m", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    LLM("tiny-shakespeare-8m", speculative_config={"method": "draft", "model": "tiny-shakespeare-1m",
                                                   "num_speculative_tokens": 4})
"""

from minillm.speculative.acceptance import accept_greedy, accept_sampled, residual_distribution
from minillm.speculative.ngram import propose_ngram
from minillm.speculative.tree import accept_tree, tree_attention_mask

__all__ = ["accept_greedy", "accept_sampled", "accept_tree", "propose_ngram", "residual_distribution",
           "tree_attention_mask"]  # fmt: skip
