"""How long the grader's fresh process takes to grade one small check: forked from the fork server
that has imported torch and the course (``minillm.course.isolated._Checker``, what ``grade`` uses),
against a new interpreter (``python -m minillm.course.isolated``, what it used before).

One check, chapter 01's ``check_next_token`` on a one-line solution, graded ``REPEATS`` times each
way in this one run; the fork server's first call (which starts the server) is printed apart. Run:

    python benchmarks/bench_grader_start.py
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from minillm.course.isolated import LearnerCell, run_checks
from minillm.machine import machine_description

REPEATS = 5
CELL = LearnerCell(1, "def next_token(logits):\n    return int(logits[-1].argmax())")


def forked() -> str:
    return run_checks([("check_next_token", [CELL])])["check_next_token"].status


def new_interpreter() -> str:
    read, write = os.pipe()
    payload = {"jobs": [["check_next_token", [[CELL.number, CELL.source]]]], "fd": write}
    child = subprocess.Popen([sys.executable, "-m", "minillm.course.isolated"], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, pass_fds=(write,))  # fmt: skip
    os.close(write)
    child.communicate(json.dumps(payload).encode())
    with os.fdopen(read) as verdicts:
        return json.loads(verdicts.readline())["status"]


def seconds(fn) -> list[float]:
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        assert fn() == "pass"
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    print(f"{machine_description(torch.device('cpu'))}; median of {REPEATS} gradings of one check")
    start = time.perf_counter()
    assert forked() == "pass"
    first = time.perf_counter() - start
    spawned, fork_server = seconds(new_interpreter), seconds(forked)
    print(f"new interpreter: {statistics.median(spawned):6.2f} s")
    print(f"fork server:     {statistics.median(fork_server):6.2f} s  (its first call, which starts the server: "
          f"{first:.2f} s)")  # fmt: skip
    print(f"ratio:           {statistics.median(spawned) / statistics.median(fork_server):6.1f}x")


if __name__ == "__main__":
    main()
