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
from minillm.course.checks_attention import check_flash_kernel, check_gqa_attention, check_online_softmax
from minillm.course.checks_serving import (
    check_block_allocation,
    check_block_hash,
    check_continuous_schedule,
    check_slot_mapping,
)
from minillm.course.helpers import forward_logits, forward_step, new_cache
from minillm.course.results import CheckFailed, CheckResult

#: Every check, by chapter: what `minillm course grade` expects a complete notebook to pass.
CHECKS_BY_CHAPTER = {
    "00_welcome": [],  # demonstrates checks; no exercises
    "01_prefill_and_decode": ["check_next_token", "check_generate_naive", "check_causal_attention"],
    "02_kv_cache": ["check_kv_write", "check_kv_read", "check_generate_cached"],
    "03_paged_kv_cache": ["check_slot_mapping", "check_block_hash", "check_block_allocation"],
    "04_batching": ["check_continuous_schedule"],
    "05_attention_variants": ["check_gqa_attention"],
    "06_flash_attention": ["check_online_softmax", "check_flash_kernel"],
}

#: The check cell of every exercise, as the course ships it: the grader restores these before it
#: runs a submission, so an edited or deleted check cell cannot change a grade.
CHECK_CALLS = {
    "check_next_token": "check_next_token(next_token)",
    "check_generate_naive": "check_generate_naive(generate_naive)",
    "check_causal_attention": "check_causal_attention(causal_attention)",
    "check_kv_write": "check_kv_write(kv_write)",
    "check_kv_read": "check_kv_read(kv_read)",
    "check_generate_cached": "check_generate_cached(generate_cached)",
    "check_slot_mapping": "check_slot_mapping(slot_mapping)",
    "check_block_hash": "check_block_hash(block_hash)",
    "check_block_allocation": "check_block_allocation(take_free_block, release_block)",
    "check_continuous_schedule": "check_continuous_schedule(schedule_continuous)",
    "check_gqa_attention": "check_gqa_attention(gqa_attention)",
    "check_online_softmax": "check_online_softmax(online_softmax_update)",
    "check_flash_kernel": "check_flash_kernel(flash_forward)",
}

__all__ = [
    "CHECKS_BY_CHAPTER",
    "CHECK_CALLS",
    "CheckFailed",
    "CheckResult",
    "check_block_allocation",
    "check_block_hash",
    "check_causal_attention",
    "check_continuous_schedule",
    "check_flash_kernel",
    "check_gqa_attention",
    "check_generate_cached",
    "check_generate_naive",
    "check_kv_read",
    "check_kv_write",
    "check_next_token",
    "check_online_softmax",
    "check_slot_mapping",
    "forward_logits",
    "forward_step",
    "new_cache",
]
