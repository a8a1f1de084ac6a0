"""Merge benchmark runs into one report: ``python -m benchmarks.merge A.json B.json --out DIR``.

A single device call may not fit every workload (each call is time-limited), so workloads run in separate calls
and are merged here. Each workload's rows still come from one process; for a workload present in several runs,
the last run given wins. The report names the run each workload came from. Capacity runs (``--capacity``) merge
per model and cap into a capacity section of the same report, the later run winning per mode.

Files written by ``python -m benchmarks.interleaved`` with a ``none`` and a ``default`` arm may be given too: the
default's cost in alternating steps is attached to that workload (the last such file wins) and B4 is judged by it
there, the sequential rows' ratio shown next to it (a host-bound model's later rows run slower whatever they run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks import report


def merge(runs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One results document from ``runs`` (as ``python -m benchmarks`` writes them, with or without --capacity)."""
    by_workload: dict[str, dict[str, Any]] = {}
    by_cap: dict[tuple[str, float], dict[str, Any]] = {}
    alternating: dict[str, dict[str, Any]] = {}
    for run in runs:
        if "arms" in run:  # python -m benchmarks.interleaved
            arms = run["arms"]
            if "none" in arms and "default" in arms:
                alternating[run["workload"]["name"]] = {
                    "ratio": arms["default"]["median_ms"] / arms["none"]["median_ms"],
                    "steps": run["rounds"],
                    "source_run": run["name"],
                }
            continue
        for result in run.get("results", []):
            if result.get("rows"):
                by_workload[result["workload"]["name"]] = {**result, "source_run": run["name"]}
        for result in run.get("capacity", []):
            searched = [entry for entry in result.get("searches", []) if entry.get("probes")]
            if searched:
                key = (result["model"]["name"], result["cap_gib"])
                by_cap[key] = _merge_searches(by_cap.get(key), result, searched, run["name"])
    for workload, measured in alternating.items():
        if workload in by_workload:
            by_workload[workload]["default_alternating"] = measured
    results = [report.derive(result) for result in by_workload.values()]
    merged: dict[str, Any] = {
        "name": name,
        "runs": {
            run["name"]: {k: run.get(k) for k in ("created", "wall_s", "args")} for run in runs if "arms" not in run
        },
        "results": results,
        "verdicts": report.verdicts_json(results),
    }
    if by_cap:
        merged["capacity"] = list(by_cap.values())
        merged["capacity_verdicts"] = report.capacity_verdicts_json(merged["capacity"])
    return merged


def _merge_searches(
    earlier: dict[str, Any] | None, result: dict[str, Any], searched: list[dict[str, Any]], run: str
) -> dict[str, Any]:
    """One model and cap: the later run's searches win per mode, and the modes only an earlier run searched stay
    (a run that searched one mode again does not drop the others). A later search cut short (by its deadline) does
    not replace an earlier one that finished, nor one also cut short that trained a longer sequence: it knows less
    about the same mode (unless it trained a longer sequence than the earlier one did)."""
    modes = {entry["mode"]: (entry, run) for entry in searched}
    walls = {run: result.get("wall_s") or 0.0}
    if earlier is not None:
        for entry, source in zip(earlier["searches"], earlier["mode_sources"], strict=True):
            later = modes.get(entry["mode"])
            if later is None or _knows_more(entry, later[0]):
                modes[entry["mode"]] = (entry, source)
                walls.setdefault(source, earlier["run_walls"][source])
    sources = [source for _, source in modes.values()]
    if len(set(sources)) == 1:
        named = sources[0]
    else:
        named = ", ".join(f"{mode} from {source}" for mode, (_, source) in modes.items())
    walls = {source: wall for source, wall in walls.items() if source in sources}
    return {
        **result,
        "searches": [entry for entry, _ in modes.values()],
        "mode_sources": sources,
        "run_walls": walls,
        "wall_s": sum(walls.values()),  # the workers' time behind the searches kept
        "source_run": named,
    }


def _knows_more(earlier: dict[str, Any], later: dict[str, Any]) -> bool:
    """Whether an earlier search of a mode says more than a later one cut short by its deadline. A later search that
    trained a longer sequence always wins: the earlier one's answer (finished or not) is then known to be short."""
    earlier_longest, later_longest = earlier.get("longest") or 0, later.get("longest") or 0
    if later.get("complete") or later_longest > earlier_longest:
        return False
    return bool(earlier.get("complete")) or earlier_longest > later_longest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.merge", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="results JSON files, later ones win per workload")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/out"), help="output folder (default benchmarks/out, ignored)"
    )
    parser.add_argument("--device-name", default="h200", help="names the outputs <out>/<name>.{json,md,png}")
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    for run, path in zip(runs, args.runs, strict=True):
        run.setdefault("name", path.stem)  # an interleaved file has no name of its own
    merged = merge(runs, args.device_name)
    if not merged["results"] and not merged.get("capacity"):
        print(f"nothing measured in {[str(p) for p in args.runs]}: no report written to {args.out}")
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / args.device_name
    parts = []
    if merged["results"]:
        sources = ", ".join(f"`{r['workload']['name']}` from `{r['source_run']}`" for r in merged["results"])
        markdown = report.markdown(merged["results"], args.device_name)
        title, _, rest = markdown.partition("\n")
        parts.append(f"{title}\n\nMerged from separate runs: {sources}.\n{rest}")
        report.plot(merged["results"], f"{base}.png")
        print(report.terminal_table(merged["results"]))
    if merged.get("capacity"):
        sources = ", ".join(
            f"`{r['model']['name']}` @ {r['cap_gib']:g} GiB from `{r['source_run']}`" for r in merged["capacity"]
        )
        title, _, rest = report.capacity_markdown(merged["capacity"], args.device_name).partition("\n")
        if parts:  # a section of the workloads' report: one heading level down
            title, rest = "#" + title, rest.replace("\n## ", "\n### ")
        parts.append(f"{title}\n\nMerged from separate runs: {sources}.\n{rest}")
        print(report.capacity_table(merged["capacity"]))
    Path(f"{base}.json").write_text(json.dumps(merged, indent=1, default=str))
    Path(f"{base}.md").write_text("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
