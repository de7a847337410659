"""Your engine (issue 45, item 3): each passed check keeps the learner's code, and
``your_engine()`` runs an engine with every kept piece plugged in.

The learner here is the answer catalogue: one independently written right answer per check,
kept as a notebook would keep it. With all of them plugged in, each engine mode gives the
package's greedy tokens (fp32), SmolLM2 included, and the server serves it."""

from __future__ import annotations

import importlib
import linecache
import sys
import textwrap
import types

import pytest
import torch
from catalogue import answers_by_check

from minillm import LLM, SamplingParams
from minillm.course import check_causal_attention, check_generate_naive
from minillm.course.plugs import PLUGS
from minillm.course.records import read_records, record, snapshot
from minillm.course.your_engine import engine_settings, serving_plugs, your_engine
from tests.test_grading_isolation import SOLVED_GENERATE

PROMPTS = ["KING.\nNow is the winter of our discontent", "ROMEO.\nBut soft, what light", "To be, or not to be"]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)

# The pieces each mode must call when every check is passed (the others wait for their option:
# quantization, speculation, a window, a stream; or sit under a piece that replaces them).
CALLED = {
    "naive": {"decoder_layer", "rope_tables", "heads_of_rank", "detokenize_step", "sample", "append_token",
              "take_stream_text"},
    # (the learner's cache class calls their kv_write itself, not through the hook)
    "contiguous": {"torch_attention", "contiguous_cache", "apply_rope", "rope_tables", "detokenize_step", "sample",
                   "append_token", "take_stream_text"},
    "paged": {"apply_rope", "rope_tables", "block_pool", "block_hash", "tokens_to_run", "schedule", "step_layout", "reserve", "try_admit",
              "paged_attention", "detokenize_step", "sample", "append_token", "take_stream_text"},
}  # fmt: skip


@pytest.fixture(scope="module")
def passed_everything(tmp_path_factory):
    """A course folder where every pluggable check has passed: the first right answer of each that
    a notebook could keep (a ``def`` at the top of a cell, not a lambda)."""
    folder = tmp_path_factory.mktemp("course") / "your_engine"
    for check in PLUGS:
        for fns in answers_by_check()[0].get(check, []):
            record(check, "catalogue", fns, folder)
            if not read_records(folder)[check].error:
                break
        else:
            pytest.fail(f"{check}: no right answer in the catalogue can be kept as a record")
    return folder


def _notebook_function(tmp_path, source: str, name: str, extra: dict | None = None):
    """A function as a notebook cell defines it: module ``__main__``, its text in linecache."""
    path = tmp_path / f"cell-{name}.py"
    path.write_text(textwrap.dedent(source))
    space = {"__name__": "__main__", **(extra or {})}
    exec(compile(path.read_text(), str(path), "exec"), space)
    linecache.checkcache(str(path))
    return space[name]


def test_a_record_keeps_helpers_imports_and_constants(tmp_path):
    module = tmp_path / "learner_cells.py"
    module.write_text(
        textwrap.dedent(
            """
            import math
            import torch.nn.functional as F
            from minillm.course import model_weights
            SCALE = 2.0
            NEG = float("-inf")
            HALF = (1, 2)

            def helper(x):
                return F.relu(x) * SCALE

            class Box:
                def __init__(self, x):
                    self.x = helper(x)

            def answer(x):
                assert model_weights is not None and NEG < 0 < math.pi and HALF
                return Box(x).x + 1
            """
        )
    )
    sys.path.insert(0, str(tmp_path))
    try:
        learner = importlib.import_module("learner_cells")
    finally:
        sys.path.remove(str(tmp_path))
    text = snapshot([learner.answer])
    for line in ("import math", "import torch.nn.functional as F", "from minillm.course.weights import model_weights",
                 "SCALE = 2.0", "NEG = float('-inf')", "def helper(x):", "class Box:"):  # fmt: skip
        assert line in text, (line, text)
    assert text.index("def helper") < text.index("def answer")
    record("check_demo", "00", [learner.answer], tmp_path / "kept")
    kept = read_records(tmp_path / "kept")["check_demo"]
    (again,) = kept.load()
    import torch

    x = torch.tensor([-1.0, 3.0])
    assert torch.equal(again(x), learner.answer(x)) and again is not learner.answer


def test_a_record_keeps_a_triton_kernel_with_its_decorator(tmp_path):
    pytest.importorskip("triton")
    import torch

    source = """
        import triton
        import triton.language as tl

        @triton.jit
        def double_kernel(x_ptr, n, BLOCK: tl.constexpr):
            offs = tl.arange(0, BLOCK)
            tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2, mask=offs < n)

        def double(x):
            double_kernel[(1,)](x, x.numel(), BLOCK=16)
            return x
        """
    double = _notebook_function(tmp_path, source, "double")
    record("check_demo", "06", [double], tmp_path / "kept")
    kept = read_records(tmp_path / "kept")["check_demo"]
    assert not kept.error and "@triton.jit" in kept.path.read_text()
    (again,) = kept.load()
    assert again(torch.arange(5.0)).tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_a_record_says_why_it_cannot_keep_a_function(tmp_path):
    import torch

    weights = torch.ones(3)
    reads_object = _notebook_function(
        tmp_path, "def scaled(x):\n    return x * weights\n", "scaled", {"weights": weights}
    )
    record("check_demo", "00", [reads_object], tmp_path / "kept")
    error = read_records(tmp_path / "kept")["check_demo"].error
    assert "`weights` (a Tensor)" in error and "pass it as an argument" in error
    shadowed = _notebook_function(
        tmp_path, "def scaled(weights, x):\n    return x * weights\n", "scaled", {"weights": weights}
    )
    record("check_demo", "00", [shadowed], tmp_path / "kept")  # the parameter, not the notebook's tensor
    assert not read_records(tmp_path / "kept")["check_demo"].error
    record("check_demo", "00", [lambda x: x], tmp_path / "kept")
    assert "not a function or class defined with `def`" in read_records(tmp_path / "kept")["check_demo"].error

    def outer():
        def inner(x):
            return x

        return inner

    record("check_demo", "00", [outer()], tmp_path / "kept")
    assert "defined inside another function" in read_records(tmp_path / "kept")["check_demo"].error


def test_a_check_passed_in_a_notebook_keeps_the_code_and_a_test_does_not(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def causal_attention(q, k, v):  # pytest's code
        t = q.shape[-2]
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return torch.softmax(scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")), -1) @ v

    check_causal_attention(causal_attention)
    assert not (tmp_path / "your_engine").exists()
    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: types.SimpleNamespace(kernel=object()))  # a kernel's shell
    loop = SOLVED_GENERATE  # the grading tests' solved loop
    check_generate_naive(_notebook_function(tmp_path, loop, "generate_naive"))
    kept = read_records(tmp_path / "your_engine")["check_generate_naive"]
    assert kept.chapter == "01_prefill_and_decode" and kept.functions == ["generate_naive"] and not kept.error
    assert "def generate_naive(model, prompt_ids, max_new_tokens):" in kept.path.read_text()
    wrong = _notebook_function(tmp_path, loop.replace("[-1]", "[0]"), "generate_naive")
    with pytest.raises(AssertionError):
        check_generate_naive(wrong)
    assert ")[-1].argmax()" in kept.path.read_text(), "a failed check must not replace the passing record"


@pytest.mark.parametrize("mode", ["naive", "contiguous", "paged"])
def test_every_piece_plugged_in_gives_the_package_tokens(passed_everything, mode):
    engine = your_engine("tiny-shakespeare-1m", passed_everything, mode=mode)
    got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    expected = [o.token_ids for o in LLM("tiny-shakespeare-1m", dtype="fp32", mode=mode).generate(PROMPTS, GREEDY)]
    assert got == expected
    called = {p.hook for p in engine.pieces if p.yours and p.calls}
    assert CALLED[mode] <= called, (CALLED[mode] - called, str(engine))
    assert "pieces are yours" in str(engine)


def test_smollm2_on_the_learners_pieces_matches_the_package_in_fp32(passed_everything):
    engine = your_engine("smollm2-135m", passed_everything)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    expected = [o.token_ids for o in LLM("smollm2-135m", dtype="fp32", compile=False).generate(prompts, GREEDY)]
    assert got == expected
    assert {"paged_attention", "step_layout", "schedule", "block_pool", "apply_rope"} <= {
        p.hook for p in engine.yours if p.calls
    }


def test_the_learners_engine_serves_the_openai_api(passed_everything):
    import openai

    engine = your_engine("tiny-shakespeare-1m", passed_everything)
    expected = LLM("tiny-shakespeare-1m", dtype="fp32").generate(PROMPTS[:1], GREEDY)[0].text
    with engine.serving() as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        stream = client.completions.create(model="tiny-shakespeare-1m", prompt=PROMPTS[0], max_tokens=12,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == expected
    assert {"stream_events", "detokenize_step", "paged_attention"} <= {p.hook for p in engine.yours if p.calls}


def test_minillm_serve_your_engine(passed_everything):
    import httpx

    from minillm.server.launch import ServerProcess

    expected = LLM("tiny-shakespeare-1m", dtype="fp32").generate(PROMPTS[:1], GREEDY)[0].text
    body = {"model": "tiny-shakespeare-1m", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    args = ["--your-engine", str(passed_everything), "--response-cache", "4"]
    with ServerProcess(["tiny-shakespeare-1m"], args) as server:
        replies = [httpx.post(server.url + "/v1/completions", timeout=60, json=body) for _ in range(2)]
        metrics = httpx.get(server.url + "/metrics", timeout=60).text
    assert [r.status_code for r in replies] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in replies] == [expected, expected]
    hits = next(line.split()[-1] for line in metrics.splitlines() if line.startswith("minillm_response_cache_hits"))
    assert float(hits) == 1.0  # the second answer came from the cache ...
    overrides, _, table = serving_plugs(passed_everything, "tiny-shakespeare-1m", {})
    assert "response_cache" in overrides and "response_cache" in table  # ... the learner's class (the record's)


def test_bad_settings_and_broken_records_are_named(tmp_path, passed_everything):
    with pytest.raises(ValueError, match="mode='fast'"):
        your_engine("tiny-shakespeare-1m", passed_everything, mode="fast")
    with pytest.raises(ValueError, match="attention_backend='sdpa' would run the package's kernels"):
        engine_settings({"attention_backend": "sdpa"})
    with pytest.raises(ValueError, match="compile=True"):
        engine_settings({"compile": True})
    assert engine_settings({"dtype": "bf16"})["dtype"] == "bf16" and engine_settings({})["dtype"] == "fp32"
    with pytest.raises(ValueError, match="no records there"):
        serving_plugs(tmp_path / "empty", "tiny-shakespeare-1m", {})
    empty = your_engine("tiny-shakespeare-1m", tmp_path / "empty")
    assert not empty.yours and "no records in" in str(empty)

    broken = tmp_path / "broken"
    broken.mkdir()
    source = (passed_everything / "check_block_hash.py").read_text()
    (broken / "check_block_hash.py").write_text(source + "\ndef broken(:\n")
    engine = your_engine("tiny-shakespeare-1m", broken)
    piece = next(p for p in engine.pieces if p.hook == "block_hash")
    assert not piece.yours and "did not load: SyntaxError" in piece.note
    assert engine.generate(PROMPTS[:1], GREEDY)[0].token_ids  # the package's block_hash runs instead
