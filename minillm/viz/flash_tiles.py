"""FlashAttention's tiling, made visible: which tiles a program loads, the online softmax's
running state, and the memory traffic saved.

One program of the kernel owns a tile of ``BLOCK_M`` queries and walks the keys ``BLOCK_N`` at a
time. ``tile_schedule`` lists, for a chosen query tile, the key tiles in the order it loads them
(causal attention skips tiles entirely above the diagonal). ``online_softmax_trace`` replays the
running maximum ``m`` and sum ``l`` of one query row on real numbers, tile by tile, and checks
they end at the full softmax's. ``hbm_bytes`` counts the bytes read and written by a
materialising implementation (scores and probabilities round-trip through memory) against the
tiled one (Q, K, V read once per query tile, O written once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class TileStep:
    key_tile: int
    key_start: int
    key_end: int
    running_max: float
    running_sum: float
    partially_masked: bool  # the diagonal tile of causal attention


def tile_counts(t: int, s: int, block_m: int, block_n: int) -> tuple[int, int]:
    return math.ceil(t / block_m), math.ceil(s / block_n)


def visible_key_tiles(query_tile: int, t: int, s: int, block_m: int, block_n: int, causal: bool) -> list[int]:
    """Key tiles the program for ``query_tile`` loads. Queries are the last ``t`` of ``s`` positions."""
    n_tiles = math.ceil(s / block_n)
    if not causal:
        return list(range(n_tiles))
    last_query_pos = min(s - t + (query_tile + 1) * block_m, s) - 1
    return list(range(last_query_pos // block_n + 1))


def online_softmax_trace(
    t: int,
    s: int,
    block_m: int,
    block_n: int,
    query_tile: int = 0,
    row: int = 0,
    causal: bool = True,
    head_dim: int = 64,
    seed: int = 0,
) -> list[TileStep]:
    """The running max and sum of query ``row`` (within ``query_tile``) after each key tile,
    computed on random q and k; the last step equals the full softmax's max and normaliser."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(s, head_dim, generator=gen, dtype=torch.float64)
    i = query_tile * block_m + row
    if i >= t:
        raise ValueError(f"query row {row} of tile {query_tile} is past the last query ({t - 1})")
    scores = (k @ q[i]) / math.sqrt(head_dim)
    position = s - t + i
    visible = torch.arange(s) <= position if causal else torch.ones(s, dtype=torch.bool)
    m, total = -math.inf, 0.0
    steps = []
    for j in visible_key_tiles(query_tile, t, s, block_m, block_n, causal):
        lo, hi = j * block_n, min((j + 1) * block_n, s)
        tile = scores[lo:hi][visible[lo:hi]]
        if tile.numel():
            m_new = max(m, tile.max().item())
            total = total * math.exp(m - m_new) + torch.exp(tile - m_new).sum().item()  # rescale, then add
            m = m_new
        steps.append(TileStep(j, lo, hi, m, total, bool((~visible[lo:hi]).any())))
    full = scores[visible]
    assert math.isclose(m, full.max().item()) and math.isclose(total, torch.exp(full - m).sum().item(), rel_tol=1e-9)
    return steps


def hbm_bytes(t: int, s: int, head_dim: int, block_m: int, causal: bool = True, bytes_per_element: int = 2) -> dict:
    """Bytes moved for one head of one sequence (queries: the last ``t`` of ``s`` positions)."""
    naive = (2 * t * head_dim + 2 * s * head_dim + 4 * t * s) * bytes_per_element
    keys_read = 0
    for tile in range(math.ceil(t / block_m)):
        keys_read += min(s, s - t + (tile + 1) * block_m) if causal else s
    flash = (2 * t * head_dim + 2 * keys_read * head_dim) * bytes_per_element
    return {"naive": naive, "flash": flash, "ratio": naive / flash}


HEIGHT = 460
SUBPLOT_TITLE_SIZE = 14


def flash_tiling_figure(
    t: int = 256,
    s: int = 256,
    block_m: int = 64,
    block_n: int = 64,
    query_tile: int | None = None,
    causal: bool = True,
    head_dim: int = 64,
):
    """Left: the tile grid, the chosen program's tiles coloured in load order (skipped tiles
    grey). Right: its running max and sum for the program's first query row, tile by tile."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    import minillm.viz.style as style

    rows, cols = tile_counts(t, s, block_m, block_n)
    query_tile = rows - 1 if query_tile is None else query_tile
    grid = [[None] * cols for _ in range(rows)]
    text = [[""] * cols for _ in range(rows)]
    for r in range(rows):
        visible = set(visible_key_tiles(r, t, s, block_m, block_n, causal))
        for c in range(cols):
            grid[r][c] = 0 if c not in visible else 1
    order = visible_key_tiles(query_tile, t, s, block_m, block_n, causal)
    for n, c in enumerate(order):
        grid[query_tile][c] = 2
        text[query_tile][c] = str(n + 1)
    trace = online_softmax_trace(t, s, block_m, block_n, query_tile, 0, causal, head_dim)
    traffic = hbm_bytes(t, s, head_dim, block_m, causal)
    fig = make_subplots(
        rows=1, cols=2, subplot_titles=("tiles (Q tiles × K tiles)", "online softmax, the tile's first row")
    )
    fig.update_annotations(font_size=SUBPLOT_TITLE_SIZE)
    fig.add_trace(
        go.Heatmap(
            z=grid, text=text, texttemplate="%{text}", showscale=False, xgap=2, ygap=2, zmin=0, zmax=2,
            colorscale=[[0, "#eeeeee"], [0.5, "#9ecae1"], [1, "#08519c"]],
            hovertemplate="Q tile %{y}, K tile %{x}<extra></extra>",
        ),
        row=1, col=1,
    )  # fmt: skip
    steps = [st.key_tile for st in trace]
    fig.add_trace(
        go.Scatter(x=steps, y=[st.running_max for st in trace], name="running max m", mode="lines+markers"),
        row=1,
        col=2,
    )
    fig.add_trace(
        go.Scatter(x=steps, y=[st.running_sum for st in trace], name="running sum l", mode="lines+markers"),
        row=1,
        col=2,
    )
    fig.update_yaxes(autorange="reversed", title_text="query tile", dtick=math.ceil(rows / 8), row=1, col=1)
    fig.update_xaxes(title_text="key tile", dtick=math.ceil(cols / 8), row=1, col=1)
    fig.update_xaxes(title_text="after key tile", row=1, col=2)
    ratio = traffic["ratio"]
    title = (
        f"T={t}, S={s}, {block_m}×{block_n} tiles{', causal' if causal else ''}: "
        f"program {query_tile} loads {len(order)} of {cols} key tiles<br>"
        f"HBM traffic {traffic['naive'] / 1e6:.2f} MB naive vs {traffic['flash'] / 1e6:.2f} MB tiled "
        f"({f'{ratio:.1f}x less' if ratio >= 1 else f'{1 / ratio:.1f}x more'})"
    )
    fig.update_layout(
        template="plotly_white",
        height=HEIGHT,
        title=style.title(title),
        legend=style.legend_at_bottom(HEIGHT),
        margin=dict(
            l=70,
            r=30,
            t=style.top_margin(title, extra=style.LINE * SUBPLOT_TITLE_SIZE + 4),
            b=style.X_AXIS + style.LEGEND_ROW + 4,
        ),
    )
    return fig


def flash_tiling_widget():
    """Sliders for the sizes; the figure redraws as they move. Displayed, it also carries a
    static copy of the figure, shown by a notebook opened without the widget's state."""
    import ipywidgets as widgets

    from minillm.viz.display import FigureBox, figure_widget

    t = widgets.IntSlider(value=256, min=16, max=2048, step=16, description="T (queries)")
    s = widgets.IntSlider(value=256, min=16, max=4096, step=16, description="S (keys)")
    bm = widgets.Dropdown(options=[16, 32, 64, 128], value=64, description="BLOCK_M")
    bn = widgets.Dropdown(options=[16, 32, 64, 128], value=64, description="BLOCK_N")
    tile = widgets.IntSlider(value=3, min=0, max=3, description="Q tile")
    causal = widgets.Checkbox(value=True, description="causal")
    fig = figure_widget(flash_tiling_figure())

    def redraw(_=None):
        s.value = max(s.value, t.value)
        tile.max = math.ceil(t.value / bm.value) - 1
        new = flash_tiling_figure(t.value, s.value, bm.value, bn.value, min(tile.value, tile.max), causal.value)
        with fig.batch_update():
            for old_trace, new_trace in zip(fig.data, new.data):
                old_trace.update(new_trace)
            fig.update_layout(
                title=new.layout.title, xaxis_dtick=new.layout.xaxis.dtick, yaxis_dtick=new.layout.yaxis.dtick
            )

    for w in (t, s, bm, bn, tile, causal):
        w.observe(redraw, names="value")
    return FigureBox(
        [widgets.HBox([t, s, causal]), widgets.HBox([bm, bn, tile]), fig],
        figure=fig,
        description="FlashAttention tiling explorer",
    )
