"""How much of the engine a learner writes: lines between ``### BEGIN SOLUTION`` and
``### END SOLUTION`` in every solved chapter (non-blank, non-comment), and the exercises' count.

    python benchmarks/course_lines.py

The course's targets (issue 45): at least 500 lines in all and 30 in every chapter 01-10.
"""

from __future__ import annotations

import json
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parents[1] / "solutions"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def learner_lines(notebook: Path) -> int:
    count, inside = 0, False
    for cell in json.loads(notebook.read_text())["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).splitlines():
            text = line.strip()
            if text in (BEGIN, END):
                inside = text == BEGIN
            elif inside and text and not text.startswith("#"):
                count += 1
    return count


def main() -> None:
    from minillm.course import EXERCISES

    total = 0
    print("| chapter | exercises | learner lines |\n|---|---:|---:|")
    for notebook in sorted(SOLUTIONS.glob("*.ipynb")):
        exercises = sum(e.chapter == notebook.stem for e in EXERCISES)
        lines = learner_lines(notebook)
        total += lines
        print(f"| {notebook.stem} | {exercises} | {lines} |")
    print(f"| all | {len(EXERCISES)} | {total} |")


if __name__ == "__main__":
    main()
