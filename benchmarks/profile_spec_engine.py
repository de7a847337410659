"""Where a speculative engine's time goes: ``torch.profiler``'s table of operations over one workload.

    python benchmarks/profile_spec_engine.py "eagle tree 4x2 k6 fixed"
    python benchmarks/profile_spec_engine.py "ngram k4" grounded

Builds the engine named (``bench_eagle_tree.ENGINES``: SmolLM2-135M bf16 as it ships, compiled),
waits for its compiled steps, runs both of ``bench_eagle_tree``'s workloads once to settle, then
profiles one run of the workload named (default: the 12 held-out chats, 64 new tokens each, one at a
time). Prints the tokens per second under the profiler, the last step's record and the operations by
self CPU time: our two operators (``minillm::linear_bf16_rows``, ``minillm::paged_decode``) show as
operations of their own, with their calls and average time; the compiled graph's generated code
does not. Profiling slows everything: compare two checkouts' tables, not their speeds with others'.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from bench_eagle_tree import build, run_once, workloads  # noqa: E402


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    name = args[0] if args else "eagle tree 4x2 k6 fixed"
    workload = {"chat": "chat (held out)", "grounded": "grounded"}.get(args[1] if len(args) > 1 else "chat")
    loads = workloads(12, 4)
    llm = build(name)
    llm.wait_for_fast_path()
    for prompts in loads.values():
        run_once(llm, prompts, 64)
    llm.engine.step_records.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds, outs = run_once(llm, loads[workload], 64)
    tokens = sum(len(o.token_ids) for o in outs)
    records = list(llm.engine.step_records)
    print(f"{name}, {workload}: {seconds:.2f} s under the profiler, {tokens} tokens, {tokens / seconds:.1f} tok/s, {len(records)} steps")
    print(records[-1])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
