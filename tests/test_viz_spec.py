"""Chapter 08's arithmetic, recordings and figures: tokens per pass, the verify-pass cost model, a
traced run and its timeline, runs on the virtual clock, the committed-benchmark and live paths of
the plots, the distillation records (present or not) and the distillation helpers."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_viz import layout_problems

from minillm import LLM, SamplingParams
from minillm.config import ModelConfig
from minillm.engine.virtual_clock import StepCost
from minillm.viz.spec import (
    Machine,
    SpecStep,
    SpecTrace,
    best_k,
    committed_spec_result,
    distill_figure,
    expected_tokens_per_pass,
    load_spec_results,
    modelled_speedup,
    smollm2_draft_records,
    spec_batch_figure,
    spec_k_figure,
    spec_steps_figure,
    spec_text_html,
    spec_timeline,
    spec_timeline_html,
    speculation_explorer,
    speculation_figure,
    tiny_workloads,
    trace_speculation,
    verify_pass_times,
    virtual_speculation,
)

TARGET, DRAFT = "tiny-shakespeare-8m", "tiny-shakespeare-1m"
DRAFT_CFG = {"method": "draft", "model": DRAFT, "num_speculative_tokens": 4}
NGRAM_CFG = {"method": "ngram", "num_speculative_tokens": 3}
PROMPTS = ["ROMEO.\nBut soft, what light", "KING.\nNow is the winter"]


# ---- the arithmetic ---------------------------------------------------------------------------------


def test_tokens_per_pass_is_the_geometric_sum():
    assert expected_tokens_per_pass(0.5, 0) == 1
    assert expected_tokens_per_pass(0.5, 1) == 1.5
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens_per_pass(1.0, 4) == 5
    assert expected_tokens_per_pass(0.0, 8) == 1  # every proposal rejected: still one token per pass
    assert modelled_speedup(0.8, 4, 0.0) == expected_tokens_per_pass(0.8, 4)
    assert modelled_speedup(0.8, 4, 0.25) == pytest.approx(expected_tokens_per_pass(0.8, 4) / 2)
    assert best_k(0.9, 0.0, max_k=10) == 10  # free proposals: longer never hurts
    assert best_k(0.3, 0.5) == 0  # a poor, expensive draft: do not speculate
    assert 1 <= best_k(0.8, 0.1) <= 6
    for bad in (lambda: expected_tokens_per_pass(1.2, 2), lambda: expected_tokens_per_pass(0.5, -1),
                lambda: modelled_speedup(0.5, 2, -0.1)):  # fmt: skip
        with pytest.raises(ValueError):
            bad()


def test_a_verify_pass_costs_one_decode_until_the_ridge():
    from minillm.assets import resolve_model

    config = ModelConfig.from_folder(resolve_model(TARGET))
    cpu = Machine("cpu", bandwidth_gbs=33, tflops=0.4)
    times = verify_pass_times(config, cpu, [1, 2, 5, 200, 400], dtype_bytes=2)
    assert times[0] == times[1] == times[2]  # memory-bound: the weights are read once either way
    assert times[4] == pytest.approx(2 * times[3], rel=0.05)  # compute-bound: proportional to the tokens
    assert cpu.ridge == pytest.approx(0.4e12 / 33e9)


# ---- a traced run and its timeline ---------------------------------------------------------------


@pytest.fixture(scope="module")
def trace():
    llm = LLM(TARGET, dtype="fp32", speculative_config=DRAFT_CFG)
    return trace_speculation(llm, PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))


def test_the_trace_accounts_for_every_token_and_leaves_the_engine_as_it_was(trace):
    plain = LLM(TARGET, dtype="fp32").generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True))
    for r, out in enumerate(trace.outputs):
        steps = trace.request_steps(r)
        assert [t for s in steps for t in s.emitted] == out.token_ids == plain[r].token_ids
        assert steps[0].drafts == [] and steps[0].fates() == ["plain"]  # the prefill's token
        verify = [s for s in steps if s.drafts]
        assert sum(len(s.drafts) for s in verify) == out.metrics.spec_proposed
        assert sum(s.accepted for s in verify) == out.metrics.spec_accepted
        s = trace.summary(r)
        assert s["passes"] == out.metrics.num_forward_passes and s["tokens"] == 40
        for step in verify:
            fates = step.fates()
            assert fates[: step.accepted] == ["accepted"] * step.accepted
            assert fates[-1] in ("bonus", "correction") or len(step.emitted) < len(step.verdict)
            assert step.rejected == step.drafts[step.accepted :]
    assert any("bonus" in s.fates() for s in trace.request_steps(0))
    assert any("correction" in s.fates() for s in trace.request_steps(0))


def test_tracing_restores_verify_and_needs_speculation():
    llm = LLM(TARGET, dtype="fp32", speculative_config=NGRAM_CFG)
    trace_speculation(llm, PROMPTS[:1], SamplingParams(max_tokens=8, ignore_eos=True))
    assert "verify" not in vars(llm.engine.speculator)  # the class's method again
    with pytest.raises(ValueError, match="speculative_config"):
        trace_speculation(LLM(TARGET, dtype="fp32"), PROMPTS[:1], SamplingParams(max_tokens=4))


def test_timeline_html_colours_each_token_and_the_widget_replays_passes(trace):
    from IPython.core.interactiveshell import InteractiveShell

    from minillm.viz.display import WIDGET_MIME

    full = spec_timeline_html(trace, 0)
    steps = trace.request_steps(0)
    assert full.count("border-left:2px solid #999") == len(steps)  # one span per pass
    assert full.count('title="pass ') == 40 + sum(1 for s in steps if "correction" in s.fates())
    assert "rejected proposal" in full and "<s " in full
    partial = spec_text_html(trace, 0, upto=3, current=3)
    assert partial.count("border-left:2px solid #999") == 3 and "outline:2px solid #333" in partial
    widget = spec_timeline(trace)
    bundle, _ = InteractiveShell.instance().display_formatter.format(widget)
    assert WIDGET_MIME in bundle and bundle["text/html"] == full and "run the cell" in bundle["text/plain"]
    choose, slider = widget.children[0].children
    caption, text = widget.children[2], widget.children[3]
    slider.value = 1
    assert "pass 1 of" in caption.value and "prefill" in caption.value
    second = steps[1]
    slider.value = 2
    assert f"kept {second.accepted}" in caption.value
    assert text.value.count("border-left:2px solid #999") == 2
    choose.value = 1
    assert slider.max == len(trace.request_steps(1)) and "request 1" in widget.children[1].value


def test_steps_figure_stacks_each_pass(trace):
    fig = spec_steps_figure(trace, 0)
    steps = trace.request_steps(0)
    by_name = {t.name: list(t.y) for t in fig.data}
    emitted = [sum(by_name[n][i] for n in by_name if n != "rejected proposal") for i in range(len(steps))]
    assert emitted == [len(s.emitted) for s in steps]
    assert by_name["rejected proposal"] == [len(s.rejected) for s in steps]
    assert not layout_problems(fig)


def _fake_trace() -> SpecTrace:
    """A trace without an engine: passes of every kind, over a toy tokenizer."""
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "".join(f"<{i}>" for i in ids))
    steps = [
        SpecStep(0, [], [1], [1]),
        SpecStep(1, [2, 3, 4], [2, 3, 4, 5], [2, 3, 4, 5]),
        SpecStep(5, [6, 7, 8], [6, 9], [6, 9]),
        SpecStep(7, [], [10], [10]),
        SpecStep(8, [11, 12, 13], [11, 12], [11, 12, 13, 14]),  # cut by max_tokens
    ]
    out = SimpleNamespace(request_id="r0", token_ids=[t for s in steps for t in s.emitted])
    return SpecTrace(["a\nprompt"], [out], {"r0": steps}, tokenizer, 3)


def test_fates_of_a_handmade_trace():
    trace = _fake_trace()
    steps = trace.request_steps(0)
    assert [s.fates() for s in steps] == [
        ["plain"],
        ["accepted"] * 3 + ["bonus"],
        ["accepted", "correction"],
        ["plain"],
        ["accepted", "accepted"],
    ]
    assert steps[2].rejected == [7, 8] and steps[4].rejected == []
    html = spec_timeline_html(trace)
    assert "&lt;9&gt;" in html and "<s " in html and "a↵\nprompt" in html
    # the verdict of the last pass accepted all three (as the engine's metrics count it), max_tokens cut it
    assert trace.summary(0) == {"passes": 5, "tokens": 10, "proposed": 9, "accepted": 7,
                                "acceptance_rate": 7 / 9, "tokens_per_pass": 2.0}  # fmt: skip


# ---- speculation on paper -------------------------------------------------------------------------


def test_speculation_figure_and_explorer():
    fig = speculation_figure((0.5, 0.8), cost_ratio=0.2)
    curves = [t for t in fig.data if t.mode == "lines+markers"]
    assert [round(y, 4) for y in curves[1].y] == [round(expected_tokens_per_pass(0.8, k), 4) for k in range(11)]
    stars = [t for t in fig.data if t.mode == "markers"]
    assert [s.x[0] for s in stars] == [best_k(0.5, 0.2, 10), best_k(0.8, 0.2, 10)]
    assert not layout_problems(fig)
    widget = speculation_explorer()
    cost, mine = widget.children[0].children
    cost.value, mine.value = 0.4, 0.95
    assert "0.40 × target" in widget.figure.layout.annotations[1].text
    assert any(t.name == "α = 0.95" and t.line.width == 4 for t in widget.figure.data)
    assert not layout_problems(widget.figure)


# ---- measured: the virtual clock, and the committed benchmark ------------------------------------------


def test_virtual_speculation_is_deterministic_and_exact():
    cost = StepCost(0.005, 0.0001)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = LLM(TARGET, dtype="fp32")
    base = virtual_speculation(plain, PROMPTS, params, cost)
    steps = 16  # both requests in every step: one prefill pass, then 15 decode passes of 2 tokens
    prompt_tokens = sum(len(plain.tokenizer.encode(p)) for p in PROMPTS)
    assert base["seconds"] == pytest.approx(steps * 0.005 + 0.0001 * (prompt_tokens + 15 * 2))
    llm = LLM(TARGET, dtype="fp32", speculative_config=DRAFT_CFG)
    runner, draft_runner = llm.engine.runner, llm.engine.speculator.draft.runner
    a = virtual_speculation(llm, PROMPTS, params, cost, StepCost(0.001, 0.00002))
    b = virtual_speculation(llm, PROMPTS, params, cost, StepCost(0.001, 0.00002))
    assert a["seconds"] == b["seconds"] and a["token_ids"] == b["token_ids"] == base["token_ids"]
    assert llm.engine.runner is runner and llm.engine.speculator.draft.runner is draft_runner
    assert a["forward_passes_per_token"] < 1 and 0 < a["acceptance_rate"] <= 1
    free = virtual_speculation(llm, PROMPTS, params, cost, StepCost(1e-9, 0.0))
    assert free["tok_s"] > a["tok_s"]  # a free draft: the same passes, less time
    with pytest.raises(ValueError, match="draft_cost"):
        virtual_speculation(llm, PROMPTS, params, cost)
    workloads = tiny_workloads(n=3)
    assert set(workloads) == {"free", "grounded"} and all(len(v) == 3 for v in workloads.values())


def _bench_rows():
    rows = []
    for workload in ("chat", "grounded"):
        for batch in (1, 4, 16):
            rows.append({"workload": workload, "proposer": "none", "k": None, "batch": batch, "tok_s": 30.0,
                         "speedup": 1.0, "acceptance_rate": None, "mean_accepted_length": None,
                         "forward_passes_per_token": 1.0, "identical": True, "agreement": 1.0})  # fmt: skip
            for proposer in ("ngram", "draft"):
                for k in (1, 2, 4, 8) if batch == 1 else (4,):
                    rows.append({"workload": workload, "proposer": proposer, "k": k, "batch": batch,
                                 "tok_s": 40.0 / batch ** 0.1, "speedup": 1.3 / batch ** 0.1, "acceptance_rate": 0.5,
                                 "mean_accepted_length": 1.2, "forward_passes_per_token": 0.5,
                                 "identical": True, "agreement": 1.0})  # fmt: skip
    return rows


def test_committed_result_path_reads_the_newest_file_and_plots_it(tmp_path):
    assert committed_spec_result("smollm2-135m", tmp_path) is None
    payload = {"command": "bench_spec.py", "machine": {"cpu": "AMD EPYC", "torch_threads": 2}, "draft": "smollm2-draft",
               "rows": _bench_rows(), "hf": {"chat": {"hf": {"tok_s": 20.0}}}}  # fmt: skip
    for date in ("2026-11-30", "2026-12-02"):
        (tmp_path / f"spec-smollm2-135m-{date}-cpu-2t.json").write_text(json.dumps(payload))
    (tmp_path / "spec-tiny-shakespeare-8m-2026-12-09-cpu-2t.json").write_text(json.dumps(payload))
    newest = committed_spec_result("smollm2-135m", tmp_path)
    assert newest.name == "spec-smollm2-135m-2026-12-02-cpu-2t.json"
    bench = load_spec_results(newest)
    assert (bench["model"], bench["date"], bench["draft"]) == ("smollm2-135m", "2026-12-02", "smollm2-draft")
    source = f"{bench['model']}, {bench['machine']['cpu']}, {bench['date']}"
    k_fig = spec_k_figure(bench["rows"], source)
    assert len([t for t in k_fig.data if t.showlegend is not False]) == 4  # 2 workloads × 2 proposers
    assert "2026-12-02" in k_fig.layout.title.text
    batch_fig = spec_batch_figure(bench["rows"], source)
    assert [list(t.x) for t in batch_fig.data] == [[1, 4, 16]] * 4
    for fig in (k_fig, batch_fig):
        assert not layout_problems(fig)
    with pytest.raises(ValueError, match="rows"):
        load_spec_results({"rows": []})
    with pytest.raises(ValueError, match="k = 3"):
        spec_batch_figure(bench["rows"], source, k=3)


def test_the_committed_benchmark_if_present_has_what_the_chapter_reads():
    path = committed_spec_result("smollm2-135m")
    if path is None:
        pytest.skip("no committed spec-smollm2-135m-*.json yet: the chapter measures the tiny pair instead")
    bench = load_spec_results(path)
    assert bench["date"] and bench["machine"]
    spec_k_figure(bench["rows"], "x")
    spec_batch_figure(bench["rows"], "x")


# ---- distillation ---------------------------------------------------------------------------------------


def _training_json(variant: str) -> dict:
    metrics = {
        "init": dict(acceptance_rate=0.2, mean_accepted_length=0.6, forward_passes_per_token=0.8, heldout_ppl=90.0,
                     top1_agreement=0.3),
        "data": dict(acceptance_rate=0.35, mean_accepted_length=1.1, forward_passes_per_token=0.6, heldout_ppl=40.0,
                     top1_agreement=0.45),
        "distill": dict(acceptance_rate=0.45, mean_accepted_length=1.5, forward_passes_per_token=0.5, heldout_ppl=38.0,
                        top1_agreement=0.55),
    }  # fmt: skip
    return {"name": "smollm2-draft" if variant == "distill" else "smollm2-draft-data", "variant": variant,
            "experiment": {"k": 4, "prompts": ["a", "b"], "init": metrics["init"],
                           "variants": {"data": metrics["data"], "distill": metrics["distill"]}}}  # fmt: skip


def test_smollm2_draft_records_absent_and_present(tmp_path):
    assert smollm2_draft_records(tmp_path) is None
    for variant, name in (("distill", "smollm2-draft"), ("data", "smollm2-draft-data")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "training.json").write_text(json.dumps(_training_json(variant)))
    records = smollm2_draft_records(tmp_path)
    assert list(records["rows"]) == ["initialisation (untrained)", "data alone", "distilled"]
    assert records["rows"]["distilled"]["acceptance_rate"] == 0.45
    assert records["source"].startswith("data/smollm2-draft/training.json")
    fig = distill_figure(records["rows"], records["source"])
    assert [t.name for t in fig.data] == list(records["rows"])
    assert not layout_problems(fig)
    # a record without the experiment block: the two files' own figures
    for variant, name in (("distill", "smollm2-draft"), ("data", "smollm2-draft-data")):
        flat = _training_json(variant)["experiment"]["variants"][variant]
        (tmp_path / name / "training.json").write_text(json.dumps({"variant": variant, **flat}))
    rows = smollm2_draft_records(tmp_path)["rows"]
    assert list(rows) == ["data alone", "distilled"] and rows["data alone"]["top1_agreement"] == 0.45


def test_smollm2_draft_records_of_this_checkout_if_present():
    records = smollm2_draft_records()
    if records is None:
        pytest.skip("data/smollm2-draft is not in this checkout: the chapter runs the tiny experiment only")
    assert records["rows"] and not layout_problems(distill_figure(records["rows"], records["source"]))


def test_distillation_helpers(tmp_path):
    from minillm.speculative.distill import (
        agreement,
        data_loss,
        distill_loss,
        load_hf,
        num_trainable,
        save_draft,
        teacher_topk,
        token_windows,
        train_draft,
        truncated_draft,
    )

    draft = truncated_draft(TARGET, layers=1)
    teacher = load_hf(TARGET)
    assert draft.config.num_hidden_layers == 1 and not draft.model.embed_tokens.weight.requires_grad
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()  # tied, shared
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, teacher.model.layers[0].mlp.up_proj.weight)
    assert num_trainable(draft) < sum(p.numel() for p in draft.parameters())
    with pytest.raises(ValueError, match="layers=9"):
        truncated_draft(TARGET, layers=9)
    windows = token_windows(list(range(100, 400)), 32)
    assert windows.shape == (9, 32)
    topk = teacher_topk(teacher, windows[:4], k=8)
    assert topk.indices.shape == (4, 32, 8) and torch.allclose(topk.probs.sum(-1), torch.ones(4, 32))
    assert 0 < topk.mass <= 1
    logits = torch.randn(2, 5, 4096)
    x = torch.randint(0, 4096, (2, 5))
    assert math.isclose(float(data_loss(logits, x)), float(torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 4096), x[:, 1:].reshape(-1))), rel_tol=1e-5)  # fmt: skip
    one_hot = torch.zeros(2, 5, 1, dtype=torch.long) + x[..., None]
    assert math.isclose(float(distill_loss(logits, one_hot, torch.ones(2, 5, 1))), float(
        -logits.log_softmax(-1).gather(-1, x[..., None]).mean()), rel_tol=1e-5)  # fmt: skip
    a = train_draft(draft, windows[:4], "distill", topk, steps=2, batch=2)
    b = train_draft(draft, windows[:4], "distill", topk, steps=2, batch=2)
    assert a.curve == b.curve and len(a.curve) == 2  # same seed, same batches
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, draft.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(a.model.embed_tokens.weight, draft.model.embed_tokens.weight)  # frozen
    with pytest.raises(ValueError, match="loss="):
        train_draft(draft, windows, "kl")
    with pytest.raises(ValueError, match="topk"):
        train_draft(draft, windows, "distill")
    scores = agreement(a, teacher, windows[4:6])
    assert set(scores) == {"top1_agreement", "overlap", "heldout_loss"}
    assert 0 <= scores["top1_agreement"] <= 1 and 0 < scores["overlap"] <= 1
    folder = save_draft(a, tmp_path / "draft", TARGET)
    spec = {"method": "draft", "model": str(folder), "num_speculative_tokens": 2}
    out = LLM(TARGET, dtype="fp32", speculative_config=spec).generate(
        PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    plain = LLM(TARGET, dtype="fp32").generate(PROMPTS[0], SamplingParams(max_tokens=8, ignore_eos=True))
    assert out[0].token_ids == plain[0].token_ids and out[0].metrics.spec_proposed > 0
