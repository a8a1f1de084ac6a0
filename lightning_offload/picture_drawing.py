"""Drawing the memory picture: the recorded traces of one training step as a matplotlib figure."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_offload.options import GiB

Kind = Literal["offloaded", "baseline"]


@dataclass
class Trace:
    """Samples of one recorded step. Times in seconds from the batch start; memory in bytes."""

    kind: Kind
    t: list[float] = field(default_factory=list)
    device_bytes: list[int] = field(default_factory=list)
    host_held: list[int] = field(default_factory=list)
    inflight: list[int] = field(default_factory=list)
    offloaded: list[int] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)  # phase name -> start time

    @property
    def peak(self) -> int:
        return max(self.device_bytes, default=0)


def draw(traces: list[Trace], title: str, cuda: bool) -> Any:
    """The figure: allocated memory over the step per trace, phases shaded; host and in-flight bytes below."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 6.5), dpi=100, layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    colours = {"offloaded": "tab:blue", "baseline": "tab:red"}
    names = {"offloaded": "with offloading", "baseline": "without offloading"}
    phase_colours = {"forward": "#dbe9f6", "backward": "#fde4cf", "optimizer": "#e5e5e5"}
    for trace in traces:
        ms = [t * 1e3 for t in trace.t]
        label = f"{names[trace.kind]} (peak {trace.peak / GiB:.3f} GiB)"
        top.plot(
            ms,
            [b / GiB for b in trace.device_bytes],
            color=colours[trace.kind],
            lw=1.6,
            label=label,
            drawstyle="steps-post",
        )
        spans = phase_spans(trace)
        if trace.kind == "offloaded" or len(traces) == 1:
            for name, lo, hi in spans:
                for ax in (top, bottom):
                    ax.axvspan(lo * 1e3, hi * 1e3, color=phase_colours.get(name, "#eeeeee"), zorder=0)
                top.text(
                    (lo + hi) / 2 * 1e3,
                    1.0,
                    name,
                    transform=top.get_xaxis_transform(),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        else:
            for _, lo, _ in spans[1:]:
                top.axvline(lo * 1e3, color=colours[trace.kind], ls=":", lw=1)
        if trace.kind == "offloaded":
            bottom.fill_between(
                ms,
                [b / GiB for b in trace.host_held],
                step="post",
                alpha=0.35,
                color="tab:green",
                label="host memory holding offloaded activations",
            )
            for values, colour, label in (
                (trace.offloaded, "tab:purple", "offloaded so far in this step"),
                (trace.inflight, "tab:orange", "device bytes with a copy in flight"),
            ):
                bottom.plot(ms, [b / GiB for b in values], color=colour, lw=1.2, label=label)
    top.set_ylabel("allocated GiB" if cuda else "process RSS GiB (CPU run)")
    top.legend(loc="upper left", fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel("GiB")
    bottom.set_xlabel("time since batch start (ms); samples synchronize the device, so the step runs slower")
    handles, _ = bottom.get_legend_handles_labels()
    if handles:
        bottom.legend(loc="upper left", fontsize=8)
    bottom.grid(alpha=0.3)
    lines = [title] if title else []
    peaks = {t.kind: t.peak for t in traces}
    if "offloaded" in peaks and "baseline" in peaks and peaks["baseline"] > 0:
        saved = 1 - peaks["offloaded"] / peaks["baseline"]
        lines.append(
            f"peak {peaks['offloaded'] / GiB:.3f} GiB with offloading vs {peaks['baseline'] / GiB:.3f} GiB "
            f"without ({saved:+.0%} saved)"
        )
    figure.suptitle("\n".join(lines) or "one training step", fontsize=10)
    return figure


def phase_spans(trace: Trace) -> list[tuple[str, float, float]]:
    """(phase, start, end) in time order, from the phase marks of a trace."""
    ordered = sorted(trace.marks.items(), key=lambda item: item[1])
    spans = []
    for (name, start), (_, end) in itertools.pairwise(ordered):
        if name != "end" and end > start:
            spans.append((name, start, end))
    return spans


def save(figure: Any, path: Path, loggers: list[Any], step: int, tag: str) -> Path:
    """Write ``figure`` as a PNG at ``path`` and send it to the loggers whose ``experiment`` has ``add_image``."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=figure.dpi)
    image = np.asarray(canvas.buffer_rgba())[..., :3].copy()
    for logger in loggers:
        experiment = getattr(logger, "experiment", None)
        add_image = getattr(experiment, "add_image", None)
        if callable(add_image):
            add_image(tag, image, global_step=step, dataformats="HWC")
            flush = getattr(experiment, "flush", None)
            if callable(flush):
                flush()
    return path
