"""Sizes shared by the course's figures, so that they fit a notebook column.

JupyterLab gives an output about 900 px of width on a laptop screen. Plotly grows a margin to
make room for a legend or a slider, but never for a title, and every pixel it grows comes out
of the plot: a figure sized for its rows can end up with rows a few pixels tall. So the figures
here declare their margins: the title anchored at the top, then (where there is one) a one-row
legend, then the plot, sized per row where rows are what it shows.

Text widths are estimated (characters × font size × 0.6); the layout test uses the same rule.
"""

from __future__ import annotations

import re

NOTEBOOK_WIDTH = 900  # px: the notebook column the figures are sized for
TITLE_SIZE = 15
LINE = 1.3  # a line of text is LINE × font size tall
CHAR = 0.6  # and a character about CHAR × font size wide
TOP_PAD = 10  # above the title
LEGEND_ROW = 24  # a one-row horizontal legend
GAP = 8
X_AXIS = 56  # below the plot: tick labels and an axis title
SLIDER = 70  # a plotly slider without its current-value label: rail, ticks, step labels


def lines(text: str) -> list[str]:
    return [re.sub(r"<[^>]+>", "", line) for line in re.split(r"<br\s*/?>", text)]


def text_width(text: str, size: float = 12) -> float:
    return max(len(line) for line in lines(text)) * size * CHAR


MULTILINE_SHIFT = 0.75  # plotly draws a title of several lines about this many font sizes higher


def title(text: str, size: int = TITLE_SIZE) -> dict:
    """A title anchored at the top left (its lines grow downwards, never into the plot)."""
    shift = MULTILINE_SHIFT * size if len(lines(text)) > 1 else 0
    return dict(
        text=text,
        font=dict(size=size),
        x=0,
        xref="paper",
        xanchor="left",
        y=1,
        yref="container",
        yanchor="top",
        pad=dict(t=round(TOP_PAD + shift)),
    )


def title_height(text: str, size: int = TITLE_SIZE) -> float:
    return TOP_PAD + len(lines(text)) * LINE * size


def legend_item_width(name: str, size: float = 12) -> float:
    return 40 + text_width(name, size)


def top_margin(title_text: str, legend: bool = False, extra: float = 0, size: int = TITLE_SIZE) -> int:
    """Room for the title, a one-row legend under it and ``extra`` px (subplot titles)."""
    return round(title_height(title_text, size) + GAP + (LEGEND_ROW + GAP if legend else 0) + extra)


def legend_under_title(title_text: str, height: int, size: int = TITLE_SIZE) -> dict:
    """A horizontal legend between the title and the plot (positioned in px from the top)."""
    top = title_height(title_text, size) + GAP
    return dict(orientation="h", x=0, xref="paper", xanchor="left", y=1 - top / height, yref="container", yanchor="top")


def legend_at_bottom(height: int) -> dict:
    """A horizontal legend in the bottom margin, under the x axis' labels."""
    return dict(
        orientation="h",
        x=1,
        xref="paper",
        xanchor="right",
        y=(LEGEND_ROW + 2) / height,
        yref="container",
        yanchor="top",
    )
