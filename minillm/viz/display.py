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

import json

import ipywidgets as widgets

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def static_figure(figure) -> dict:
    """The figure as plotly's mime bundle value: ``{"data": [...], "layout": {...}}``."""
    import plotly.io as pio

    return json.loads(pio.to_json(figure, validate=False, remove_uids=True))


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
