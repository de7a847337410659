"""The course machinery: checks for every exercise, helpers, notebook build and grading.

from minillm.course import check_next_token
check_next_token(next_token)
"""

from minillm.course.checks import (
    check_causal_attention,
    check_generate_cached,
    check_generate_naive,
    check_kv_read,
    check_kv_write,
    check_next_token,
)
from minillm.course.checks_attention import (
    check_flash_kernel,
    check_gqa_attention,
    check_head_pooling,
    check_online_softmax,
    check_window_release,
)
from minillm.course.checks_block_pool import check_block_pool
from minillm.course.checks_cache import check_cached_model
from minillm.course.checks_forward import check_transformer
from minillm.course.checks_forward import reference_rms_norm as rms_norm
from minillm.course.checks_int4_linear import check_int4_linear
from minillm.course.checks_paged_attention import check_paged_attention
from minillm.course.checks_parallel import check_kv_heads, check_prefix_rule, check_tp_mlp
from minillm.course.checks_quant import (
    check_pack_int4,
    check_quantize_int4,
    check_quantize_kv,
    check_quantize_per_channel,
)
from minillm.course.checks_reserve_admit import check_reserve_admit
from minillm.course.checks_rope import check_rope_tables
from minillm.course.checks_runner import check_prepare_inputs
from minillm.course.checks_sampling import check_filter_logits
from minillm.course.checks_server import check_cache_key, check_detokenize_step
from minillm.course.checks_serving import (
    check_block_hash,
    check_choose_victim,
    check_chunk_tokens,
    check_continuous_schedule,
    check_gather_kv,
    check_slot_mapping,
)
from minillm.course.checks_spec import (
    check_accept_greedy,
    check_accept_sampled,
    check_rollback,
    check_tree_attention_mask,
)
from minillm.course.checks_spec_step import check_speculative_decode
from minillm.course.checks_streaming import check_stream_events
from minillm.course.checks_tp_attention import check_tp_attention
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
    "check_accept_sampled",
    "check_block_hash",
    "check_block_pool",
    "check_cache_key",
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
    "check_continuous_schedule",
    "check_flash_kernel",
    "check_gqa_attention",
    "check_head_pooling",
    "check_generate_cached",
    "check_generate_naive",
    "check_kv_heads",
    "check_kv_read",
    "check_kv_write",
    "check_next_token",
    "check_online_softmax",
    "check_pack_int4",
    "check_prefix_rule",
    "check_quantize_int4",
    "check_quantize_kv",
    "check_quantize_per_channel",
    "check_rollback",
    "check_rope_tables",
    "check_tree_attention_mask",
    "check_slot_mapping",
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
