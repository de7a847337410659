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
SUBPLOT_TITLE = 30  # above a row of subplots: plotly's 16 px subplot-title annotations


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


#: Where a point's label may go, tried in this order: (textposition, dx, dy) — the label box's
#: centre relative to the marker's, in units of (half label width + marker radius, half label
#: height + marker radius); pixel y grows downwards.
LABEL_SPOTS = (
    ("top center", 0, -1), ("bottom center", 0, 1), ("middle right", 1, 0), ("middle left", -1, 0),
    ("top right", 1, -1), ("top left", -1, -1), ("bottom right", 1, 1), ("bottom left", -1, 1),
)  # fmt: skip


def label_box(x: float, y: float, radius: float, text: str, spot: str, size: float = 12) -> tuple[float, ...]:
    """The box ``(left, top, right, bottom)`` in px that plotly's ``textposition=spot`` gives the
    label ``text`` of a marker of ``radius`` px centred at (``x``, ``y``) px."""
    w, h = text_width(text, size), LINE * size
    _, dx, dy = next(s for s in LABEL_SPOTS if s[0] == spot)
    cx, cy = x + dx * (w / 2 + radius), y + dy * (h / 2 + radius)
    return cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(points: list[tuple[float, float, float]], texts: list[str], size: float = 12,
                 merge_px: float = 4.0) -> tuple[list[str], list[str]]:
    """Labels for markers at ``points`` = (x px, y px, radius px) that do not pile up: markers
    within ``merge_px`` of an earlier one share its label ("a · b"), and each label takes the
    first of ``LABEL_SPOTS`` whose box meets no label placed before it and no other marker — or,
    in a crowd, one that meets no label and covers no other marker's centre.
    Returns (texts, textpositions), one per point ("" for a point whose label is merged)."""
    owner = list(range(len(points)))
    for i, (x, y, _) in enumerate(points):
        for j in range(i):
            if owner[j] == j and abs(points[j][0] - x) <= merge_px and abs(points[j][1] - y) <= merge_px:
                owner[i] = j
                break
    shown = [" · ".join(texts[k] for k in range(len(points)) if owner[k] == i) if owner[i] == i else ""
             for i in range(len(points))]  # fmt: skip
    markers = [(x - r, y - r, x + r, y + r) for x, y, r in points]
    placed: list[tuple[float, ...]] = []
    spots = []
    for i, (x, y, r) in enumerate(points):
        if not shown[i]:
            spots.append("top center")
            continue
        boxes = {s: label_box(x, y, r, shown[i], s, size) for s, _, _ in LABEL_SPOTS}
        others = [m for k, m in enumerate(markers) if owner[k] != i]
        centres = [((m[0] + m[2]) / 2, (m[1] + m[3]) / 2) for m in others]
        no_label = [s for s, b in boxes.items() if not any(_overlap(b, p) for p in placed)]
        clear = [s for s in no_label if not any(_overlap(boxes[s], m) for m in others)]
        uncovered = [s for s in no_label if not any(boxes[s][0] < cx < boxes[s][2] and boxes[s][1] < cy < boxes[s][3]
                                                    for cx, cy in centres)]  # fmt: skip
        spot = (clear or uncovered or no_label or ["top center"])[0]
        spots.append(spot)
        placed.append(label_box(x, y, r, shown[i], spot, size))
    return shown, spots
