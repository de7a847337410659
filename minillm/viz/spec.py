"""Chapter 08's figures: what speculative decoding proposes, keeps, and what that is worth.

- ``expected_tokens_per_pass`` / ``modelled_speedup``: the arithmetic of speculation with a
  per-token acceptance probability α, k proposals and a draft costing c of a target pass
  (Leviathan et al., 2023), and ``speculation_figure`` / ``speculation_explorer`` to see it;
- ``verify_pass_times``: a roofline cost model of one target pass over 1 … n positions — why
  verifying k proposals costs about as much as decoding one token, until it does not;
- ``trace_speculation`` records, for a real run, every verify pass of every request (what the
  draft proposed, what the target emitted) through a recorder on hook ``verify``
  (``minillm.hooks``) — the engine's own rule still decides — and ``spec_timeline`` shows the text coloured by each
  token's fate, pass by pass; ``spec_steps_figure`` the same as bars;
- ``virtual_speculation`` runs the engine on a virtual clock (``StepCost`` per pass, for the
  target and for the draft), so a speed-up is the same on every machine;
  ``spec_k_figure`` / ``spec_batch_figure`` plot rows of such runs or of a committed
  ``benchmarks/bench_spec.py`` result (``committed_spec_result``, ``load_spec_results``);
- ``distill_rows`` / ``distill_figure``: the distillation experiment's drafts side by side.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import minillm.hooks as hooks

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"  # in a checkout of the repository

# The fate of an emitted token, and its colour everywhere in this chapter.
COLORS = {
    "accepted": "#7fc97f",  # a proposal the target kept
    "correction": "#fdae61",  # the target's own token where a proposal was rejected
    "bonus": "#80b1d3",  # the target's extra token after all proposals were kept
    "plain": "#d9d9d9",  # a step without proposals (the prefill's token, plain decodes)
    "rejected": "#e7298a",  # a proposal the target did not keep (never emitted)
}
LABELS = {
    "accepted": "accepted proposal",
    "correction": "target's token (a proposal was rejected)",
    "bonus": "target's bonus token (all kept)",
    "plain": "plain step (no proposals)",
    "rejected": "rejected proposal",
}


# ---- the arithmetic -------------------------------------------------------------------------------


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Tokens one target pass emits on average when each of ``k`` proposals is accepted with
    probability ``alpha`` (independently, and only while all before it were):
    ``1 + α + α² + … + α^k = (1 − α^(k+1)) / (1 − α)``."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha={alpha} must be in [0, 1]")
    if k < 0:
        raise ValueError(f"k={k} must be >= 0")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def modelled_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Speed-up over plain decoding when a draft pass costs ``cost_ratio`` of a target pass and
    a verify pass costs what a plain one does (small batches): tokens per pass ÷ (1 + k·c)."""
    if cost_ratio < 0:
        raise ValueError(f"cost_ratio={cost_ratio} must be >= 0")
    return expected_tokens_per_pass(alpha, k) / (1 + k * cost_ratio)


def best_k(alpha: float, cost_ratio: float, max_k: int = 16) -> int:
    """The k (0 … ``max_k``) with the largest ``modelled_speedup``."""
    return max(range(max_k + 1), key=lambda k: modelled_speedup(alpha, k, cost_ratio))


def speculation_figure(alphas=(0.5, 0.7, 0.8, 0.9), cost_ratio: float = 0.1, max_k: int = 10, highlight=None):
    """Left: tokens per target pass against k, one curve per α. Right: the modelled speed-up
    with a draft costing ``cost_ratio`` of a target pass; each curve's best k is marked."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import minillm.viz.style as style

    ks = list(range(max_k + 1))
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("tokens per target pass", f"speed-up, draft pass = {cost_ratio:.2f} × target")
    )
    palette = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02"]
    for i, alpha in enumerate(alphas):
        color = palette[i % len(palette)]
        width = 4 if highlight is not None and abs(alpha - highlight) < 1e-9 else 2
        name = f"α = {alpha:.2f}"
        fig.add_trace(
            go.Scatter(
                x=ks,
                y=[round(expected_tokens_per_pass(alpha, k), 4) for k in ks],
                mode="lines+markers",
                name=name,
                legendgroup=name,
                line=dict(color=color, width=width),
                hovertemplate="k = %{x}: %{y:.2f} tokens per pass<extra>" + name + "</extra>",
            ),
            row=1,
            col=1,
        )
        speed = [round(modelled_speedup(alpha, k, cost_ratio), 4) for k in ks]
        best = best_k(alpha, cost_ratio, max_k)
        fig.add_trace(
            go.Scatter(
                x=ks,
                y=speed,
                mode="lines",
                name=name,
                legendgroup=name,
                showlegend=False,
                line=dict(color=color, width=width),
                hovertemplate="k = %{x}: %{y:.2f}× <extra>" + name + "</extra>",
            ),
            row=1,
            col=2,
        )
        fig.add_trace(
            go.Scatter(
                x=[best],
                y=[speed[best]],
                mode="markers",
                marker=dict(color=color, size=11, symbol="star"),
                name=name,
                legendgroup=name,
                showlegend=False,
                hovertemplate=f"best k for α = {alpha:.2f}: {best} ({speed[best]:.2f}×)<extra></extra>",
            ),
            row=1,
            col=2,
        )
    fig.add_hline(y=1, line=dict(color="#999", dash="dot"), row=1, col=2)
    fig.update_xaxes(title_text="k (proposals per step)", dtick=2)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="× plain decoding", rangemode="tozero", row=1, col=2)
    title, height = "Speculation on paper: (1 − α^(k+1)) / (1 − α) tokens per pass, ÷ (1 + k·c) for the draft", 400
    fig.update_annotations(font_size=14)
    fig.update_layout(
        template="plotly_white",
        height=height,
        title=style.title(title),
        legend=style.legend_under_title(title, height),
        margin=dict(l=70, r=20, t=style.top_margin(title, legend=True, extra=style.LINE * 14 + 4), b=style.X_AXIS),
    )
    return fig


def speculation_explorer(alphas=(0.5, 0.7, 0.8, 0.9)):
    """``speculation_figure`` with a slider for the draft's cost ratio c and one for an α of
    your own (drawn thick next to the others)."""
    import ipywidgets as w

    from minillm.viz.display import FigureBox, figure_widget

    cost = w.FloatSlider(value=0.1, min=0.0, max=0.5, step=0.01, description="draft cost c", readout_format=".2f")
    mine = w.FloatSlider(value=0.6, min=0.05, max=0.98, step=0.01, description="your α", readout_format=".2f")

    def build():
        chosen = sorted({*alphas, round(mine.value, 2)})
        return speculation_figure(chosen, cost.value, highlight=round(mine.value, 2))

    figure = figure_widget(build())

    def update(*_):
        fresh = build()
        with figure.batch_update():
            figure.data = ()
            figure.add_traces(list(fresh.data))
            figure.layout.annotations = fresh.layout.annotations
            figure.layout.shapes = fresh.layout.shapes

    cost.observe(update, "value")
    mine.observe(update, "value")
    return FigureBox([w.HBox([cost, mine]), figure], figure=figure, description="speculation on paper")


# ---- the cost of a verify pass ------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """A roofline: memory bandwidth and matmul rate (``minillm.viz.roofline`` measures them)."""

    name: str
    bandwidth_gbs: float
    tflops: float

    @property
    def ridge(self) -> float:
        return self.tflops * 1e12 / (self.bandwidth_gbs * 1e9)


def verify_pass_times(config, machine: Machine, positions, batch: int = 1, context: int = 256, dtype_bytes: float = 2):
    """Modelled seconds of one target pass over ``batch`` sequences × ``positions`` tokens each
    (a decode is 1 position, a verify pass of k proposals k + 1): the roofline's
    ``max(bytes / bandwidth, FLOPs / peak)`` with ``roofline.step_cost``'s FLOPs and bytes."""
    from minillm.viz.roofline import step_cost

    out = []
    for n in positions:
        flops, nbytes = step_cost(config, dtype_bytes, n * batch, batch, context)
        out.append(max(nbytes / (machine.bandwidth_gbs * 1e9), flops / (machine.tflops * 1e12)))
    return out


# ---- recording a real run -------------------------------------------------------------------------


@dataclass
class SpecStep:
    """One target pass of one request: the proposals it verified and the tokens it appended."""

    start: int  # the output position of its first token
    drafts: list[int]  # the proposals verified ([]: a plain step)
    emitted: list[int]  # the tokens appended (stop strings and max_tokens may cut the verdict)
    verdict: list[int] = field(default_factory=list)  # what the acceptance rule returned

    @property
    def accepted(self) -> int:
        n = 0
        while n < min(len(self.drafts), len(self.verdict)) and self.drafts[n] == self.verdict[n]:
            n += 1
        return n

    def fates(self) -> list[str]:
        """The fate of each emitted token: accepted, correction, bonus or plain."""
        if not self.drafts:
            return ["plain"] * len(self.emitted)
        last = "bonus" if self.accepted == len(self.drafts) else "correction"
        fates = ["accepted"] * self.accepted + [last]
        return fates[: len(self.emitted)]

    @property
    def rejected(self) -> list[int]:
        return self.drafts[self.accepted :] if self.drafts else []


@dataclass
class SpecTrace:
    """Every pass of every request of one run, and what is needed to show it as text."""

    prompts: list[str]
    outputs: list  # RequestOutput, in prompt order
    steps: dict[Hashable, list[SpecStep]]
    tokenizer: object
    k: int

    def request_steps(self, request: int) -> list[SpecStep]:
        return self.steps[self.outputs[request].request_id]

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def summary(self, request: int) -> dict:
        steps = self.request_steps(request)
        verify = [s for s in steps if s.drafts]
        proposed = sum(len(s.drafts) for s in verify)
        accepted = sum(s.accepted for s in verify)
        tokens = sum(len(s.emitted) for s in steps)
        return {
            "passes": len(steps),
            "tokens": tokens,
            "proposed": proposed,
            "accepted": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "tokens_per_pass": tokens / len(steps) if steps else None,
        }


def trace_speculation(llm, prompts, params) -> SpecTrace:
    """Generate ``prompts`` with ``llm`` (an ``LLM`` built with ``speculative_config``) and record
    each request's passes: a recorder on hook ``verify`` sees this engine's verdicts for the run
    (whatever rule is installed decides them), so the engine runs unchanged. Steps without
    proposals (the prefill's token, plain decodes) are the tokens no verify pass emitted."""
    speculator = llm.engine.speculator
    if not hasattr(speculator, "k"):
        raise ValueError("trace_speculation needs an LLM built with speculative_config")
    seen: dict[Hashable, list[tuple[int, list[int], list[int]]]] = {}
    rule = hooks.current("verify")

    def verify(verifier, seq, drafts, logits):
        verdict = rule(verifier, seq, drafts, logits)
        if verifier is speculator:  # another engine's passes are not this trace's
            seen.setdefault(seq.request_id, []).append((len(seq.output_token_ids), list(drafts), list(verdict)))
        return verdict

    with hooks.override(verify=verify):
        outputs = llm.generate(prompts, params)
    steps = {}
    for out in outputs:
        tokens, records = out.token_ids, {start: (d, v) for start, d, v in seen.get(out.request_id, [])}
        pos, rows = 0, []
        while pos < len(tokens):
            if pos in records:
                drafts, verdict = records[pos]
                emitted = tokens[pos : pos + len(verdict)]
                rows.append(SpecStep(pos, drafts, emitted, verdict))
            else:
                emitted = tokens[pos : pos + 1]
                rows.append(SpecStep(pos, [], emitted, list(emitted)))
            pos += len(emitted)
        steps[out.request_id] = rows
    prompts_text = [p if isinstance(p, str) else llm.tokenizer.decode(list(p)) for p in prompts]
    return SpecTrace(prompts_text, outputs, steps, llm.tokenizer, speculator.k)


# ---- the timeline: the text, coloured by each token's fate --------------------------------------


def _token_html(text: str, style: str, title: str) -> str:
    shown = html.escape(text).replace("\n", "↵\n")
    return f'<span title="{html.escape(title)}" style="{style}">{shown}</span>'


def _legend_html() -> str:
    parts = []
    for fate in ("accepted", "correction", "bonus", "plain"):
        parts.append(
            _token_html(LABELS[fate], f"background-color:{COLORS[fate]};padding:0 3px;border-radius:3px", fate)
        )
    parts.append(
        f'<s style="color:{COLORS["rejected"]}">{html.escape(LABELS["rejected"])}</s> (shown after the token that '
        "replaced it, never emitted)"
    )
    return " ".join(parts)


def spec_text_html(trace: SpecTrace, request: int = 0, upto: int | None = None, current: int | None = None) -> str:
    """The request's prompt and output as HTML: each token on its fate's colour, passes
    separated by a thin bar, rejected proposals struck through after the token that replaced
    them. ``upto``: show the first ``upto`` passes; ``current``: outline that pass (1-based)."""
    steps = trace.request_steps(request)
    upto = len(steps) if upto is None else upto
    parts = [f'<span style="color:#777">{html.escape(trace.prompts[request]).replace(chr(10), "↵" + chr(10))}</span>']
    for n, step in enumerate(steps[:upto], start=1):
        tokens = []
        for token, fate in zip(step.emitted, step.fates()):
            tokens.append(
                _token_html(
                    trace.token_text(token), f"background-color:{COLORS[fate]};border-radius:2px", f"pass {n}: {fate}"
                )
            )
            if fate == "correction":
                rejected = "".join(trace.token_text(t) for t in step.rejected)
                tokens.append(
                    f'<s style="color:{COLORS["rejected"]};font-size:80%" title="pass {n}: rejected">'
                    f"{html.escape(rejected).replace(chr(10), '↵')}</s>"
                )
        outline = ";outline:2px solid #333" if current == n else ""
        parts.append(f'<span style="border-left:2px solid #999;padding-left:1px{outline}">{"".join(tokens)}</span>')
    body = "".join(parts)
    return (
        f'<div style="font-family:monospace;font-size:13px;line-height:1.9;white-space:pre-wrap;max-width:880px">'
        f"{body}</div>"
    )


def _pass_caption(trace: SpecTrace, request: int, n: int) -> str:
    steps = trace.request_steps(request)
    step = steps[n - 1]

    def q(tokens):
        return " ".join(f"‘{html.escape(trace.token_text(t))}’".replace("\n", "↵") for t in tokens) or "nothing"

    if not step.drafts:
        what = "the prompt's prefill" if step.start == 0 else "a plain decode (nothing proposed)"
        return f"pass {n} of {len(steps)}: {what} → {q(step.emitted)}"
    head = f"pass {n} of {len(steps)}: the draft proposed {q(step.drafts)}; the target kept {step.accepted}"
    if step.accepted == len(step.drafts):
        return f"{head} and added {q(step.verdict[-1:])} (bonus) — {len(step.verdict)} tokens for one pass"
    return f"{head}, rejected {q(step.drafts[step.accepted : step.accepted + 1])} and wrote {q(step.verdict[-1:])}"


def _summary_html(trace: SpecTrace, request: int) -> str:
    s = trace.summary(request)
    rate = "–" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.0%}"
    return (
        f"<b>request {request}</b>: {s['tokens']} tokens in {s['passes']} passes of the target "
        f"({s['tokens_per_pass']:.2f} per pass); {s['accepted']} of {s['proposed']} proposals accepted ({rate})"
    )


def spec_timeline_html(trace: SpecTrace, request: int = 0) -> str:
    """The whole run of one request, with its summary and a legend: the timeline's static copy."""
    return f"<div>{_summary_html(trace, request)}<br>{_legend_html()}{spec_text_html(trace, request)}</div>"


def spec_timeline(trace: SpecTrace, request: int = 0):
    """A widget: a request's text coloured by each token's fate, and a slider that replays it
    pass by pass (the caption says what the draft proposed and what the target kept). Displayed,
    it also carries the whole run as static HTML for a notebook opened without its kernel."""
    import ipywidgets as w

    from minillm.viz.display import HTMLBox

    choose = w.Dropdown(
        options=[(f"request {i}", i) for i in range(len(trace.outputs))], value=request, description="show"
    )
    steps = trace.request_steps(request)
    slider = w.IntSlider(value=len(steps), min=1, max=len(steps), description="pass", continuous_update=True)
    caption = w.HTML()
    text = w.HTML()
    head = w.HTML()

    def render(*_):
        r = choose.value
        head.value = f"{_summary_html(trace, r)}<br>{_legend_html()}"
        caption.value = _pass_caption(trace, r, slider.value)
        text.value = spec_text_html(trace, r, upto=slider.value, current=slider.value)

    def switch(*_):
        n = len(trace.request_steps(choose.value))
        slider.max = n
        slider.value = n
        render()

    choose.observe(switch, "value")
    slider.observe(render, "value")
    render()
    controls = [w.HBox([choose, slider])] if len(trace.outputs) > 1 else [slider]
    return HTMLBox(
        [*controls, head, caption, text],
        static_html=spec_timeline_html(trace, request),
        description=f"speculation timeline (request {request})",
    )


def spec_steps_figure(trace: SpecTrace, request: int = 0):
    """One bar per target pass of a request: the proposals it kept, its own token (bonus or
    correction) and the proposals it rejected, stacked."""
    import plotly.graph_objects as go

    import minillm.viz.style as style

    steps = trace.request_steps(request)
    x = list(range(1, len(steps) + 1))
    series = {
        "accepted": [s.accepted if s.drafts else 0 for s in steps],
        "bonus": [int("bonus" in s.fates()) for s in steps],
        "correction": [int("correction" in s.fates()) for s in steps],
        "plain": [len(s.emitted) if not s.drafts else 0 for s in steps],
        "rejected": [len(s.rejected) for s in steps],
    }
    fig = go.Figure()
    for fate, ys in series.items():
        fig.add_trace(
            go.Bar(
                x=x,
                y=ys,
                name=LABELS[fate].split(" (")[0],
                marker_color=COLORS[fate],
                marker_pattern_shape="/" if fate == "rejected" else "",
                hovertemplate="pass %{x}: %{y} " + fate + "<extra></extra>",
            )
        )
    s = trace.summary(request)
    rate = "–" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.0%}"
    title = (
        f"Request {request}: {s['tokens']} tokens in {s['passes']} target passes, k = {trace.k}<br>"
        f"{s['accepted']} of {s['proposed']} proposals accepted ({rate}); rejected ones hatched"
    )
    height = 380
    fig.update_layout(
        template="plotly_white",
        barmode="stack",
        height=height,
        title=style.title(title),
        legend=style.legend_under_title(title, height),
        xaxis=dict(title="target pass"),
        yaxis=dict(title="tokens", dtick=1),
        bargap=0.15,
        margin=dict(l=70, r=20, t=style.top_margin(title, legend=True), b=style.X_AXIS),
    )
    return fig


# ---- measured: on a virtual clock, or from a committed benchmark --------------------------------


def virtual_speculation(llm, prompts, params, target_cost, draft_cost=None) -> dict:
    """Run ``prompts`` through ``llm`` on a virtual clock: every target pass takes
    ``target_cost(tokens in it)``, every pass of the draft model ``draft_cost(tokens)``; the
    engine's decisions and tokens are real. Returns the row of ``bench_spec.py``'s shape
    (without speed-up): ``seconds`` and ``tok_s`` in simulated time."""
    engine = llm.engine
    if draft_cost is None and getattr(engine.speculator, "draft", None) is not None:
        raise ValueError("a draft-model proposer needs draft_cost")
    with engine.simulated_time(target_cost, draft_cost) as clock:
        outs = llm.generate(prompts, params)
    tokens = sum(len(o.token_ids) for o in outs)
    m = [o.metrics for o in outs]
    proposed, accepted = sum(x.spec_proposed for x in m), sum(x.spec_accepted for x in m)
    steps = sum(x.num_verify_steps for x in m)
    passes = sum(x.num_forward_passes for x in m)
    return {
        "seconds": clock.now,
        "output_tokens": tokens,
        "tok_s": tokens / clock.now,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_length": accepted / steps if steps else None,
        "forward_passes_per_token": passes / tokens,
        "spec_proposed": proposed,
        "spec_accepted": accepted,
        "num_verify_steps": steps,
        "forward_passes": passes,
        "token_ids": [o.token_ids for o in outs],
    }


def tiny_workloads(tokenizer=None, n: int = 4) -> dict[str, list[str]]:
    """Two workloads for the tiny Shakespeare models, from held-out text they never trained on:
    ``free`` (continue a speech: only a model can guess) and ``grounded`` (a passage given
    twice: the second copy can be looked up in the prompt) — ``bench_spec.py``'s tiny-model ones."""
    from minillm.assets import heldout_text

    lines = heldout_text().split("\n\n")
    return {
        "free": [lines[3 * i + 1][:200] for i in range(n)],
        "grounded": [(lines[3 * i + 2][:300] + "\n\n") * 2 for i in range(n)],
    }


def committed_spec_result(model: str = "smollm2-135m", folder: str | Path = RESULTS_DIR) -> Path | None:
    """The newest committed ``bench_spec.py`` result for ``model`` (``spec-<model>-<date>-*.json``),
    or None if there is none."""
    found = sorted(Path(folder).glob(f"spec-{model}-[0-9]*.json"))
    return found[-1] if found else None


def load_spec_results(results) -> dict:
    """A ``bench_spec.py`` result — a path to its JSON, or the loaded dict — with what its file
    name says (``spec-<model>-<date>-<device>-<threads>t.json``) as ``model`` and ``date``."""
    source = None
    if isinstance(results, (str, Path)):
        source = Path(results)
        results = json.loads(source.read_text())
    if not isinstance(results, dict) or not results.get("rows"):
        raise ValueError("expected a bench_spec.py result: a JSON object with a non-empty 'rows' list")
    out = dict(results)
    match = re.fullmatch(r"spec-(.+)-(\d{4}-\d{2}-\d{2})-(.+)\.json", source.name) if source else None
    out.setdefault("model", match.group(1) if match else None)
    out.setdefault("date", match.group(2) if match else None)
    out.setdefault("machine", {})
    return out


def machine_words(machine: dict) -> str:
    parts = [machine.get("cpu") or machine.get("gpu") or machine.get("device") or "unknown machine"]
    if machine.get("torch_threads"):
        parts.append(f"{machine['torch_threads']} threads")
    return ", ".join(parts)


def _series(rows, key_filter) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r.get("proposer") in (None, "none") or not key_filter(r):
            continue
        out.setdefault((r["workload"], r["proposer"]), []).append(r)
    return out


def _wrap(text: str, width: int = 90) -> str:
    """``text`` broken into title lines of at most ``width`` characters (at spaces)."""
    import textwrap

    return "<br>".join(textwrap.wrap(text, width)) or text


_DASH = {"ngram": "dash", "draft": "solid"}
_WORKLOAD_COLORS = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a"]


def spec_k_figure(rows: list[dict], source: str):
    """Batch-1 rows against k: speed-up (left) and tokens per target pass (right), one line per
    workload × proposer. ``source`` (a line of the title) says where the numbers come from."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import minillm.viz.style as style

    series = _series(rows, lambda r: r.get("batch") == 1 and r.get("k"))
    if not series:
        raise ValueError("no batch-1 rows with a proposer and k")
    workloads = sorted({w for w, _ in series})
    fig = make_subplots(rows=1, cols=2, subplot_titles=("speed-up over plain decoding", "tokens per target pass"))
    for (workload, proposer), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["k"])
        color = _WORKLOAD_COLORS[workloads.index(workload) % len(_WORKLOAD_COLORS)]
        name = f"{workload}, {proposer}"
        line = dict(color=color, dash=_DASH.get(proposer, "dot"))
        fig.add_trace(
            go.Scatter(
                x=[r["k"] for r in rs],
                y=[round(r["speedup"], 3) for r in rs],
                mode="lines+markers",
                name=name,
                legendgroup=name,
                line=line,
                customdata=[[r.get("acceptance_rate") or 0] for r in rs],
                hovertemplate="k = %{x}: %{y:.2f}×, acceptance %{customdata[0]:.0%}<extra>" + name + "</extra>",
            ),
            row=1,
            col=1,
        )
        fig.add_trace(
            go.Scatter(
                x=[r["k"] for r in rs],
                y=[round(1 / r["forward_passes_per_token"], 3) for r in rs],
                mode="lines+markers",
                name=name,
                legendgroup=name,
                showlegend=False,
                line=line,
                hovertemplate="k = %{x}: %{y:.2f} tokens per pass<extra>" + name + "</extra>",
            ),
            row=1,
            col=2,
        )
    fig.add_hline(y=1, line=dict(color="#999", dash="dot"), row=1, col=1)
    fig.add_hline(y=1, line=dict(color="#999", dash="dot"), row=1, col=2)
    fig.update_xaxes(title_text="k (proposals per step)")
    fig.update_yaxes(title_text="×", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=1, col=2)
    title = f"Speculation against k, batch 1<br>{_wrap(source)}"
    height = 420
    fig.update_annotations(font_size=14)
    fig.update_layout(
        template="plotly_white",
        height=height,
        title=style.title(title, size=14),
        legend=style.legend_under_title(title, height, size=14),
        margin=dict(
            l=70, r=20, t=style.top_margin(title, legend=True, extra=style.LINE * 14 + 4, size=14), b=style.X_AXIS
        ),
    )
    return fig


def spec_batch_figure(rows: list[dict], source: str, k: int = 4):
    """Rows at ``k`` against the batch size: the speed-up over plain decoding at the same batch."""
    import plotly.graph_objects as go

    import minillm.viz.style as style

    series = _series(rows, lambda r: r.get("k") == k)
    if not series:
        raise ValueError(f"no rows with k = {k} and a proposer")
    workloads = sorted({w for w, _ in series})
    fig = go.Figure()
    for (workload, proposer), rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["batch"])
        color = _WORKLOAD_COLORS[workloads.index(workload) % len(_WORKLOAD_COLORS)]
        name = f"{workload}, {proposer}"
        fig.add_trace(
            go.Scatter(
                x=[r["batch"] for r in rs],
                y=[round(r["speedup"], 3) for r in rs],
                mode="lines+markers",
                name=name,
                line=dict(color=color, dash=_DASH.get(proposer, "dot")),
                hovertemplate="batch %{x}: %{y:.2f}×<extra>" + name + "</extra>",
            )
        )
    fig.add_hline(y=1, line=dict(color="#999", dash="dot"))
    batches = sorted({r["batch"] for rs in series.values() for r in rs})
    title = f"Speed-up against batch size, k = {k}<br>{_wrap(source)}"
    height = 400
    fig.update_layout(
        template="plotly_white",
        height=height,
        title=style.title(title, size=14),
        legend=style.legend_under_title(title, height, size=14),
        xaxis=dict(title="batch (sequences decoded together)", type="log", tickvals=batches),
        yaxis=dict(title="× plain decoding at that batch", rangemode="tozero"),
        margin=dict(l=70, r=20, t=style.top_margin(title, legend=True, size=14), b=style.X_AXIS),
    )
    return fig


# ---- distillation -------------------------------------------------------------------------------

DISTILL_METRICS = {
    "acceptance_rate": "acceptance in the engine",
    "top1_agreement": "top-1 agreement",
    "overlap": "overlap Σ min(p, q)",
}


def smollm2_draft_records(data: str | Path | None = None) -> dict | None:
    """The distillation experiment of ``data/recipes/distill_smollm2_draft.py`` as written into
    ``data/smollm2-draft/training.json`` (and its data-only twin ``smollm2-draft-data``), or
    None when the drafts are not there. Returns ``{"rows": {label: metrics}, "source": words,
    "experiment": the record's experiment}``."""
    from minillm.assets import data_dir

    folder = Path(data) if data is not None else data_dir()
    distilled = folder / "smollm2-draft" / "training.json"
    if not distilled.is_file():
        return None
    record = json.loads(distilled.read_text())
    experiment = record.get("experiment") or {}
    variants = dict(experiment.get("variants") or {})
    twin = folder / "smollm2-draft-data" / "training.json"
    if "data" not in variants and twin.is_file():
        other = json.loads(twin.read_text())
        variants["data"] = (other.get("experiment") or {}).get("variants", {}).get("data") or other
    if "distill" not in variants:
        variants["distill"] = record
    labels = {"init": "initialisation (untrained)", "data": "data alone", "distill": "distilled"}
    rows = {}
    if experiment.get("init"):
        rows[labels["init"]] = experiment["init"]
    for key in ("data", "distill"):
        if key in variants:
            rows[labels[key]] = variants[key]
    rows = {
        label: {
            m: float(v[m]) for m in (*DISTILL_METRICS, "mean_accepted_length", "heldout_ppl") if v.get(m) is not None
        }
        for label, v in rows.items()
    }
    when = record.get("date") or _git_date(distilled)
    machine = record.get("machine")
    where = machine_words(machine) if isinstance(machine, dict) else (machine or "")
    source = "data/smollm2-draft/training.json" + "".join(f", {x}" for x in (where, when) if x)
    return {"rows": rows, "source": source, "experiment": experiment, "record": record}


def _git_date(path: Path) -> str | None:
    """The date the file was last committed, if this is a git checkout and it is committed."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%cs", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def distill_figure(rows: dict[str, dict], source: str):
    """Grouped bars: each draft's acceptance in the engine, top-1 agreement and distribution
    overlap with the target (the metrics a row has)."""
    import plotly.graph_objects as go

    import minillm.viz.style as style

    metrics = [m for m in DISTILL_METRICS if any(m in r for r in rows.values())]
    if not metrics:
        raise ValueError(f"no draft has any of {list(DISTILL_METRICS)}")
    palette = {"initialisation": "#bdbdbd", "data": "#80b1d3", "distilled": "#fb8072"}
    fig = go.Figure()
    for label, r in rows.items():
        color = next((c for key, c in palette.items() if label.startswith(key)), "#8da0cb")
        fig.add_trace(
            go.Bar(
                x=[DISTILL_METRICS[m] for m in metrics],
                y=[round(r.get(m, 0.0), 4) for m in metrics],
                name=label,
                marker_color=color,
                text=[f"{r[m]:.0%}" if m in r else "" for m in metrics],
                textposition="outside",
                hovertemplate="%{x}: %{y:.1%}<extra>" + label + "</extra>",
            )
        )
    title = f"Which draft agrees with the target?<br>{_wrap(source)}"
    height = 400
    fig.update_layout(
        template="plotly_white",
        barmode="group",
        height=height,
        title=style.title(title, size=14),
        legend=style.legend_under_title(title, height, size=14),
        yaxis=dict(title="share", tickformat=".0%", range=[0, 1.08]),
        margin=dict(l=70, r=20, t=style.top_margin(title, legend=True, size=14), b=style.X_AXIS),
    )
    return fig
