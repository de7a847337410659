"""The optimisation workflow of chapter 10 as a small log: baseline → profile → one change →
benchmark → keep or revert.

Each trial builds an engine with the settings kept so far plus *one* change, replays the same
workload on a virtual clock (``engine/virtual_clock.py``: the real scheduler and model, time
from a cost model), and is kept only if it serves more requests within the SLO (goodput) — or
as many, with a p99 TTFT at least 5% lower. One change at a time, so each effect is its own;
a virtual clock, so the verdicts are the same on every machine and every run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minillm.engine import LLMEngine
from minillm.engine.virtual_clock import StepCost
from minillm.metrics import SLO, run_report
from minillm.tools.replay import virtual_replay


@dataclass
class Trial:
    name: str
    change: dict
    settings: dict
    summary: dict
    breakdown: dict
    kept: bool | None = None  # None: the baseline
    reason: str = ""


@dataclass
class TuningLog:
    model: str
    baseline: dict  # engine settings of the baseline
    workload: list
    cost: StepCost
    slo: SLO
    trials: list[Trial] = field(default_factory=list)

    @property
    def current(self) -> dict:
        """The settings kept so far."""
        settings = dict(self.baseline)
        for t in self.trials:
            if t.kept:
                settings |= t.change
        return settings

    @property
    def best(self) -> Trial:
        kept = [t for t in self.trials if t.kept is not False]
        return kept[-1]

    def measure(self, name: str, change: dict | None = None) -> Trial:
        """Replay the workload with the current settings plus ``change``; keep or revert it."""
        change = dict(change or {})
        settings = self.current | change
        engine = LLMEngine(self.model, **settings)
        outputs = virtual_replay(engine, self.workload, self.cost)
        report = run_report(outputs, engine.step_records, self.slo)
        trial = Trial(name, change, settings, report.summary(), step_breakdown(engine, self.cost))
        if self.trials:
            trial.kept, trial.reason = self.verdict(trial.summary, self.best.summary)
        else:
            trial.reason = "baseline"
        self.trials.append(trial)
        return trial

    @staticmethod
    def verdict(new: dict, old: dict) -> tuple[bool, str]:
        g_new, g_old = new["goodput_req_per_s"], old["goodput_req_per_s"]
        if g_new > g_old * 1.01:
            return True, f"goodput {g_old:.2f} → {g_new:.2f} req/s"
        if g_new < g_old * 0.99:
            return False, f"goodput {g_old:.2f} → {g_new:.2f} req/s"
        t_new, t_old = new["ttft_p99_s"], old["ttft_p99_s"]
        if t_new < 0.95 * t_old:
            return True, f"same goodput, p99 TTFT {t_old * 1e3:.0f} → {t_new * 1e3:.0f} ms"
        return False, f"same goodput, p99 TTFT {t_old * 1e3:.0f} → {t_new * 1e3:.0f} ms: no gain"

    def table(self) -> str:
        head = (f"{'trial':<30} {'goodput':>8} {'SLO met':>8} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
                f"{'TPOT p99':>9}  verdict")  # fmt: skip
        lines = [head, "-" * len(head)]
        for t in self.trials:
            s = t.summary
            verdict = "baseline" if t.kept is None else ("KEEP" if t.kept else "revert")
            lines.append(
                f"{t.name:<30} {s['goodput_req_per_s']:8.2f} {s['slo_attainment']:8.0%} {s['output_tok_per_s']:7.0f} "
                f"{s['ttft_p50_s'] * 1e3:7.0f}ms {s['ttft_p99_s'] * 1e3:7.0f}ms {s['tpot_p99_s'] * 1e3:7.1f}ms  "
                f"{verdict}: {t.reason}"
            )
        return "\n".join(lines)

    def figure(self):
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        names = [t.name for t in self.trials]
        colors = ["#888" if t.kept is None else ("#2a9d8f" if t.kept else "#e76f51") for t in self.trials]
        fig = make_subplots(rows=1, cols=2, subplot_titles=("goodput (req/s within the SLO)", "p99 TTFT (s)"))
        fig.add_trace(go.Bar(x=names, y=[t.summary["goodput_req_per_s"] for t in self.trials], marker_color=colors,
                             showlegend=False), row=1, col=1)  # fmt: skip
        fig.add_trace(go.Bar(x=names, y=[t.summary["ttft_p99_s"] for t in self.trials], marker_color=colors,
                             showlegend=False), row=1, col=2)  # fmt: skip
        fig.update_layout(height=360, margin=dict(t=40, b=10, l=40, r=10),
                          title="one change at a time (grey: baseline, green: kept, red: reverted)")  # fmt: skip
        return fig


def step_breakdown(engine, cost: StepCost) -> dict:
    """Where the (modelled) time went, from the engine's step records: the profile of a run."""
    records = list(engine.step_records)
    if not records:
        return {}
    prefill = [sum(n for _, _, n, is_decode in r.chunks if not is_decode) for r in records]
    decode = [sum(n for _, _, n, is_decode in r.chunks if is_decode) for r in records]
    total = sum(r.end - r.start for r in records)
    fixed = cost.overhead * len(records)
    return {
        "steps": len(records),
        "time_s": total,
        "fixed_overhead_share": fixed / total if total else 0.0,
        "prefill_token_share": cost.per_token * sum(prefill) / total if total else 0.0,
        "decode_token_share": cost.per_token * sum(decode) / total if total else 0.0,
        "mean_running": sum(r.num_running for r in records) / len(records),
        "mean_waiting": sum(r.num_waiting for r in records) / len(records),
        "steps_with_prefill": sum(1 for p in prefill if p) / len(records),
        "preemptions": sum(len(r.preempted) for r in records),
    }
