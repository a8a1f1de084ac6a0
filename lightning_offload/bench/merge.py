"""Merge benchmark runs into one report: ``python -m lightning_offload.bench.merge A.json B.json --out DIR``.

A single device call may not fit every workload (each call is time-limited), so workloads run in separate calls
and are merged here. Each workload's rows still come from one process; for a workload present in several runs,
the last run given wins. The report names the run each workload came from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lightning_offload.bench import report


def merge(runs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """One results document from ``runs`` (as ``python -m lightning_offload.bench`` writes them)."""
    by_workload: dict[str, dict[str, Any]] = {}
    for run in runs:
        for result in run["results"]:
            if result.get("rows"):
                by_workload[result["workload"]["name"]] = {**result, "source_run": run["name"]}
    results = [report.derive(result) for result in by_workload.values()]
    return {
        "name": name,
        "runs": {run["name"]: {k: run.get(k) for k in ("created", "wall_s", "args")} for run in runs},
        "results": results,
        "verdicts": report.verdicts_json(results),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_offload.bench.merge", description=__doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="results JSON files, later ones win per workload")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    parser.add_argument("--device-name", default="h200", help="names the outputs <out>/<name>.{json,md,png}")
    args = parser.parse_args(argv)
    runs = [json.loads(path.read_text()) for path in args.runs]
    merged = merge(runs, args.device_name)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / args.device_name
    sources = ", ".join(f"`{r['workload']['name']}` from `{r['source_run']}`" for r in merged["results"])
    markdown = report.markdown(merged["results"], args.device_name)
    title, _, rest = markdown.partition("\n")
    Path(f"{base}.json").write_text(json.dumps(merged, indent=1, default=str))
    Path(f"{base}.md").write_text(f"{title}\n\nMerged from separate runs: {sources}.\n{rest}")
    report.plot(merged["results"], f"{base}.png")
    print(report.terminal_table(merged["results"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
