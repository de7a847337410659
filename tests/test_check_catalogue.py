"""Course checks never lie: every exercise's correct answers pass, its typical wrong answers fail
with the intended message, and a check's own crash is never blamed on the learner.

The answers live in ``check_catalogue.py`` (the Triton kernel's variants are below: they need
``@triton.jit`` at import time)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from check_catalogue import RIGHT, WRONG, causal_attention, generate_naive

import minillm.course as course
from minillm.course import EXERCISES, CheckFailed
from minillm.course.results import CHECK_ERROR, FAIL, PASS, CheckError, _latest
from minillm.kvcache.block_manager import block_hash as package_block_hash


def _triton():
    try:
        import triton  # noqa: F401

        return True
    except ImportError:
        return False


# ---- the Triton kernel of chapter 06: one kernel, a mistake chosen by a constexpr ----------------

if _triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _flash_kernel(
        Q, K, V, Out, T, S, stride_qt, stride_qh, stride_ks, stride_kh, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
        MISTAKE: tl.constexpr, ALWAYS_CAUSAL: tl.constexpr = False,
    ):  # fmt: skip
        tile, head = tl.program_id(0), tl.program_id(1)
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = Q + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        if MISTAKE == 19:
            q = tl.load(q_ptrs).to(tl.float32)  # no mask: the last tile reads rows past T
        else:
            q = tl.load(q_ptrs, mask=offs_m[:, None] < T, other=0.0).to(tl.float32)
        if MISTAKE == 17:
            q_pos = S - T + tile * BLOCK_M + tl.zeros([BLOCK_M], tl.int32)  # the tile's first row's position
        else:
            q_pos = S - T + offs_m
        if MISTAKE == 16:
            m_i = tl.zeros([BLOCK_M], tl.float32)  # "the max starts at 0"
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, S, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            kv_offsets = offs_n[:, None] * stride_ks + head * stride_kh + offs_d[None, :]
            k = tl.load(K + kv_offsets, mask=offs_n[:, None] < S, other=0.0).to(tl.float32)
            if MISTAKE == 10:
                v = tl.load(K + kv_offsets, mask=offs_n[:, None] < S, other=0.0).to(tl.float32)  # copy-paste: K
            else:
                v = tl.load(V + kv_offsets, mask=offs_n[:, None] < S, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k))
            if MISTAKE == 8:
                s = s / scale
            elif MISTAKE != 4:
                s = s * scale
            if MISTAKE == 6:
                allowed = offs_n[None, :] >= 0  # forgets the keys past S in the last tile
            else:
                allowed = offs_n[None, :] < S
            if CAUSAL or ALWAYS_CAUSAL:
                if MISTAKE == 1:
                    allowed = allowed & (offs_n[None, :] < q_pos[:, None])  # hides the diagonal
                elif MISTAKE == 7:
                    allowed = allowed & (offs_n[None, :] <= offs_m[:, None])  # forgets the cached prefix
                elif MISTAKE != 2:
                    allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            if MISTAKE == 14:
                m_new = tl.maximum(m_i, tl.max(s, 0))  # the max over the queries, one per key
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            if MISTAKE == 9:
                p = tl.exp2(s - m_safe[:, None])  # exp2 without log2(e) folded into the scores
                alpha = tl.exp2(m_i - m_safe)
            elif MISTAKE == 13:
                p = tl.exp(s - m_i[:, None])  # against the old max
                alpha = tl.exp(m_i - m_safe)
            elif MISTAKE == 12:
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_safe - m_i)  # inverted rescale
            else:
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
            if MISTAKE == 5:
                l_i = l_i + tl.sum(p, 1)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            if MISTAKE == 3:
                acc = acc + tl.dot(p, v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v)
            if MISTAKE != 11:  # 11 forgets to carry the running max
                m_i = m_new
        if MISTAKE == 15:
            out = acc  # forgets the softmax's denominator
        else:
            out = acc / l_i[:, None]
        o_ptrs = Out + offs_m[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        if MISTAKE == 18:
            tl.store(o_ptrs, out, mask=offs_m[:, None] <= T)  # one row too many
        else:
            tl.store(o_ptrs, out, mask=offs_m[:, None] < T)

    @triton.jit
    def _flash_kernel_bias(
        Q, K, V, Out, T, S, stride_qt, stride_qh, stride_ks, stride_kh, scale,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
    ):  # fmt: skip
        """Independent: an additive -inf bias, exp2 with log2(e) folded into the scale."""
        row_block, h = tl.program_id(0), tl.program_id(1)
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        queries = tl.load(
            Q + rows[:, None] * stride_qt + h * stride_qh + dims[None, :], mask=rows[:, None] < T, other=0.0
        )
        queries = queries.to(tl.float32) * (scale * 1.4426950408889634)
        last_key = rows + (S - T)
        best = tl.zeros([BLOCK_M], tl.float32) - float("inf")
        total = tl.zeros([BLOCK_M], tl.float32)
        out = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for first in range(0, S, BLOCK_N):
            cols = first + tl.arange(0, BLOCK_N)
            ptr = cols[:, None] * stride_ks + h * stride_kh + dims[None, :]
            keys = tl.load(K + ptr, mask=cols[:, None] < S, other=0.0).to(tl.float32)
            vals = tl.load(V + ptr, mask=cols[:, None] < S, other=0.0).to(tl.float32)
            hidden = cols[None, :] >= S
            if CAUSAL:
                hidden = hidden | (last_key[:, None] - cols[None, :] < 0)
            logits = tl.dot(queries, tl.trans(keys)) + tl.where(hidden, float("-inf"), 0.0)
            new_best = tl.maximum(best, tl.max(logits, 1))
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            weights = tl.exp2(logits - shift[:, None])
            decay = tl.exp2(best - shift)
            total = total * decay + tl.sum(weights, 1)
            out = out * decay[:, None] + tl.dot(weights, vals)
            best = new_best
        tl.store(
            Out + rows[:, None] * stride_qt + h * stride_qh + dims[None, :],
            out / total[:, None],
            mask=rows[:, None] < T,
        )

    def _launcher(kernel, block=16, **extra):
        def flash_forward(q, k, v, causal=True):
            t, heads, dim = q.shape
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            out = torch.empty_like(q)
            grid = (triton.cdiv(t, block), heads)
            kernel[grid](
                q, k, v, out, t, k.shape[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1), dim**-0.5,
                BLOCK_M=block, BLOCK_N=block, HEAD_DIM=dim, CAUSAL=causal, **extra,
            )  # fmt: skip
            return out

        return flash_forward

    RIGHT["check_flash_kernel"] = [(_launcher(_flash_kernel, MISTAKE=0),), (_launcher(_flash_kernel_bias, block=32),)]
    WRONG["check_flash_kernel"] = [
        ((_launcher(_flash_kernel, MISTAKE=1),), "up to and including its own position"),
        ((_launcher(_flash_kernel, MISTAKE=2),), "ignores causality"),
        ((_launcher(_flash_kernel, MISTAKE=3),), "the accumulator is not rescaled"),
        ((_launcher(_flash_kernel, MISTAKE=4),), "the scores q·kᵀ are not scaled"),
        ((_launcher(_flash_kernel, MISTAKE=5),), "the running sum l is not rescaled"),
        ((_launcher(_flash_kernel, MISTAKE=0, ALWAYS_CAUSAL=True),), "causal=False differs from the reference"),
        ((_launcher(_flash_kernel, MISTAKE=6),), "keys past S"),
        ((_launcher(_flash_kernel, MISTAKE=7),), "ignores the cached prefix"),
        ((_launcher(_flash_kernel, MISTAKE=8),), "divided by scale"),
        ((_launcher(_flash_kernel, MISTAKE=9),), "exp2"),
        ((_launcher(_flash_kernel, MISTAKE=10),), "values were loaded from K"),
        ((_launcher(_flash_kernel, MISTAKE=11),), "only the last key tile"),
        ((_launcher(_flash_kernel, MISTAKE=12),), "every output is NaN"),
        ((_launcher(_flash_kernel, MISTAKE=13),), "every output is NaN"),
        ((_launcher(_flash_kernel, MISTAKE=14),), "each query row's running max (tl.max(s, 1))"),
        ((_launcher(_flash_kernel, MISTAKE=15),), "store acc / l_i"),
        ((_launcher(_flash_kernel, MISTAKE=16),), "must start at -inf"),
        ((_launcher(_flash_kernel, MISTAKE=17),), "your kernel's output for T=40, S=40, causal=True"),
        ((_launcher(_flash_kernel, MISTAKE=18),), "a tl.store touched"),
        ((_launcher(_flash_kernel, MISTAKE=19),), "a tl.load touched"),
    ]


def _params(table):
    return [
        pytest.param(check, answer, id=f"{check}-{n}")
        for check, answers in table.items()
        for n, answer in enumerate(answers)
    ]


def test_every_exercise_has_a_catalogue():
    for exercise in EXERCISES:
        if exercise.check == "check_flash_kernel" and not _triton():
            continue
        assert len(RIGHT.get(exercise.check, [])) >= 2, f"{exercise.check}: fewer than 2 correct answers"
        wrong = len(WRONG.get(exercise.check, []))
        assert wrong >= 12, f"{exercise.check}: {wrong} wrong answers, fewer than 12"
    assert set(RIGHT) <= {e.check for e in EXERCISES}


@pytest.mark.parametrize("check,answer", _params(RIGHT))
def test_correct_answer_passes(check, answer, capsys):
    result = getattr(course, check)(*answer)
    assert result.status == PASS, result
    assert f"✅ {check}" in capsys.readouterr().out


@pytest.mark.parametrize("check,case", _params(WRONG))
def test_wrong_answer_fails_with_its_message(check, case):
    answer, fragment = case
    with pytest.raises(CheckFailed) as err:
        getattr(course, check)(*answer)
    assert not isinstance(err.value, CheckError), f"the check crashed on a wrong answer: {err.value}"
    assert fragment in str(err.value), str(err.value)
    assert _latest[check].status == FAIL


# ---- how failures look and whom they blame -------------------------------------------------------


def test_learner_crash_shows_one_line_and_only_the_learners_frames():
    def causal_attention(q, k, v):
        return helper(q)

    def helper(q):
        return 1 // 0

    with pytest.raises(CheckFailed) as err:
        course.check_causal_attention(causal_attention)
    lines = err.value._render_traceback_()
    assert lines[0] == (
        "\x1b[31m❌ check_causal_attention: your code raised ZeroDivisionError: integer division or modulo by zero"
        "\x1b[0m"
    )
    frames = "".join(lines[1:])
    assert "in causal_attention" in frames and "in helper" in frames
    assert "minillm" not in frames and "site-packages" not in frames
    assert len(lines) <= 6


def test_wrong_answer_is_one_red_line():
    with pytest.raises(CheckFailed) as err:
        course.check_causal_attention(lambda q, k, v: torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v)
    assert err.value._render_traceback_() == [f"\x1b[31m❌ check_causal_attention: {err.value}\x1b[0m"]


def test_a_crash_inside_the_check_is_not_blamed_on_the_learner(monkeypatch):
    import minillm.course.checks.ch01_decode as checks

    def broken(*args, **kwargs):
        raise IndexError("index 0 is out of bounds")  # a bug in the check's own code

    monkeypatch.setattr(checks, "reference_tokens", broken)
    with pytest.raises(CheckError) as err:
        course.check_generate_naive(generate_naive)
    assert "the check itself failed — please report" in str(err.value)
    assert "IndexError: index 0 is out of bounds" in str(err.value)
    assert "your code" not in str(err.value).split("(")[0]
    assert _latest["check_generate_naive"].status == CHECK_ERROR


def test_nan_from_the_learner_is_explained_not_a_crash():
    def hides_diagonal(q, k, v):
        t = q.shape[-2]
        keep = torch.ones(t, t, dtype=torch.bool).tril(-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        return torch.softmax(scores.masked_fill(~keep, float("-inf")), -1) @ v

    with pytest.raises(CheckFailed) as err:
        course.check_causal_attention(hides_diagonal)
    assert not isinstance(err.value, CheckError)
    assert "nan" in str(err.value) and "diagonal" in str(err.value)


@pytest.mark.parametrize(
    "check,args",
    [
        ("check_block_hash", (package_block_hash,)),
        ("check_causal_attention", (F.scaled_dot_product_attention,)),
    ],
)
def test_package_functions_are_not_graded_as_the_learners(check, args):
    with pytest.raises(CheckFailed, match="not a function you wrote"):
        getattr(course, check)(*args)


def test_reference_answers_of_other_tests_still_pass():
    assert course.check_causal_attention(causal_attention).status == PASS


def test_in_a_notebook_a_failed_check_is_a_short_red_line(tmp_path):
    """What a learner sees in Jupyter: one red line for a wrong answer; for a crash, that line
    plus the learner's own frames — not a traceback through the package."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch\nfrom minillm.course import check_causal_attention"),
        nbformat.v4.new_code_cell(  # no causal mask
            "def causal_attention(q, k, v):\n    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ v"
        ),
        nbformat.v4.new_code_cell("check_causal_attention(causal_attention)"),
        nbformat.v4.new_code_cell(
            "def causal_attention(q, k, v):\n    return pick(q)\n\ndef pick(q):\n    return 1 // 0"
        ),
        nbformat.v4.new_code_cell("check_causal_attention(causal_attention)"),
        nbformat.v4.new_code_cell(
            "def causal_attention(q, k, v):\n    t = q.shape[-2]\n    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5\n"
            "    return torch.softmax(s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float('-inf')), -1) @ v"
        ),
        nbformat.v4.new_code_cell("check_causal_attention(causal_attention)"),
    ]
    client = NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3")
    client.execute(cwd=str(tmp_path))  # a passing check in a kernel keeps a record (your_engine/): not in the repo
    wrong = [o for o in nb.cells[2].outputs if o.output_type == "error"][0]
    assert len(wrong.traceback) == 1
    assert wrong.traceback[0].startswith("\x1b[31m❌ check_causal_attention: no causal mask")
    crash = [o for o in nb.cells[4].outputs if o.output_type == "error"][0]
    assert crash.traceback[0] == (
        "\x1b[31m❌ check_causal_attention: your code raised ZeroDivisionError: integer division or modulo by zero"
        "\x1b[0m"
    )
    frames = "".join(crash.traceback[1:])
    assert "return pick(q)" in frames and "return 1 // 0" in frames
    assert "minillm" not in frames and len(crash.traceback) <= 4
    right = "".join(o.get("text", "") for o in nb.cells[6].outputs)
    assert right.startswith("✅ check_causal_attention: your attention runs inside every layer")
