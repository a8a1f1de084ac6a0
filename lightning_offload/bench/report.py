"""From the workers' raw rows to derived numbers, verdicts, a Markdown report, a plot and a terminal table.

Everything here is plain computation on dictionaries (no torch), so the verdicts can be unit-tested with
hand-made numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

GiB = 1 << 30

# Verdict thresholds. Times are step-time ratios; peaks are GiB of ``max_memory_allocated``.
P1_BOUND_SLACK = 1.15  # streamed-all may take at most this multiple of its copy bound T_bound
P1B_LINK_SHARE = 0.80  # streamed-all's copies must reach this share of the link measured in the same process
P2_TIME_SLACK = 1.05  # ac+offload may take at most this multiple of checkpointing alone
P3_PEAK_SLACK = 1.05  # "no more memory than the anchor", within 5%
P4_OFF_SLACK = 1.02  # the engine installed but offloading nothing
P4_STREAMED_SLACK = 1.05  # the default engine on a model too small to need it
P4_PEAK_SLACK = 1.02
GRAD_TOLERANCE = 2e-2  # bf16 gradients: max |g - g_none| / max |g_none| over each tensor
P4_WORKLOAD = "small-h512"

DEFINITIONS = {
    "P1": f"copy bound: `streamed-all` (everything eligible offloaded, unpaced, no resident tail) runs within "
    f"{P1_BOUND_SLACK:.2f}x of T_bound = max(T_fwd, D/B_d2h) + max(T_bwd, D/B_h2d) + T_opt (phases of `none`, "
    "B measured in the same process, D = bytes offloaded), on every workload that ran it",
    "P1b": f"link use: `streamed-all`'s achieved D2H and H2D bandwidth each reach {P1B_LINK_SHARE:.0%} of the "
    "pinned link measured in the same process",
    "P2": f"checkpointing + offload: `ac+offload` takes at most {P2_TIME_SLACK:.2f}x the step time of "
    "checkpointing alone (HF `ac` and our `ac-ours`) at a lower peak than both",
    "P3": f"beats the anchors: for every anchor that ran, one of our offload-only rows has a peak within "
    f"{P3_PEAK_SLACK:.2f}x of the anchor's and a smaller step time",
    "P4": f"do no harm (`{P4_WORKLOAD}`): `off` within {P4_OFF_SLACK:.2f}x and `streamed` within "
    f"{P4_STREAMED_SLACK:.2f}x of `none`'s step time, peaks within {P4_PEAK_SLACK:.2f}x of `none`'s",
    "G": f"correctness: every row's first-step gradients agree with `none` (max relative difference <= "
    f"{GRAD_TOLERANCE:g})",
}


@dataclass
class Verdict:
    """One requirement, judged from the data.

    Attributes:
        key: ``P1``, ``P1b``, ``P2``, ``P3``, ``P4`` or ``G``.
        status: ``"met"``, ``"missed"`` or ``"n/a"`` (nothing measured to judge it).
        detail: the numbers behind the status.
    """

    key: str
    status: str
    detail: str


# ---------------------------------------------------------------------------------------------- derived numbers


def _ok(row: dict[str, Any] | None) -> bool:
    return row is not None and row.get("status") == "ok" and row.get("step_s") is not None


def rows_by_mode(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["mode"]: row for row in result.get("rows", [])}


def derive(result: dict[str, Any]) -> dict[str, Any]:
    """Add ratio to ``none``, GiB offloaded, bandwidths, stall and the copy bound to every measured row."""
    rows = rows_by_mode(result)
    none = rows.get("none")
    link = result.get("link") or {}
    for row in result.get("rows", []):
        if not _ok(row):
            continue
        row["ratio"] = row["step_s"] / none["step_s"] if _ok(none) else None
        engine = row.get("engine")
        if not engine:
            continue
        offloaded = engine.get("offloaded_bytes", 0.0)
        row["offloaded_gib"] = offloaded / GiB
        row["d2h_gbps"] = engine.get("d2h_gbps") or None
        row["h2d_gbps"] = engine.get("h2d_gbps") or None
        row["stall_ms"] = engine.get("stall_ms")
        # The bound uses the compute of the same model without offloading: `none`, or our checkpointing alone
        # for rows that checkpoint (their forward and backward include the recompute).
        compute = rows.get("ac-ours") if row.get("checkpoint") == "ours" else none
        row["t_bound_s"] = copy_bound(compute, offloaded, link) if _ok(compute) else None
        row["bound_ratio"] = row["step_s"] / row["t_bound_s"] if row.get("t_bound_s") else None
    return result


def copy_bound(compute: dict[str, Any], offloaded_bytes: float, link: dict[str, Any]) -> float | None:
    """T_bound = max(T_fwd, D/B_d2h) + max(T_bwd, D/B_h2d) + T_opt (REFERENCE §2); ``None`` without a link."""
    d2h, h2d = link.get("d2h_gbps"), link.get("h2d_gbps")
    if not d2h or not h2d:
        return None
    return (
        max(compute["fwd_s"], offloaded_bytes / (d2h * 1e9))
        + max(compute["bwd_s"], offloaded_bytes / (h2d * 1e9))
        + compute["opt_s"]
    )


# ---------------------------------------------------------------------------------------------- verdicts


def _combine(key: str, parts: list[tuple[bool, str]]) -> Verdict:
    if not parts:
        return Verdict(key, "n/a", "not measured")
    status = "met" if all(ok for ok, _ in parts) else "missed"
    return Verdict(key, status, "; ".join(text for _, text in parts))


def _peak(row: dict[str, Any]) -> float | None:
    return row.get("peak_alloc_gib")


def verdicts(results: Iterable[dict[str, Any]]) -> list[Verdict]:
    """P1, P1b, P2, P3, P4 and G, each met / missed / n/a with its numbers (rows must be :func:`derive`-d)."""
    results = list(results)
    p1: list[tuple[bool, str]] = []
    p1b: list[tuple[bool, str]] = []
    p2: list[tuple[bool, str]] = []
    p3: list[tuple[bool, str]] = []
    p4: list[tuple[bool, str]] = []
    grads: list[tuple[bool, str]] = []
    for result in results:
        name = result["workload"]["name"]
        rows = rows_by_mode(result)
        link = result.get("link") or {}
        everything = rows.get("streamed-all")
        if _ok(everything) and everything.get("bound_ratio"):
            ratio = everything["bound_ratio"]
            p1.append(
                (
                    ratio <= P1_BOUND_SLACK,
                    f"{name}: {everything['step_s']:.3f} s vs T_bound {everything['t_bound_s']:.3f} s "
                    f"({ratio:.2f}x, D = {everything.get('offloaded_gib', 0):.1f} GiB)",
                )
            )
        if _ok(everything) and link.get("d2h_gbps") and everything.get("d2h_gbps") and everything.get("h2d_gbps"):
            d2h_share = everything["d2h_gbps"] / link["d2h_gbps"]
            h2d_share = everything["h2d_gbps"] / link["h2d_gbps"]
            p1b.append(
                (
                    min(d2h_share, h2d_share) >= P1B_LINK_SHARE,
                    f"{name}: D2H {everything['d2h_gbps']:.1f}/{link['d2h_gbps']:.1f} GB/s ({d2h_share:.0%}), "
                    f"H2D {everything['h2d_gbps']:.1f}/{link['h2d_gbps']:.1f} GB/s ({h2d_share:.0%})",
                )
            )
        p2_part = _p2(name, rows)
        if p2_part is not None:
            p2.append(p2_part)
        p3.extend(_p3(name, rows))
        if name.startswith(P4_WORKLOAD):
            p4.extend(_p4(name, rows))
        for row in result.get("rows", []):
            diff = row.get("grad_rel_diff")
            if _ok(row) and row["mode"] != "none" and diff is not None:
                if diff > GRAD_TOLERANCE:
                    grads.append((False, f"{name}/{row['mode']}: {diff:.2e}"))
                else:
                    grads.append((True, ""))
    verdict_g = _combine("G", grads)
    if grads:
        worst = [text for ok, text in grads if not ok]
        verdict_g.detail = (
            f"{len(grads)} rows compared, all within {GRAD_TOLERANCE:g}" if not worst else "; ".join(worst)
        )
    return [
        _combine("P1", p1),
        _combine("P1b", p1b),
        _combine("P2", p2),
        _combine("P3", p3),
        _combine("P4", p4),
        verdict_g,
    ]


def _p2(name: str, rows: dict[str, dict[str, Any]]) -> tuple[bool, str] | None:
    both = rows.get("ac+offload")
    refs = [rows[m] for m in ("ac", "ac-ours") if _ok(rows.get(m))]
    if not _ok(both) or not refs:
        return None
    ok = True
    texts = []
    for ref in refs:
        time_ratio = both["step_s"] / ref["step_s"]
        ok &= time_ratio <= P2_TIME_SLACK
        text = f"{time_ratio:.3f}x the time of {ref['mode']}"
        if _peak(both) is not None and _peak(ref) is not None:
            ok &= _peak(both) < _peak(ref)
            text += f", peak {_peak(both):.1f} vs {_peak(ref):.1f} GiB"
        texts.append(text)
    return ok, f"{name}: " + "; ".join(texts)


def _p3(name: str, rows: dict[str, dict[str, Any]]) -> list[tuple[bool, str]]:
    ours = [
        r
        for r in rows.values()
        if _ok(r) and r["group"] == "ours" and not r.get("checkpoint") and r["mode"] != "off" and _peak(r) is not None
    ]
    parts = []
    for anchor in rows.values():
        if anchor["group"] != "anchor" or not _ok(anchor) or _peak(anchor) is None:
            continue
        fits = [r for r in ours if _peak(r) <= _peak(anchor) * P3_PEAK_SLACK]
        best = min(fits, key=lambda r: r["step_s"], default=None)
        if best is None:
            parts.append((False, f"{name}/{anchor['mode']}: none of ours reaches its peak {_peak(anchor):.1f} GiB"))
            continue
        parts.append(
            (
                best["step_s"] < anchor["step_s"],
                f"{name}/{anchor['mode']} ({anchor['ratio']:.2f}x, {_peak(anchor):.1f} GiB) vs {best['mode']} "
                f"({best['ratio']:.2f}x, {_peak(best):.1f} GiB)",
            )
        )
    return parts


def _p4(name: str, rows: dict[str, dict[str, Any]]) -> list[tuple[bool, str]]:
    none = rows.get("none")
    if not _ok(none):
        return []
    parts = []
    for mode, slack in (("off", P4_OFF_SLACK), ("streamed", P4_STREAMED_SLACK)):
        row = rows.get(mode)
        if not _ok(row):
            continue
        ratio = row["step_s"] / none["step_s"]
        ok = ratio <= slack
        text = f"{name}/{mode}: {ratio:.3f}x"
        if _peak(row) is not None and _peak(none) is not None:
            ok &= _peak(row) <= _peak(none) * P4_PEAK_SLACK
            text += f", peak {_peak(row):.2f} vs {_peak(none):.2f} GiB"
        parts.append((ok, text))
    return parts


# ---------------------------------------------------------------------------------------------- output


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec)


COLUMNS = (
    ("mode", "mode", "s"),
    ("status", "status", "s"),
    ("step s", "step_s", ".3f"),
    ("ratio", "ratio", ".2f"),
    ("tok/s", "tokens_per_s", ".0f"),
    ("peak GiB", "peak_alloc_gib", ".1f"),
    ("reserved GiB", "peak_reserved_gib", ".1f"),
    ("offloaded GiB", "offloaded_gib", ".2f"),
    ("D2H GB/s", "d2h_gbps", ".1f"),
    ("H2D GB/s", "h2d_gbps", ".1f"),
    ("stall ms", "stall_ms", ".1f"),
    ("fwd/bwd/opt s", None, ""),
    ("T_bound s", "t_bound_s", ".3f"),
    ("step/T_bound", "bound_ratio", ".2f"),
    ("grad rel diff", "grad_rel_diff", ".1e"),
)


def _cells(row: dict[str, Any]) -> list[str]:
    cells = []
    for _, key, spec in COLUMNS:
        if key is None:
            phases = [row.get(k) for k in ("fwd_s", "bwd_s", "opt_s")]
            cells.append("/".join(_fmt(p, ".3f") for p in phases) if all(p is not None for p in phases) else "-")
        else:
            cells.append(_fmt(row.get(key), spec))
    return cells


def markdown(results: list[dict[str, Any]], name: str) -> str:
    """The report: environment, link, verdicts, one table per workload, definitions."""
    lines = [f"# Activation offloading benchmark: {name}", ""]
    env = next((r.get("env") for r in results if r.get("env")), {}) or {}
    lines += ["## Environment", "", "| | |", "|---|---|"]
    for key in ("gpu", "driver", "cuda", "torch", "transformers", "peft", "python", "cpu_count"):
        lines.append(f"| {key} | {env.get(key, '-')} |")
    anchor_versions = env.get("anchors") or {}
    lines.append("| anchors | " + ", ".join(f"{k} {v}" for k, v in anchor_versions.items() if v) + " |")
    lines += ["", "## Link (pinned, measured in each workload's process)", ""]
    lines += ["| workload | D2H GB/s | H2D GB/s | both at once GB/s |", "|---|---|---|---|"]
    for r in results:
        link = r.get("link") or {}
        lines.append(
            f"| {r['workload']['name']} | {_fmt(link.get('d2h_gbps'), '.1f')} | {_fmt(link.get('h2d_gbps'), '.1f')} "
            f"| {_fmt(link.get('both_gbps'), '.1f')} |"
        )
    lines += ["", "## Verdicts", "", "| | status | numbers |", "|---|---|---|"]
    for v in verdicts(results):
        lines.append(f"| {v.key} | **{v.status}** | {v.detail} |")
    lines += [""]
    for r in results:
        w = r["workload"]
        training = "LoRA r16, all linear, base frozen" if w["lora"] else "full fine-tuning, AdamW"
        lines += [
            f"## {w['name']}",
            "",
            f"hidden {w['hidden']}, {w['layers']} layers, intermediate {w['intermediate']}, {w['heads']} heads / "
            f"{w['kv_heads']} kv heads, vocab {w['vocab']}, b{w['batch']}xs{w['seq']}, {training}; "
            f"{r.get('warmup')} warm-up + {r.get('steps')} timed steps (median)"
            + (
                f", anchors {r.get('anchor_warmup')} + {r.get('anchor_steps')}"
                if (r.get("anchor_steps"), r.get("anchor_warmup")) != (r.get("steps"), r.get("warmup"))
                else ""
            )
            + (f"; worker wall time {r['wall_s']:.0f} s" if r.get("wall_s") else "")
            + (f"; ended early: {r['error']}" if r.get("error") else ""),
            "",
            "| " + " | ".join(title for title, _, _ in COLUMNS) + " |",
            "|" + "---|" * len(COLUMNS),
        ]
        for row in r.get("rows", []):
            lines.append("| " + " | ".join(_cells(row)) + " |")
        lines.append("")
    lines += ["## Definitions", ""]
    lines += [f"- **{key}**: {text}" for key, text in DEFINITIONS.items()]
    lines += [
        "- ratio: median step time / `none`'s. Peak: `torch.cuda.max_memory_allocated` over the timed steps. "
        "Offloaded GiB, GB/s and stall: our engine's stats (`measure_copies=True`), median per step.",
        "",
    ]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    """Peak GiB against step-time ratio, one panel per workload: points for baselines and anchors, our curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = max(1, len(results))
    fig, axes = plt.subplots(1, count, figsize=(5.2 * count, 4.4), squeeze=False)
    styles = {"baseline": ("s", "tab:gray"), "anchor": ("^", "tab:red"), "ours": ("o", "tab:blue")}
    for ax, result in zip(axes[0], results, strict=False):
        ax.set_title(result["workload"]["name"])
        ax.set_xlabel("step time / none")
        ax.set_ylabel("peak allocated GiB")
        rows = [r for r in result.get("rows", []) if _ok(r) and r.get("ratio") and _peak(r) is not None]
        if not rows:
            ax.text(0.5, 0.5, "no GPU memory data", ha="center", va="center", transform=ax.transAxes)
            continue
        curve = sorted((r for r in rows if r.get("sweep")), key=lambda r: r["ratio"])
        if curve:
            ax.plot([r["ratio"] for r in curve], [_peak(r) for r in curve], "-", color="tab:blue", alpha=0.6)
        for row in rows:
            marker, color = styles.get(row["group"], ("x", "black"))
            ax.plot(row["ratio"], _peak(row), marker, color=color)
            ax.annotate(row["mode"], (row["ratio"], _peak(row)), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.grid(alpha=0.3)
    from matplotlib.lines import Line2D

    legend = [Line2D([], [], marker=m, color=c, linestyle="", label=group) for group, (m, c) in styles.items()] + [
        Line2D([], [], color="tab:blue", alpha=0.6, label="our curve (tail / pacing)")
    ]
    axes[0][0].legend(handles=legend, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def terminal_table(results: list[dict[str, Any]]) -> str:
    """A compact table for stdout."""
    out = [f"{'workload':<18} {'mode':<13} {'status':<10} {'ratio':>6} {'peak GiB':>9} {'offl GiB':>9} {'grad':>8}"]
    for result in results:
        for row in result.get("rows", []):
            status = row["status"] if len(row["status"]) <= 10 else row["status"][:9] + "…"
            out.append(
                f"{result['workload']['name']:<18} {row['mode']:<13} {status:<10} {_fmt(row.get('ratio'), '.2f'):>6} "
                f"{_fmt(row.get('peak_alloc_gib'), '.1f'):>9} {_fmt(row.get('offloaded_gib'), '.2f'):>9} "
                f"{_fmt(row.get('grad_rel_diff'), '.0e'):>8}"
            )
    for v in verdicts(results):
        out.append(f"{v.key:<4} {v.status:<7} {v.detail}")
    return "\n".join(out)


def verdicts_json(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [asdict(v) for v in verdicts(results)]
