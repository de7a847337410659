"""Where the suite's time went, from the JUnit report ``make test`` writes (``.cache/test-report*.xml``).

    python tests/durations.py .cache/test-report-workers.xml [more.xml ...] [--write]

prints the 30 slowest tests and each module's total, as markdown (``docs/test-time.md`` keeps
the last measured run's). ``--write`` also refreshes ``tests/durations.json``, the seconds per
test that ``conftest.py`` orders the two workers' work by (longest first). A stale file only
changes the order, never what runs.
"""

from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
KEPT_S = 1.0  # tests faster than this are left out of durations.json (conftest assumes 0.5 s)


def read(paths: list[str]) -> dict[str, float]:
    """Seconds per test node id (setup + call + teardown), from JUnit reports."""
    seconds: dict[str, float] = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            module = case.get("classname", "").split(".")
            # pytest writes tests/test_x.py::Class::name as classname "tests.test_x.Class", name "name"
            parts = [p for p in module]
            for split in range(len(parts), 0, -1):
                candidate = HERE.parent / ("/".join(parts[:split]) + ".py")
                if candidate.is_file():
                    nodeid = "::".join(["/".join(parts[:split]) + ".py", *parts[split:], case.get("name", "")])
                    seconds[nodeid] = seconds.get(nodeid, 0.0) + float(case.get("time", 0) or 0)
                    break
    return seconds


def table(seconds: dict[str, float], top: int = 30) -> str:
    lines = ["| seconds | test |", "|---:|---|"]
    for nodeid, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {s:.1f} | `{nodeid}` |")
    modules: dict[str, float] = collections.defaultdict(float)
    for nodeid, s in seconds.items():
        modules[nodeid.split("::")[0]] += s
    lines += ["", "| seconds | module |", "|---:|---|"]
    for module, s in sorted(modules.items(), key=lambda kv: -kv[1]):
        if s >= 10:
            lines.append(f"| {s:.0f} | `{module}` |")
    lines.append(f"\n{len(seconds)} tests, {sum(seconds.values()):.0f} s of test time in all (both workers together).")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    paths = [a for a in argv if a != "--write"]
    if not paths:
        print(__doc__)
        return 2
    seconds = read(paths)
    print(table(seconds))
    if "--write" in argv:
        kept = {k: round(v, 1) for k, v in sorted(seconds.items()) if v >= KEPT_S}
        (HERE / "durations.json").write_text(json.dumps(kept, indent=0, sort_keys=True) + "\n")
        print(f"\nwrote {len(kept)} tests to tests/durations.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
