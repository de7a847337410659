"""Share a busy CPU: run a step on fewer threads while other processes keep cores busy.

A decode step is hundreds of parallel regions (every matrix product, every fused loop), each
ending at a barrier where all of PyTorch's OpenMP threads meet. On a quiet 2-core laptop two
threads decode fastest. But when another CPU-bound process (a browser tab, a second kernel,
a compile) holds one core, one of our two threads is descheduled at almost every barrier, and
the other waits for the scheduler to give it back — each of hundreds of barriers per step costs
a time slice. Measured on 2 cores (Intel Xeon, SmolLM2-135M bf16): a warm engine's batch-1
decode went from 28 ms per token quiet to 180-200 ms with one competing process.

One thread does not wait for anyone: it decodes at the single-core rate, about its fair share.
So before each step (at most every ``CHECK_SECONDS``) the governor reads how busy the CPUs we
may run on were since its last look (``/proc/stat``), takes away this process's own use
(``/proc/self/stat``), and uses as many threads as there are cores left free — never more
than the engine was given, never fewer than one. Time spent by *niced* processes (such as the
engine's own background compile, ``background_compile.py``) is not counted: the kernel's
scheduler hands their cores back as soon as we want them.

``benchmarks/bench_contention.py`` measures the decode rate with a competing process under
each policy. Linux only (``/proc``); elsewhere the thread count stays as configured.
"""

from __future__ import annotations

import os
import time

import torch

CHECK_SECONDS = 0.5  # how often the CPUs' load is looked at (a few jiffies per core at 100 Hz)
# A core counts as taken once others keep it busy more than this share of the time (slack for
# the kernel's coarse counters and short bursts of other work).
TAKEN = 0.6


def threads_for(others_busy: float, cores: int, max_threads: int) -> int:
    """Threads to run on when other processes kept ``others_busy`` cores (a float) busy of ``cores``."""
    free = cores - others_busy
    return max(1, min(max_threads, int(free + TAKEN)))


def _cpu_times(cpus: set[int]) -> tuple[float, float, float] | None:
    """(busy, stolen, total) jiffies of the CPUs in ``cpus``; busy counts the time the hypervisor
    stole (a stolen core is as late to a barrier as a busy one) but not niced time; None without
    /proc."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    busy = stolen = total = 0.0
    for fields in lines:
        if int(fields[0][3:]) not in cpus:
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (float(x) for x in fields[1:9])
        busy += user + system + irq + softirq + steal
        stolen += steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return busy, stolen, total


def _own_times() -> float | None:
    """This process's user + system jiffies (all its threads)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return float(fields[11]) + float(fields[12])  # utime, stime


# The thread count a governor last set, and torch's count before the first one did: a count a
# governor lowered on a busy moment is not the process's setting, and must not cap the next engine.
_governed: int | None = None
_ungoverned: int | None = None


def set_threads(n: int) -> None:
    """``torch.set_num_threads(n)``, remembered as the governor's doing."""
    global _governed, _ungoverned
    if _ungoverned is None or torch.get_num_threads() != _governed:
        _ungoverned = torch.get_num_threads()  # a user's own setting since
    torch.set_num_threads(n)
    _governed = n


def configured_threads() -> int:
    """The process's thread count as set by the user or torch — not as a governor lowered it."""
    current = torch.get_num_threads()
    return _ungoverned if _ungoverned is not None and current == _governed else current


class ThreadGovernor:
    """Sets the stepping thread's OpenMP thread count before each step (module docstring)."""

    def __init__(self, max_threads: int | None = None, enabled: bool = True):
        self.max_threads = max_threads or configured_threads()
        try:
            self.cpus = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = set(range(os.cpu_count() or 1))
        self.enabled = enabled and self.max_threads > 1 and _cpu_times(self.cpus) is not None
        self.threads = self.max_threads
        self.others_busy = 0.0  # cores other processes (or the hypervisor) kept busy over the last look
        self.stolen = 0.0  # of which the hypervisor's steal (a virtual machine's host running others)
        self._last = self._sample() if self.enabled else None

    def _sample(self):
        return time.monotonic(), _cpu_times(self.cpus), _own_times()

    def adjust(self) -> int:
        """Look at the load (at most every ``CHECK_SECONDS``) and set the thread count; the count."""
        if not self.enabled:
            return self.threads
        now = time.monotonic()
        if now - self._last[0] < CHECK_SECONDS:
            if torch.get_num_threads() != self.threads:  # another engine's steps, or a user's call
                set_threads(self.threads)
            return self.threads
        sample = self._sample()
        (_, (busy0, stolen0, total0), own0), (_, (busy1, stolen1, total1), own1) = self._last, sample
        self._last = sample
        if total1 <= total0:
            return self.threads
        cores = len(self.cpus)
        others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0) * cores
        self.others_busy = others
        self.stolen = (stolen1 - stolen0) / (total1 - total0) * cores
        self.threads = threads_for(others, cores, self.max_threads)
        if torch.get_num_threads() != self.threads:
            set_threads(self.threads)
        return self.threads
