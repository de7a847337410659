"""Run one notebook on a cold cache exactly as bench_course.py does, with a watchdog: every 2 s
it samples the CPU of every process in the tree; when they all used < 2 CPU-s in 20 s it dumps
each one's Python stack with py-spy (``pip install py-spy``), once per stall. Written to hunt
a kernel that idled outside its cells (issue 32; the cause, found with
``bench_widget_stall.py``: a runner's widget emulation left a cell's reply unread — see
``minillm/course/headless.py``); kept for the next idle of that kind.

    python benchmarks/watch_notebook.py notebooks/09_parallelism.ipynb /tmp/watch09

Writes ``watch.log`` in the folder; prints bench_course's timing of the run (outside_cells_s:
kernel start and shutdown; a gap between cells shows as wall_s - cells_s). A benchmark tool,
not a test."""
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_course  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "notebooks/09_parallelism.ipynb"
scratch = Path(sys.argv[2] if len(sys.argv) > 2 else "watch-notebook")
scratch.mkdir(parents=True, exist_ok=True)
cache = bench_course.cold_cache(scratch / "cache")
log = open(scratch / "watch.log", "w")
me = psutil.Process()
stop = threading.Event()


def say(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, file=log, flush=True)


def watch():
    hist = []
    dumped = False
    t0 = time.monotonic()
    while not stop.is_set():
        time.sleep(2)
        procs = [me] + me.children(recursive=True)
        cpu = 0.0
        names = []
        for p in procs:
            try:
                t = p.cpu_times()
                cpu += t.user + t.system
                names.append(f"{p.pid}:{p.status()}:{' '.join(p.cmdline()[-3:])[-70:]}")
            except psutil.Error:
                pass
        hist.append((time.monotonic(), cpu))
        hist = [h for h in hist if h[0] > time.monotonic() - 21]
        used, span = hist[-1][1] - hist[0][1], hist[-1][0] - hist[0][0]
        if int(time.monotonic() - t0) % 20 < 2:
            say(f"t={time.monotonic() - t0:.0f} cpu20={used:.1f}", names)
        if span >= 19 and used < 2.0:
            if not dumped:
                say(f"STALL: {used:.2f} CPU-s in {span:.0f} s", names)
                for p in procs:
                    try:
                        out = subprocess.run([shutil.which("py-spy") or "py-spy", "dump", "--locals", "--pid", str(p.pid)],
                                             capture_output=True, text=True, timeout=60)
                        say(f"--- {p.pid} {' '.join(p.cmdline())[:200]}\n{out.stdout[:20000]}{out.stderr[:500]}")
                    except (psutil.Error, subprocess.TimeoutExpired, OSError) as e:
                        say(f"--- {p.pid}: {e}")
                dumped = True
        else:
            dumped = False


threading.Thread(target=watch, daemon=True).start()
start = time.perf_counter()
run = bench_course.run_notebook(REPO / which, cache, 1800)
stop.set()
say("RESULT", {k: v for k, v in run.items() if k not in ("cells",)})
print({k: v for k, v in run.items() if k not in ("cells",)})
