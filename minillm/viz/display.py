"""Widgets that still show their chart in a saved notebook.

A widget's output in a notebook file is only a reference to a model that lives in the kernel
(``application/vnd.jupyter.widget-view+json``). Opened later without that kernel, JupyterLab
has nothing to draw: in a notebook it does not trust (any notebook it did not run or sign
itself, such as the solved chapters), it falls back to the ``text/plain`` repr; in a trusted
one, ipywidgets writes "Error displaying widget: model not found". Saving the widget state
into the notebook would fix that at the cost of megabytes of JavaScript (plotly's widget).

``FigureBox`` is an ``ipywidgets.VBox`` whose display bundle also carries a static copy of its
chart as plotly's own mime type (``application/vnd.plotly.v1+json``, a few KB of JSON). A live
kernel shows the widget (JupyterLab ranks the widget renderer first); an untrusted notebook
skips the widget renderer, which may run code, and draws the plotly chart, which it counts as
safe; other front ends pick whichever they support.
"""

from __future__ import annotations

import importlib
import json
import sys
import threading

import ipywidgets as widgets

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def static_figure(figure) -> dict:
    """The figure as plotly's mime bundle value: ``{"data": [...], "layout": {...}}``."""
    import plotly.io as pio

    return json.loads(pio.to_json(figure, validate=False, remove_uids=True))


def figure_widget(figure=None):
    """``plotly.graph_objects.FigureWidget(figure)``, its module imported on a thread of its own.

    Why a thread: the first ``FigureWidget`` imports plotly's widget module, which imports
    nbformat, jsonschema and ``rfc3987_syntax``, and that builds 38 parsers with lark — a second
    of pure-Python loops. CPython 3.11 keeps each thread's frames in chunks, and a loop that calls
    across a chunk's end allocates and frees a chunk on every call (CPython issue gh-142183,
    fixed in 3.13). Whether the import's loops sit on such an edge depends on how deep the call
    is: from a notebook cell in chapter 08 the import took 7-8 s instead of 1.3 s. A new thread's
    stack starts empty, so the import costs the same wherever the figure is made."""
    if "plotly.graph_objs._figurewidget" not in sys.modules:
        loader = threading.Thread(target=_import_quietly, args=("plotly.graph_objs._figurewidget",),
                                  name="minillm-plotly-import")  # fmt: skip
        try:
            loader.start()
        except RuntimeError:  # no new threads (the interpreter is shutting down): import here
            _import_quietly("plotly.graph_objs._figurewidget")
        else:
            loader.join()
    import plotly.graph_objects as go

    return go.FigureWidget(figure)


def _import_quietly(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - the caller's own import below raises it where it can be read
        pass


class FigureBox(widgets.VBox):
    """Controls and a ``plotly.graph_objects.FigureWidget`` (``figure``) in a column, displayed
    with a static copy of the figure as it is at display time."""

    def __init__(self, children, figure, description: str = "interactive chart", **kwargs):
        super().__init__(children, **kwargs)
        self.figure = figure
        self.summary = description

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None or WIDGET_MIME not in bundle:
            return bundle
        bundle[PLOTLY_MIME] = static_figure(self.figure)
        bundle["text/plain"] = f"{self.summary} (an interactive widget: run the cell to use it)"
        return bundle


class HTMLBox(widgets.VBox):
    """Controls and ``ipywidgets.HTML`` views in a column (a text widget rather than a chart),
    displayed with ``static_html`` — the whole view as HTML — next to the widget, for the same
    reason ``FigureBox`` carries a static chart."""

    def __init__(self, children, static_html: str, description: str = "interactive view", **kwargs):
        super().__init__(children, **kwargs)
        self.static_html = static_html
        self.summary = description

    def _repr_mimebundle_(self, **kwargs):
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None or WIDGET_MIME not in bundle:
            return bundle
        bundle["text/html"] = self.static_html
        bundle["text/plain"] = f"{self.summary} (an interactive widget: run the cell to use it)"
        return bundle
