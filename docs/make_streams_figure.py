"""Draw ``docs/streams.png``: the two copy streams against compute, for one training step of six layers.

A schematic, not a measurement: every layer takes the same time, backward twice forward, and a layer's copy a bit
less than its forward. Run ``python docs/make_streams_figure.py`` to redraw it.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

LAYERS = 6
FWD = 1.0  # forward time of one layer
BWD = 2.0  # backward time of one layer
COPY = 0.8  # one layer's activations over the link
RESIDENT = 1  # the last layer's activations stay on the device (the resident tail)
OPT = 1.6  # optimizer step

LANES = {"compute stream": 2.0, "D2H copy stream\n(GPU → pinned host)": 1.0, "H2D copy stream\n(host → GPU)": 0.0}
D2H, H2D = list(LANES)[1:]
COLOURS = {"fwd": "#4c72b0", "bwd": "#dd8452", "opt": "#8c8c8c", "d2h": "#55a868", "h2d": "#c44e52"}


def _box(ax: object, lane: str, start: float, width: float, colour: str, text: str) -> None:
    y = LANES[lane]
    ax.broken_barh([(start, width)], (y - 0.32, 0.64), facecolors=colour, edgecolor="white", linewidth=1.2)
    ax.text(start + width / 2, y, text, ha="center", va="center", color="white", fontsize=8, fontweight="bold")


def draw(path: Path) -> Path:
    """Draw the schematic into ``path``."""
    figure = Figure(figsize=(12, 3.8), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    offloaded = LAYERS - RESIDENT

    # Forward: layer i's saved activations leave on the D2H stream while layer i+1 computes.
    d2h_free = 0.0
    for i in range(LAYERS):
        start = i * FWD
        _box(ax, "compute stream", start, FWD, COLOURS["fwd"], f"F{i + 1}")
        if i < offloaded:
            copy_start = max(start + FWD, d2h_free)
            _box(ax, D2H, copy_start, COPY, COLOURS["d2h"], f"A{i + 1}")
            d2h_free = copy_start + COPY
    fwd_end = LAYERS * FWD

    # Backward walks the layers in reverse; A_i comes back on the H2D stream while B_{i+1} computes.
    for step, i in enumerate(reversed(range(LAYERS))):
        start = fwd_end + step * BWD
        _box(ax, "compute stream", start, BWD, COLOURS["bwd"], f"B{i + 1}")
        if i < offloaded:
            # Prefetched while the layer after it runs backward, so it is there when B_i starts.
            _box(ax, H2D, start - COPY - 0.15, COPY, COLOURS["h2d"], f"A{i + 1}")
    bwd_end = fwd_end + LAYERS * BWD
    _box(ax, "compute stream", bwd_end, OPT, COLOURS["opt"], "optimizer")

    # The last layer's activations stay: backward needs them first, and nothing would hide their round trip.
    y = LANES[D2H]
    ax.broken_barh([(fwd_end, COPY)], (y - 0.32, 0.64), facecolors="none", edgecolor="#888888", linestyle="--")
    ax.text(fwd_end + COPY / 2, y, f"A{LAYERS}", ha="center", va="center", color="#888888", fontsize=8)
    ax.text(fwd_end + COPY + 0.15, y, "stays on the GPU:\nresident tail", fontsize=8, va="center")
    # The event a backward kernel waits for: the device-side ordering that replaces a host synchronization.
    b2_start = fwd_end + (LAYERS - 2) * BWD  # B2 starts here and needs A2
    arrow = FancyArrowPatch(
        (b2_start - 0.15, LANES[H2D] + 0.32),
        (b2_start + 0.05, LANES["compute stream"] - 0.32),
        arrowstyle="->",
        mutation_scale=10,
        color="#444444",
        linestyle="--",
    )
    ax.add_patch(arrow)
    ax.text(b2_start + 0.2, 1.0, "B2 waits for A2's copy event\n(on the device, no host sync)", fontsize=7, va="center")

    ax.axvline(fwd_end, color="#444444", lw=0.8, ls=":")
    ax.axvline(bwd_end, color="#444444", lw=0.8, ls=":")
    ax.text(fwd_end / 2, 2.55, "forward", ha="center", fontsize=9)
    ax.text((fwd_end + bwd_end) / 2, 2.55, "backward", ha="center", fontsize=9)
    ax.set_yticks(list(LANES.values()), list(LANES))
    ax.set_ylim(-0.6, 2.8)
    ax.set_xlim(-0.2, bwd_end + OPT + 0.2)
    ax.set_xticks([])
    ax.set_xlabel("time →  (copies hide behind compute; the compute stream waits only when a copy is late)")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    figure.suptitle(
        "lightning_offload, mode='streamed': saved activations A1…A5 go to pinned host memory during forward and "
        "are prefetched back ahead of backward",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


if __name__ == "__main__":
    print(draw(Path(__file__).resolve().parent / "streams.png"))
