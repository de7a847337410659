"""Run a notebook with no front end, without the stall that nbclient's widget emulation causes.

Why this exists. nbclient plays the front end for ipywidgets' ``Output`` widget: when a cell
writes into one (``with out: display(fig)``, as chapter 09's planner widget did), nbclient sends
the widget's new state back to the kernel on the *shell* socket, while the same event loop waits
on that socket for the cell's reply. What is measured: the reply is there, yet the wait sleeps
on until its timeout, where pyzmq's last zero-timeout poll finds it, and the cell "finishes" at
its time limit with no error, the kernel idle all along. The likely mechanism: ZeroMQ announces
a readable socket through an edge-triggered descriptor (``ZMQ_FD`` in ``zmq_getsockopt``'s
manual), and the send uses up the edge of a reply that has just arrived. That is how the grader
once gave chapter 09 a whole notebook's limit of idleness after its planner widget: it reported
"timed out in cell 6", a markdown cell, which it could only say when code cell 5 (the planner)
replied at the deadline. Measured with
``benchmarks/bench_widget_stall.py`` (60 such cells under a 12 s limit, Intel Xeon, 2 cores):
plain nbclient stalled 15 of 60 in one run and 30 of 60 in another for the full 12 s; with
either change below, 0 of 60. The same hang is reported upstream:
https://github.com/jupyter/nbclient/issues/312. (The course's own planner widget no longer
draws while its cell runs — ``minillm/viz/planner.py`` — but a learner's widget code may.)

Two changes, each enough alone in that measurement (``--variants`` runs them one at a time):

- **no Output-widget emulation** (an empty ``widget_registry``): nothing is sent on the shell
  socket while a cell runs, and what a cell writes into a widget lands in the cell itself —
  which is what a grader reads anyway (the last output of a cell that stopped);
- **the wait for a reply is taken in slices** of at most ``WAIT_SLICE_S``, each ending in that
  zero-timeout poll, so a wake-up lost any other way costs at most a slice, not the cell's limit
  (alone, with the emulation on, the median cell took 0.56 s instead of 0.07 s: most replies of
  such cells lose their wake-up).

The whole wait is unchanged: a cell that truly runs past its limit still raises nbclient's
``CellTimeoutError`` in that cell.
"""

from __future__ import annotations

import time
from queue import Empty

from nbclient import NotebookClient
from nbclient.util import ensure_async

WAIT_SLICE_S = 1.0  # the longest a reply can sit unread: one slice


class HeadlessNotebookClient(NotebookClient):
    """``nbclient.NotebookClient`` for running notebooks unattended (grading, benchmarks)."""

    def __init__(self, nb, km=None, **kw):
        super().__init__(nb, km=km, **kw)
        self.widget_registry = {}  # no Output-widget emulation: nothing sent while a cell runs

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        kc.shell_channel.get_msg = _sliced(kc.shell_channel.get_msg)
        return kc


def _sliced(get_msg, slice_s: float = WAIT_SLICE_S):
    """``get_msg(timeout)`` as a series of waits of at most ``slice_s`` seconds: the same
    answer, and the same ``Empty`` at the same deadline, but a reply whose wake-up was lost is
    found by the zero-timeout poll that ends each slice."""

    async def sliced_get_msg(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await ensure_async(get_msg(timeout=slice_s if left is None else min(slice_s, left)))
            except Empty:
                if left is not None and left <= slice_s:
                    raise

    return sliced_get_msg
