"""The course machinery: checks for every exercise, helpers, notebook build and grading.

from minillm.course import check_generate_naive
check_generate_naive(generate_naive)
"""

from minillm.course.checks.ch01_decode import check_causal_attention, check_generate_naive
from minillm.course.checks.ch01_sampler import check_sample
from minillm.course.checks.ch01_sampling import check_filter_logits
from minillm.course.checks.ch01_stopping import check_stopping
from minillm.course.checks.ch01_transformer import check_transformer
from minillm.course.checks.ch01_transformer import reference_rms_norm as rms_norm
from minillm.course.checks.ch02_cache import check_generate_cached, check_kv_write
from minillm.course.checks.ch02_cached_model import check_cached_model
from minillm.course.checks.ch02_contiguous_cache import check_contiguous_cache
from minillm.course.checks.ch02_rope import check_rope_tables
from minillm.course.checks.ch03_block_pool import check_block_pool
from minillm.course.checks.ch03_block_table import check_block_table
from minillm.course.checks.ch03_paged import check_block_hash, check_gather_kv
from minillm.course.checks.ch04_reserve_admit import check_reserve_admit
from minillm.course.checks.ch04_runner import check_prepare_inputs
from minillm.course.checks.ch04_scheduler import check_choose_victim, check_chunk_tokens, check_continuous_schedule
from minillm.course.checks.ch05_attention import check_gqa_attention, check_head_pooling, check_window_release
from minillm.course.checks.ch05_paged_attention import check_paged_attention
from minillm.course.checks.ch06_flash import check_flash_kernel, check_online_softmax
from minillm.course.checks.ch07_int4 import check_pack_int4, check_quantize_int4
from minillm.course.checks.ch07_int4_linear import check_int4_linear
from minillm.course.checks.ch07_int8 import check_quantize_kv, check_quantize_per_channel
from minillm.course.checks.ch08_acceptance import check_accept_greedy, check_accept_sampled
from minillm.course.checks.ch08_rollback_tree import check_rollback, check_tree_attention_mask
from minillm.course.checks.ch08_spec_step import check_speculative_decode
from minillm.course.checks.ch08_tree_verify import check_accept_tree
from minillm.course.checks.ch09_router import check_prefix_rule
from minillm.course.checks.ch09_tensor_parallel import check_kv_heads, check_tp_mlp
from minillm.course.checks.ch09_tp_attention import check_tp_attention
from minillm.course.checks.ch10_response_cache import check_response_cache
from minillm.course.checks.ch10_server import check_cache_key, check_detokenize_step
from minillm.course.checks.ch10_streaming import check_stream_events
from minillm.course.exercises import EXERCISES, Exercise, chapters, hint
from minillm.course.helpers import forward_logits, forward_step, new_cache
from minillm.course.results import CheckFailed, CheckResult, require_pass
from minillm.course.weights import LayerWeights, ModelWeights, apply_rotary, model_weights, rope_cos_sin
from minillm.course.your_engine import YourEngine, your_engine

#: Every check, by chapter: what `minillm course grade` expects a complete notebook to pass.
CHECKS_BY_CHAPTER = chapters()

#: The check cell of every exercise, as the course ships it: the grader restores these before it
#: runs a submission, so an edited or deleted check cell cannot change a grade.
CHECK_CALLS = {e.check: e.call for e in EXERCISES}

__all__ = [
    "EXERCISES",
    "Exercise",
    "hint",
    "CHECKS_BY_CHAPTER",
    "CHECK_CALLS",
    "CheckFailed",
    "CheckResult",
    "require_pass",
    "your_engine",
    "YourEngine",
    "check_accept_greedy",
    "check_accept_tree",
    "check_accept_sampled",
    "check_block_hash",
    "check_block_pool",
    "check_block_table",
    "check_cache_key",
    "check_response_cache",
    "check_detokenize_step",
    "check_speculative_decode",
    "check_stream_events",
    "check_tp_attention",
    "check_causal_attention",
    "check_filter_logits",
    "check_choose_victim",
    "check_chunk_tokens",
    "check_gather_kv",
    "check_window_release",
    "check_contiguous_cache",
    "check_continuous_schedule",
    "check_flash_kernel",
    "check_gqa_attention",
    "check_head_pooling",
    "check_generate_cached",
    "check_generate_naive",
    "check_kv_heads",
    "check_kv_write",
    "check_online_softmax",
    "check_pack_int4",
    "check_prefix_rule",
    "check_quantize_int4",
    "check_quantize_kv",
    "check_quantize_per_channel",
    "check_rollback",
    "check_rope_tables",
    "check_sample",
    "check_stopping",
    "check_tree_attention_mask",
    "check_tp_mlp",
    "check_transformer",
    "check_cached_model",
    "check_prepare_inputs",
    "check_reserve_admit",
    "check_paged_attention",
    "check_int4_linear",
    "rms_norm",
    "LayerWeights",
    "ModelWeights",
    "apply_rotary",
    "model_weights",
    "rope_cos_sin",
    "forward_logits",
    "forward_step",
    "new_cache",
]
