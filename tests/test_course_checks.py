"""How checks report beyond right and wrong answers (those are in test_check_catalogue.py): an
exercise not attempted yet is reported quietly, also when the skeleton's NotImplementedError is
raised inside a Triton kernel, and every verdict reaches the learner's grade log."""

from __future__ import annotations

import pytest
import torch

from minillm.attention import triton_available
from minillm.course import CheckFailed, check_flash_kernel, check_next_token
from minillm.course.results import FAIL, GRADE_LOG_ENV, NOT_ATTEMPTED


def test_not_attempted_is_reported_not_raised(tmp_path, monkeypatch, capsys):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv(GRADE_LOG_ENV, str(log))

    def unfinished(logits):
        raise NotImplementedError()

    assert check_next_token(unfinished).status == NOT_ATTEMPTED
    assert "not attempted" in capsys.readouterr().out
    with pytest.raises(CheckFailed):
        check_next_token(lambda logits: 1 / 0)  # a crash in learner code is a failure with its error
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
