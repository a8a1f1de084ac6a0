"""From the workers' raw rows to derived numbers, verdicts, a Markdown report, a plot and a terminal table.

Everything here is plain computation on dictionaries (no torch), so the verdicts can be unit-tested with
hand-made numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.workloads import ABSOLUTE_BUDGET_MODES, BUDGET_MODES, full_name

GiB = 1 << 30

# Verdict thresholds, as the issue states them. Times are step-time ratios; peaks are GiB of max_memory_allocated.
P1_BOUND_SLACK = 1.15  # streamed-all within 15% of its copy bound T_bound
P2_TIME_SLACK = 1.03  # ac+offload at most 1.03x the step time of `ac`
P2_INPUT_SHARE = 0.80  # ... at a peak at least 80% of the checkpoint-input bytes below `ac`'s
P3_TIME_SLACK = 1.05  # "free": at most 1.05x `none`
P4_OFF_SLACK = 1.02  # the callback present, nothing offloaded
P4_STREAMED_SLACK = 1.05  # the default engine on a model too small to need it
GRAD_TOLERANCE = 2e-2  # bf16 gradients: max |g - g_none| / max |g_none| over each tensor
P4_WORKLOAD = "small-h512"
# The memory-budget planner (`memory_budget`).
B1_MIN_BUDGETS = 3  # budget rows per workload that must run under their cap
B2_TIME_SLACK = 1.05  # a budget row at most 1.05x the fastest other row that fits under the same budget
B3_SMALLVOCAB_FACTOR = 1.5  # capacity on the small-vocab model: at least 1.5x AC's longest sequence
B3_SMALLVOCAB = "smallvocab"
B4_TIME_SLACK = 1.05  # `ours-default` at most 1.05x `none`
B5_RESERVED_RATIO = 1.10  # peak reserved / peak allocated in every row of ours that offloads
DEFAULT_MODE = "ours-default"
CAPACITY_OURS = "ours-budget"
CAPACITY_REFERENCES = ("ac", "save_on_cpu", "torchtune", "trl")

DEFINITIONS = {
    "P1": f"engine at the physical limit: `streamed-all` (everything eligible offloaded) within {P1_BOUND_SLACK:.2f}x "
    "of T_bound = max(T_fwd, D/B_d2h) + max(T_bwd, D/B_h2d) + T_opt (T_* of `none`, B measured in the same "
    "process, D = bytes offloaded)",
    "P1b": "ahead of every anchor: for each anchor row, one of our offloading rows (no checkpointing) has peak <= "
    "the anchor's and step time <= the anchor's",
    "P2": f"`ac+offload` at most {P2_TIME_SLACK:.2f}x the step time of `ac`, peak <= `ac` peak minus "
    f"{P2_INPUT_SHARE:.0%} of the checkpoint-input bytes (layers x batch x seq x hidden x 2)",
    "P3": f"free memory: the largest peak reduction among our rows at <= {P3_TIME_SLACK:.2f}x `none`, next to "
    "link bandwidth x forward time",
    "P4": f"do no harm: `off` <= {P4_OFF_SLACK:.2f}x `none` wherever it ran; on `{P4_WORKLOAD}` `streamed` <= "
    f"{P4_STREAMED_SLACK:.2f}x `none`",
    "G": f"every row's first-step gradients agree with `none` within bf16 rounding (max relative difference <= "
    f"{GRAD_TOLERANCE:g}, or twice the difference of `none` to itself in a repeated first step where that is more: "
    "kernels that add in a varying order make identical bf16 steps differ)",
    "B1": f"never OOMs under the cap: on every workload at least {B1_MIN_BUDGETS} `ours-budget-*` rows ran under a "
    "hard cap equal to their budget (`set_per_process_memory_fraction`) and none ran out of memory (budgets below "
    "the `ours-budget-floor` row's are shown, not counted: the range starts at the plan floor)",
    "B2": f"at each budget from the plan floor up, step time <= {B2_TIME_SLACK:.2f}x the fastest other row (AC, "
    "anchors, our hand-tuned rows) whose peak allocated fits under the budget; one whose peak reserved does not is run "
    "again under the budget's hard cap, and counts as it trained there (not at all if it ran out of memory)",
    "B3": "capacity: under each hard cap, our longest trainable sequence (`memory_budget=cap`) >= the longest of AC "
    f"and every anchor that ran; on the small-vocab model >= {B3_SMALLVOCAB_FACTOR:g}x AC's",
    "B4": f"`{DEFAULT_MODE}` (no arguments) <= {B4_TIME_SLACK:.2f}x `none` on every workload where `none` fits",
    "B5": f"peak reserved <= {B5_RESERVED_RATIO:.2f}x peak allocated in every row of ours that offloads",
}
NO_BUDGET_API = "not measured: memory_budget not available"


@dataclass
class Verdict:
    """One requirement, judged from the data.

    Attributes:
        key: ``P1``, ``P1b``, ``P2``, ``P3``, ``P4``, ``G`` or ``B1``-``B5``.
        status: ``"met"``, ``"missed"``, ``"undetermined"`` (measured, but the numbers' bounds cannot decide it)
            or ``"n/a"`` (nothing measured to judge it).
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
        if row.get("peak_alloc_gib") and row.get("peak_reserved_gib") is not None:
            row["reserved_ratio"] = row["peak_reserved_gib"] / row["peak_alloc_gib"]
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
        compute = {"ours": rows.get("ac-ours"), "ours-elementwise": rows.get("sac")}.get(row.get("checkpoint"), none)
        row["t_bound_s"] = copy_bound(compute, offloaded, link) if _ok(compute) else None
        row["bound_ratio"] = row["step_s"] / row["t_bound_s"] if row.get("t_bound_s") else None
    return result


def copy_bound(compute: dict[str, Any], offloaded_bytes: float, link: dict[str, Any]) -> float | None:
    """The fastest step offloading ``D`` bytes can take: forward and backward each last as long as the longer of
    their compute and their copies, T_bound = max(T_fwd, D/B_d2h) + max(T_bwd, D/B_h2d) + T_opt, with the link's
    measured bandwidths B; ``None`` without a link measurement."""
    d2h, h2d = link.get("d2h_gbps"), link.get("h2d_gbps")
    if not d2h or not h2d:
        return None
    return (
        max(compute["fwd_s"], offloaded_bytes / (d2h * 1e9))
        + max(compute["bwd_s"], offloaded_bytes / (h2d * 1e9))
        + compute["opt_s"]
    )


# ---------------------------------------------------------------------------------------------- verdicts


def _combine(key: str, parts: list[tuple[bool | None, str]], empty: str = "not measured") -> Verdict:
    """``missed`` if any part failed, ``met`` if all passed, ``undetermined`` if some could not be decided."""
    if not parts:
        return Verdict(key, "n/a", empty)
    if any(ok is False for ok, _ in parts):
        status = "missed"
    elif all(ok for ok, _ in parts):
        status = "met"
    else:
        status = "undetermined"
    return Verdict(key, status, "; ".join(text for _, text in parts))


def _peak(row: dict[str, Any]) -> float | None:
    return row.get("peak_alloc_gib")


def verdicts(results: Iterable[dict[str, Any]]) -> list[Verdict]:
    """P1, P1b, P2, P3, P4, G, B1, B2, B4 and B5, each met / missed / n/a with its numbers.

    Rows must be :func:`derive`-d. B3 needs a capacity run: :func:`capacity_verdicts`.
    """
    results = list(results)
    parts: dict[str, list[tuple[bool, str]]] = {key: [] for key in ("P1", "P1b", "P2", "P3", "P4", "G")}
    noises: list[str] = []  # what `none` differs from itself by, per workload that measured it
    for result in results:
        name = result["workload"]["name"]
        rows = rows_by_mode(result)
        everything = rows.get("streamed-all")
        if _ok(everything) and everything.get("bound_ratio"):
            ratio = everything["bound_ratio"]
            parts["P1"].append(
                (
                    ratio <= P1_BOUND_SLACK,
                    f"{name}: {everything['step_s']:.3f} s vs T_bound {everything['t_bound_s']:.3f} s "
                    f"({ratio:.2f}x, D = {everything.get('offloaded_gib', 0):.1f} GiB)",
                )
            )
        parts["P1b"].extend(_p1b(name, rows))
        p2 = _p2(result, rows)
        if p2 is not None:
            parts["P2"].append(p2)
        p3 = _p3(result, rows)
        if p3 is not None:
            parts["P3"].append(p3)
        parts["P4"].extend(_p4(name, rows))
        tolerance = grad_tolerance(rows)
        noise = rows.get("none", {}).get("grad_noise")
        if noise is not None:
            noises.append(f"{name} {noise:.1e}")
        for row in result.get("rows", []):
            diff = row.get("grad_rel_diff")
            if _ok(row) and row["mode"] != "none" and diff is not None:
                parts["G"].append((diff <= tolerance, f"{name}/{row['mode']}: {diff:.2e} (tolerance {tolerance:.2e})"))
    out = [_combine(key, parts[key]) for key in ("P1", "P1b", "P2", "P3", "P4")]
    grads = parts["G"]
    verdict_g = _combine("G", grads)
    if grads:
        worst = [text for ok, text in grads if not ok]
        verdict_g.detail = (
            f"{len(grads)} rows compared, all within {GRAD_TOLERANCE:g} or twice `none` against itself"
            + (f" ({', '.join(noises)})" if noises else "")
            if not worst
            else "; ".join(worst)
        )
    return [*out, verdict_g, *budget_verdicts(results)]


def grad_tolerance(rows: dict[str, dict[str, Any]]) -> float:
    """The largest first-step gradient difference to `none` that is rounding: :data:`GRAD_TOLERANCE`, or twice what
    `none` differs from itself in a repeated step (``grad_noise``) where its kernels add in a varying order."""
    noise = rows.get("none", {}).get("grad_noise")
    return max(GRAD_TOLERANCE, 2 * noise) if noise is not None else GRAD_TOLERANCE


def _plan_recomputes(row: dict[str, Any]) -> bool:
    """Whether the memory-budget plan a row ran checkpoints blocks (whole, by parts or with elementwise recompute):
    such a row has no ``checkpoint`` of its own, its plan puts the checkpointing in."""
    plan = row.get("plan") or {}
    return bool(plan.get("checkpoint_blocks") or plan.get("light_blocks"))


def _offload_rows(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Our rows that offload without checkpointing: the points of our time-versus-memory curve (a planner row whose
    plan checkpoints blocks is not one)."""
    return [
        r
        for r in rows.values()
        if _ok(r)
        and r["group"] == "ours"
        and not r.get("checkpoint")
        and not _plan_recomputes(r)
        and r["mode"] != "off"
        and _peak(r) is not None
    ]


def _p1b(name: str, rows: dict[str, dict[str, Any]]) -> list[tuple[bool, str]]:
    ours = _offload_rows(rows)
    parts = []
    for anchor in rows.values():
        if anchor["group"] != "anchor" or not _ok(anchor) or _peak(anchor) is None:
            continue
        fits = [r for r in ours if _peak(r) <= _peak(anchor)]
        best = min(fits, key=lambda r: r["step_s"], default=None)
        if best is None:
            parts.append((False, f"{name}/{anchor['mode']}: none of ours reaches its peak {_peak(anchor):.1f} GiB"))
            continue
        parts.append(
            (
                best["step_s"] <= anchor["step_s"],
                f"{name}/{anchor['mode']} ({_fmt(anchor['ratio'], '.2f')}x, {_peak(anchor):.1f} GiB) vs "
                f"{best['mode']} ({_fmt(best['ratio'], '.2f')}x, {_peak(best):.1f} GiB): "
                f"{anchor['step_s'] / best['step_s']:.2f}x faster",
            )
        )
    return parts


def checkpoint_input_gib(workload: dict[str, Any]) -> float:
    """Bytes saved per step by checkpointing every decoder layer: each layer's bf16 input."""
    return workload["layers"] * workload["batch"] * workload["seq"] * workload["hidden"] * 2 / GiB


def _p2(result: dict[str, Any], rows: dict[str, dict[str, Any]]) -> tuple[bool, str] | None:
    both, ac = rows.get("ac+offload"), rows.get("ac")
    if not _ok(both) or not _ok(ac) or _peak(both) is None or _peak(ac) is None:
        return None
    inputs = checkpoint_input_gib(result["workload"])
    time_ratio = both["step_s"] / ac["step_s"]
    target = _peak(ac) - P2_INPUT_SHARE * inputs
    ok = time_ratio <= P2_TIME_SLACK and _peak(both) <= target
    return (
        ok,
        f"{result['workload']['name']}: {time_ratio:.3f}x the time of `ac`; peak {_peak(both):.2f} GiB vs `ac` "
        f"{_peak(ac):.2f} GiB (target <= {target:.2f}: checkpoint inputs {inputs:.2f} GiB)",
    )


def _p3(result: dict[str, Any], rows: dict[str, dict[str, Any]]) -> tuple[bool, str] | None:
    none = rows.get("none")
    if not _ok(none) or _peak(none) is None:
        return None
    free = [r for r in _offload_rows(rows) if r["ratio"] is not None and r["ratio"] <= P3_TIME_SLACK]
    link = (result.get("link") or {}).get("d2h_gbps")
    fwd = none.get("fwd_s")
    expected = link * 1e9 * fwd / GiB if link and fwd else None
    name = result["workload"]["name"]
    if not free:
        return False, f"{name}: no row of ours within {P3_TIME_SLACK:.2f}x"
    best = max(free, key=lambda r: _peak(none) - _peak(r))
    saved = _peak(none) - _peak(best)
    text = f"{name}: {best['mode']} saves {saved:.2f} GiB of peak at {best['ratio']:.3f}x"
    if expected is not None:
        text += f"; link x forward time = {expected:.2f} GiB"
    return saved > 0, text


def _p4(name: str, rows: dict[str, dict[str, Any]]) -> list[tuple[bool, str]]:
    none = rows.get("none")
    if not _ok(none):
        return []
    parts = []
    checks = [("off", P4_OFF_SLACK)] + (
        [("streamed", P4_STREAMED_SLACK)] if full_name(name).startswith(P4_WORKLOAD) else []
    )
    for mode, slack in checks:
        row = rows.get(mode)
        if _ok(row):
            ratio = row["step_s"] / none["step_s"]
            parts.append((ratio <= slack, f"{name}/{mode}: {ratio:.3f}x"))
    return parts


# ---------------------------------------------------------------------------------------------- the planner (B*)


def _is_planner_row(row: dict[str, Any]) -> bool:
    return row["mode"] in BUDGET_MODES or row["mode"] in ABSOLUTE_BUDGET_MODES or row["mode"] == DEFAULT_MODE


def _budget_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    budgets = (*BUDGET_MODES, *ABSOLUTE_BUDGET_MODES)
    return [row for row in result.get("rows", []) if row["mode"] in budgets]


def _ran(row: dict[str, Any]) -> bool:
    """It was run (measured, out of memory or failed), as opposed to skipped or not measurable."""
    return row.get("status", "").split(":")[0] not in ("not measured", "skipped", "not available")


def budget_verdicts(results: list[dict[str, Any]]) -> list[Verdict]:
    """B1, B2, B4 and B5 from the workload rows (B3 comes from capacity runs)."""
    b1: list[tuple[bool | None, str]] = []
    b2: list[tuple[bool | None, str]] = []
    b4: list[tuple[bool | None, str]] = []
    b5: list[tuple[bool | None, str]] = []
    no_api = False
    for result in results:
        name = result["workload"]["name"]
        rows = rows_by_mode(result)
        budget_rows = _budget_rows(result)
        no_api = no_api or any(row.get("status") == NO_BUDGET_API for row in budget_rows)
        ran = [row for row in budget_rows if _ran(row)]
        if ran:
            below = _below_floor(ran)
            b1.append(_b1(name, ran, below))
            b2.extend(_b2(name, row, rows) for row in ran if row not in below)
        b4_part = _b4(name, rows, result.get("default_alternating"))
        if b4_part is not None:
            b4.append(b4_part)
        b5.extend(_b5(name, result))
    empty = NO_BUDGET_API if no_api else "not measured"
    return [
        _combine("B1", b1, empty),
        _combine("B2", b2, empty),
        _combine("B4", b4),
        _combine("B5", b5),
    ]


def _below_floor(ran: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Budget rows below the ``ours-budget-floor`` row's budget: the issue's range (B1, B2) starts at the plan floor,
    so they are shown and not counted."""
    floors = [row["budget_gib"] for row in ran if row["mode"] == "ours-budget-floor" and row.get("budget_gib")]
    return [row for row in ran if floors and row.get("budget_gib") is not None and row["budget_gib"] < floors[0]]


def _b1(name: str, ran: list[dict[str, Any]], below: list[dict[str, Any]]) -> tuple[bool, str]:
    cells = ", ".join(
        f"{row['mode']} under {_fmt(row.get('budget_gib'), '.1f')} GiB: {row['status']}"
        + (" (below the floor: not counted)" if row in below else "")
        for row in ran
    )
    ran = [row for row in ran if row not in below]
    fine = [row for row in ran if row["status"] == "ok"]
    failed = [row for row in ran if row["status"] != "ok"]
    ok = len(fine) >= B1_MIN_BUDGETS and not failed
    count = f"{len(fine)} of {len(ran)} budgets ran" + ("" if len(fine) >= B1_MIN_BUDGETS else f" (< {B1_MIN_BUDGETS})")
    return ok, f"{name}: {count}; {cells}"


def references_in_doubt(budget_row: dict[str, Any], rows: Iterable[dict[str, Any]]) -> list[str]:
    """The rows B2 compares ``budget_row`` with whose fit its hard cap may deny: their peak allocated fits under the
    budget, their peak reserved does not (a cap counts reserved bytes). The worker runs them again under that cap
    (the budget row's ``capped_references``) to find out whether, and how fast, they train there."""
    budget = budget_row.get("budget_gib")
    if budget is None:
        return []
    return [
        r["mode"]
        for r in rows
        if _b2_candidate(r, budget) and r.get("peak_reserved_gib") is not None and r["peak_reserved_gib"] > budget
    ]


def _b2_candidate(row: dict[str, Any], budget: float) -> bool:
    return _ok(row) and not _is_planner_row(row) and _peak(row) is not None and _peak(row) <= budget


def _b2_reference(row: dict[str, Any], capped: dict[str, Any] | None) -> tuple[float, str] | None:
    """A B2 reference's step time and how it is shown: run again under the budget's cap where it was (``None``: it
    ran out of memory there), else as measured (also where its second run failed otherwise: that says nothing of
    whether it fits, and is shown)."""
    if capped is None or (not _ok(capped) and capped.get("status") != "OOM"):
        failed = f" (its run under the same cap: {capped.get('status')})" if capped is not None else ""
        return row["step_s"], f"{row['mode']} {row['step_s']:.3f} s at {_peak(row):.1f} GiB{failed}"
    if not _ok(capped):
        return None
    shown = f"{row['mode']} {capped['step_s']:.3f} s under the same cap ({row['step_s']:.3f} s without)"
    return capped["step_s"], shown


def _b2(name: str, row: dict[str, Any], rows: dict[str, dict[str, Any]]) -> tuple[bool, str]:
    budget = row.get("budget_gib")
    label = f"{name}/{row['mode']} ({_fmt(budget, '.1f')} GiB)"
    if not _ok(row):
        return False, f"{label}: {row['status']}"
    capped = row.get("capped_references") or {}
    fitting = [r for r in rows.values() if budget is not None and _b2_candidate(r, budget)]
    denied = [r["mode"] for r in fitting if (capped.get(r["mode"]) or {}).get("status") == "OOM"]
    references = [ref for r in fitting if (ref := _b2_reference(r, capped.get(r["mode"]))) is not None]
    denials = ", ".join(f"{mode} {capped[mode]['status']}" for mode in denied)
    denied_text = f"; under the same cap {denials}" if denied else ""
    if not references:
        return True, f"{label}: {row['step_s']:.3f} s; no other row fits under the budget{denied_text}"
    best_s, best_text = min(references, key=lambda ref: ref[0])
    ratio = row["step_s"] / best_s
    return ratio <= B2_TIME_SLACK, f"{label}: {row['step_s']:.3f} s vs {best_text} ({ratio:.2f}x){denied_text}"


def _b4(
    name: str, rows: dict[str, dict[str, Any]], alternating: dict[str, Any] | None = None
) -> tuple[bool, str] | None:
    """The default's cost where `none` fits: by the rows, or, where the merge attached one, by the alternating
    measurement of ``python -m benchmarks.interleaved`` (the rows' ratio then shown next to it)."""
    none, default = rows.get("none"), rows.get(DEFAULT_MODE)
    if not _ok(none) or default is None or not _ran(default):
        return None
    if not _ok(default):
        return False, f"{name}: {DEFAULT_MODE} {default['status']} where `none` fits"
    ratio = default["step_s"] / none["step_s"]
    peaks = ""
    if _peak(default) is not None and _peak(none) is not None:
        peaks = f", peak {_peak(default):.1f} vs {_peak(none):.1f} GiB"
    if alternating is None:
        return ratio <= B4_TIME_SLACK, f"{name}: {ratio:.3f}x{peaks}"
    return (
        alternating["ratio"] <= B4_TIME_SLACK,
        f"{name}: {alternating['ratio']:.3f}x in alternating steps ({alternating['steps']} each, "
        f"`{alternating['source_run']}`; the sequential rows {ratio:.3f}x){peaks}",
    )


def _offloads(row: dict[str, Any]) -> bool:
    engine = row.get("engine") or {}
    return row.get("group") == "ours" and (engine.get("offloaded_bytes") or 0) > 0


def _b5(name: str, result: dict[str, Any]) -> list[tuple[bool, str]]:
    parts = []
    for row in result.get("rows", []):
        if not _ok(row) or not _offloads(row) or not row.get("peak_alloc_gib") or row.get("peak_reserved_gib") is None:
            continue
        ratio = row["peak_reserved_gib"] / row["peak_alloc_gib"]
        parts.append(
            (
                ratio <= B5_RESERVED_RATIO,
                f"{name}/{row['mode']}: {row['peak_reserved_gib']:.2f} / {row['peak_alloc_gib']:.2f} GiB = {ratio:.3f}",
            )
        )
    return parts


# ---------------------------------------------------------------------------------------------- capacity (B3)


def bounds(entry: dict[str, Any]) -> tuple[int, float] | None:
    """(longest sequence known to fit, most it can be; ``inf`` when unbounded) of a search, ``None`` if it never ran."""
    if not entry.get("probes"):
        return None
    upper = entry.get("upper")
    if upper is None and entry.get("first_fail") is not None and not entry.get("capped"):
        upper = entry["first_fail"] - entry["step"]
    return entry.get("longest", 0), math.inf if upper is None else upper


def _show(entry_bounds: tuple[int, float]) -> str:
    lower, upper = entry_bounds
    if upper == lower:
        return f"{lower}"
    if upper == math.inf:
        return f">= {lower}"
    return f"{lower}..{int(upper)}"


def capacity_verdicts(capacity: list[dict[str, Any]]) -> list[Verdict]:
    """B3 (our longest sequence against AC and the anchors under each cap) and B5 of our capacity rows."""
    b3: list[tuple[bool | None, str]] = []
    b5: list[tuple[bool | None, str]] = []
    no_api = False
    for result in capacity:
        name = f"{result['model']['name']} @ {result['cap_gib']:g} GiB"
        entries = {entry["mode"]: entry for entry in result.get("searches", [])}
        ours = entries.get(CAPACITY_OURS)
        if ours is not None and ours.get("status") == NO_BUDGET_API:
            no_api = True
        if ours is not None and ours.get("peak_alloc_gib") and ours.get("peak_reserved_gib") is not None:
            ratio = ours["peak_reserved_gib"] / ours["peak_alloc_gib"]
            b5.append((ratio <= B5_RESERVED_RATIO, f"capacity {name}/{CAPACITY_OURS}: {ratio:.3f}"))
        ours_bounds = bounds(ours) if ours is not None else None
        if ours_bounds is None:
            continue
        references = {
            mode: b for mode in CAPACITY_REFERENCES if mode in entries and (b := bounds(entries[mode])) is not None
        }
        if not references:
            continue
        b3.append(_b3(name, ours_bounds, references))
        if full_name(result["model"]["name"]).startswith(B3_SMALLVOCAB) and "ac" in references:
            b3.append(_b3_factor(name, ours_bounds, references["ac"]))
    return [_combine("B3", b3, NO_BUDGET_API if no_api else "not measured"), _combine("B5", b5)]


def _b3(name: str, ours: tuple[int, float], references: dict[str, tuple[int, float]]) -> tuple[bool | None, str]:
    best_lower = max(lower for lower, _ in references.values())
    best_upper = max(upper for _, upper in references.values())
    text = f"{name}: ours {_show(ours)} vs " + ", ".join(f"{mode} {_show(b)}" for mode, b in references.items())
    if ours[0] >= best_upper:
        return True, text
    if ours[1] < best_lower:
        return False, text
    return None, text + " (the searches' bounds overlap)"


def _b3_factor(name: str, ours: tuple[int, float], ac: tuple[int, float]) -> tuple[bool | None, str]:
    text = f"{name}: ours {_show(ours)} vs {B3_SMALLVOCAB_FACTOR:g}x AC's {_show(ac)}"
    if ac[1] == math.inf:
        return None, text + " (AC reached the search's maximum)"
    if ours[0] >= B3_SMALLVOCAB_FACTOR * ac[1]:
        return True, text
    if ours[1] < B3_SMALLVOCAB_FACTOR * ac[0]:
        return False, text
    return None, text + " (the searches' bounds overlap)"


def _capacity_cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "-"
    status = entry.get("status", "")
    if not entry.get("probes"):
        return status or "-"
    b = bounds(entry)
    assert b is not None
    text = _show(b)
    if entry.get("capped"):
        text += " (max)"
    if entry.get("tokens_per_s"):
        text += f", {entry['tokens_per_s']:.0f} tok/s"
    if entry.get("peak_alloc_gib") is not None:
        text += f", {entry['peak_alloc_gib']:.1f}/{_fmt(entry.get('peak_reserved_gib'), '.1f')} GiB"
    if entry.get("allocator") == "fixed":  # our engine switches expandable segments on: say where a search ran without
        text += ", fixed segments"
    if status != "ok":
        text += f" ({status})"
    return text


def capacity_markdown(capacity: list[dict[str, Any]], name: str) -> str:
    """Longest trainable sequence per model, cap and mode, with B3 and B5."""
    lines = [f"# Capacity under hard memory caps: {name}", ""]
    simulated = any(result.get("simulated") for result in capacity)
    if simulated:
        lines += [
            "**Simulated caps (no CUDA): whether a sequence fits comes from a memory formula, not from a device; "
            "these numbers are not measurements.**",
            "",
        ]
    env = next((r.get("env") for r in capacity if r.get("env")), {}) or {}
    lines += [
        f"Device: {env.get('gpu', '-')}; torch {env.get('torch', '-')}; models: {env.get('model_impl', '-')}; "
        f"memory_budget available: {env.get('memory_budget_api', '-')}.",
        "",
        "Each cell: longest sequence (batch 1, in steps of the search) that trained every step without running out "
        "of memory (`a..b`: between a and b, the search was cut short; `>= a`: nothing failed up to there), "
        "tokens/s at it, peak allocated/reserved GiB.",
        "",
        "## Verdicts",
        "",
        "| | status | numbers |",
        "|---|---|---|",
    ]
    for v in capacity_verdicts(capacity):
        lines.append(f"| {v.key} | **{v.status}** | {v.detail} |")
    lines.append("")
    by_model: dict[str, list[dict[str, Any]]] = {}
    for result in capacity:
        by_model.setdefault(result["model"]["name"], []).append(result)
    for model, results in by_model.items():
        results = sorted(results, key=lambda r: r["cap_gib"])
        w = results[0]["model"]
        training = "LoRA r16" if w.get("lora") else "full fine-tuning"
        lines += [
            f"## {model}",
            "",
            f"hidden {w['hidden']}, {w['layers']} layers, intermediate {w['intermediate']}, vocab {w['vocab']}, "
            f"{training}; {results[0].get('steps', '-')} steps per probe",
            "",
            "| mode | " + " | ".join(f"{r['cap_gib']:g} GiB" for r in results) + " |",
            "|---|" + "---|" * len(results),
        ]
        modes = list(dict.fromkeys(e["mode"] for r in results for e in r.get("searches", [])))
        for mode in modes:
            cells = [
                _capacity_cell(next((e for e in r.get("searches", []) if e["mode"] == mode), None)) for r in results
            ]
            lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        probes = " | ".join(
            f"{sum(len(e.get('probes', [])) for e in r.get('searches', []))} probes"
            + (f", {r['wall_s']:.0f} s" if r.get("wall_s") else "")
            + (f", {r['error']}" if r.get("error") else "")
            for r in results
        )
        lines += [f"| (worker) | {probes} |", ""]
    lines += ["## Definitions", ""]
    lines += [f"- **{key}**: {DEFINITIONS[key]}" for key in ("B3", "B5")]
    lines.append("")
    return "\n".join(lines)


def capacity_table(capacity: list[dict[str, Any]]) -> str:
    """A compact capacity table for stdout."""
    out = [f"{'model':<18} {'cap':>5} {'mode':<13} result"]
    for result in capacity:
        for entry in result.get("searches", []):
            out.append(
                f"{result['model']['name']:<18} {result['cap_gib']:>5g} {entry['mode']:<13} {_capacity_cell(entry)}"
            )
        if result.get("error"):
            out.append(f"{result['model']['name']:<18} {result['cap_gib']:>5g} {'(worker)':<13} {result['error']}")
    for v in capacity_verdicts(capacity):
        out.append(f"{v.key:<4} {v.status:<7} {v.detail}")
    return "\n".join(out)


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
    ("res/alloc", "reserved_ratio", ".2f"),
    ("flushes/step", "alloc_flushes_per_step", ".1f"),
    ("budget GiB", "budget_gib", ".1f"),
    ("plan", "plan", "plan"),
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
        elif spec == "plan":
            cells.append(_plan_cell(row.get("plan"), row.get("plan_trials"), row.get("unsettled_timed_steps")))
        else:
            cells.append(_fmt(row.get(key), spec))
    return cells


def _plan_cell(
    plan: dict[str, Any] | None, trials: list[list[float]] | None = None, unsettled: int | None = None
) -> str:
    """The memory-budget plan a row ran last, with the peak it predicted, the plans timed against each other with
    the median of their timed steps, and how many of the row's timed steps ran another plan or a trial (the row's time
    is then not the plan's alone; ``-``: no planner)."""
    if not plan:
        return "-"
    offload = plan["offload_bytes"] / (1 << 30)
    parts = " by parts" if plan.get("split") else ""
    light = f"{plan['light_blocks']} ew + " if plan.get("light_blocks") else ""
    cell = f"{light}{plan['checkpoint_blocks']} ckpt{parts} + {offload:.2f} GiB, pred {plan['peak'] / (1 << 30):.2f}"
    if trials:
        # [blocks checkpointed, GiB offloaded, ms, blocks with elementwise recompute (absent in older results)]
        timed = "; ".join(
            f"{f'{int(t[3])} ew + ' if len(t) > 3 and t[3] else ''}{int(t[0])} + {t[1]:.2f}: {t[2]:.0f} ms"
            for t in trials
        )
        cell += f" (timed {timed})"
    if unsettled:
        cell += f"; **{unsettled} timed step(s) ran another plan or a trial**"
    return cell


# What a report of tiny models says instead of verdicts: their numbers are noise (a 64-wide model's step is
# dominated by overheads), so judging the requirements on them would print misses that mean nothing.
TINY_NOTE = (
    "Tiny models (`--tiny`): this run checks that the benchmark's pipeline works end to end. Their step times and "
    "memory say nothing about the full-size workloads, so no requirement is judged."
)


def markdown(results: list[dict[str, Any]], name: str, judged: bool = True) -> str:
    """The report: environment, link, verdicts, one table per workload, definitions.

    Args:
        results: The :func:`derive`-d results, one per workload.
        name: The run's name (the title).
        judged: Whether to judge the requirements (the verdicts and their definitions); ``False`` for tiny models,
            whose report says why it has none instead.

    Returns:
        The Markdown text.
    """
    lines = [f"# Activation offloading benchmark: {name}", ""]
    if not judged:
        lines += [TINY_NOTE, ""]
    env = next((r.get("env") for r in results if r.get("env")), {}) or {}
    lines += ["## Environment", "", "| | |", "|---|---|"]
    for key in (
        "gpu",
        "driver",
        "cuda",
        "torch",
        "transformers",
        "peft",
        "python",
        "cpu_count",
        "model_impl",
        "memory_budget_api",
    ):
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
    lines += [""]
    if judged:
        lines += ["## Verdicts", "", "| | status | numbers |", "|---|---|---|"]
        lines += [f"| {v.key} | **{v.status}** | {v.detail} |" for v in verdicts(results)]
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
        lines += _capped_references_table(r.get("rows", []))
    lines += ["## Definitions", ""]
    if judged:
        lines += [f"- **{key}**: {text}" for key, text in DEFINITIONS.items()]
    lines += [
        "- ratio: median step time / `none`'s. Peak: `torch.cuda.max_memory_allocated` over the timed steps. "
        "Offloaded GiB, GB/s and stall: our engine's stats (`measure_copies=True`), median per step. flushes/step: "
        "how often the caching allocator found no room (a hard cap) and freed its cached blocks to try again, per "
        "timed step. plan: the memory-budget planner's last plan (blocks checkpointed + bytes offloaded per forward) "
        "and the peak allocated GiB it predicted; timed: the plans it timed against each other before keeping the "
        "fastest (blocks + GiB offloaded: the mean of their timed steps, device time from step start to step start, "
        "the planner's own clock).",
        "",
    ]
    return "\n".join(lines)


def _capped_references_table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows run again under a budget row's hard cap (B2's references whose peak reserved passed the budget)."""
    runs = [(row, name, capped) for row in rows for name, capped in (row.get("capped_references") or {}).items()]
    if not runs:
        return []
    lines = [
        "Under the budget rows' hard caps (rows whose peak allocated fits a budget and whose peak reserved does not; "
        "run after every other row, so with expandable segments wherever an offloading row switched them on):",
        "",
        "| budget row | cap GiB | mode | status | step s | peak GiB | reserved GiB | flushes/step | segments |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, name, capped in runs:
        lines.append(
            f"| {row['mode']} | {_fmt(row.get('budget_gib'), '.2f')} | {name} | {capped.get('status')} "
            f"| {_fmt(capped.get('step_s'), '.3f')} | {_fmt(capped.get('peak_alloc_gib'), '.2f')} "
            f"| {_fmt(capped.get('peak_reserved_gib'), '.2f')} | {_fmt(capped.get('alloc_flushes_per_step'), '.1f')} "
            f"| {capped.get('allocator') or '-'} |"
        )
    return [*lines, ""]


def plottable(results: list[dict[str, Any]]) -> bool:
    """Whether any measured row has a peak to draw (CUDA runs: the CPU has no allocator peak), so :func:`plot` would
    draw more than empty panels."""
    return any(_ok(r) and r.get("ratio") and _peak(r) is not None for result in results for r in result.get("rows", []))


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
        Line2D([], [], color="tab:blue", alpha=0.6, label="our curve (max_offload_bytes sweep)")
    ]
    axes[0][0].legend(handles=legend, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def terminal_table(results: list[dict[str, Any]], judged: bool = True) -> str:
    """A compact table for stdout, with the verdicts unless ``judged`` is ``False`` (tiny models)."""
    width = max([18, *(len(result["workload"]["name"]) for result in results)])
    header = (
        f"{'workload':<{width}} {'mode':<13} {'status':<10} {'ratio':>6} {'peak GiB':>9} {'offl GiB':>9} {'grad':>8}"
    )
    out = [header]
    for result in results:
        for row in result.get("rows", []):
            status = row["status"] if len(row["status"]) <= 10 else row["status"][:9] + "…"
            out.append(
                f"{result['workload']['name']:<{width}} {row['mode']:<13} {status:<10} "
                f"{_fmt(row.get('ratio'), '.2f'):>6} {_fmt(row.get('peak_alloc_gib'), '.1f'):>9} "
                f"{_fmt(row.get('offloaded_gib'), '.2f'):>9} {_fmt(row.get('grad_rel_diff'), '.0e'):>8}"
            )
    if judged:
        out += [f"{v.key:<4} {v.status:<7} {v.detail}" for v in verdicts(results)]
    return "\n".join(out)


def verdicts_json(results: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [asdict(v) for v in verdicts(results)]


def capacity_verdicts_json(capacity: list[dict[str, Any]]) -> list[dict[str, str]]:
    return [asdict(v) for v in capacity_verdicts(capacity)]
