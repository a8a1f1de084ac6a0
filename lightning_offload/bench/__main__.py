"""``python -m lightning_offload.bench``: run the workloads (one subprocess each), merge, report, plot.

Example::

    python -m lightning_offload.bench --device-name h200                      # everything, ~8 min on an H200
    python -m lightning_offload.bench --workloads llama1b-s4k --modes none,streamed --steps 6
    python -m lightning_offload.bench --tiny --out /tmp/bench                  # the whole pipeline on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lightning_offload.bench import report
from lightning_offload.bench.workloads import MODES, WORKLOADS

_REPORT_RESERVE_S = 15.0
_MIN_WORKER_S = 30.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_offload.bench", description="Benchmark activation offloading on Llama shapes."
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {list(WORKLOADS)}")
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated modes run for every workload (default: each workload's own list); "
        f"known: {list(MODES)}. `none` always runs first.",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 6; 2 with --tiny)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per mode (default 2; 1 with --tiny)")
    parser.add_argument(
        "--anchor-steps",
        type=int,
        default=None,
        help="timed steps of the anchors, 4-7x slower per step (default 4; --steps with --tiny)",
    )
    parser.add_argument("--anchor-warmup", type=int, default=None, help="warm-up steps of the anchors (default 1)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="output folder")
    parser.add_argument("--device-name", default=None, help="names the outputs <out>/<name>.{json,md,png}")
    parser.add_argument("--tiny", action="store_true", help="shrink every workload so the pipeline runs on a CPU")
    parser.add_argument("--worker-timeout", type=float, default=None, help="seconds per workload before it is killed")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole run: a workload still running then is killed (its finished rows are kept) "
        "and the report is written anyway; workloads left after it are skipped",
    )
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        parser.error(f"--workloads {args.workloads!r}: unknown {unknown}; choose from {list(WORKLOADS)}")
    args.workloads = workloads
    if args.modes is not None:
        modes = [m for m in args.modes.split(",") if m]
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            parser.error(f"--modes {args.modes!r}: unknown {unknown}; choose from {list(MODES)}")
        args.modes = modes
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.anchor_steps = args.anchor_steps if args.anchor_steps is not None else (args.steps if args.tiny else 4)
    args.anchor_warmup = args.anchor_warmup if args.anchor_warmup is not None else (args.warmup if args.tiny else 1)
    if min(args.steps, args.warmup, args.anchor_steps, args.anchor_warmup) < 1:
        parser.error("--steps and --warmup must be >= 1 (the first warm-up step gives the gradient comparison)")
    args.device_name = args.device_name or ("tiny" if args.tiny else "gpu")
    return args


def run_worker(args: argparse.Namespace, workload: str, json_path: Path, timeout: float | None) -> dict[str, Any]:
    """Run one workload in its own process; return its JSON (partial if it crashed or timed out)."""
    modes = args.modes if args.modes is not None else list(WORKLOADS[workload].modes)
    command = [
        sys.executable,
        "-m",
        "lightning_offload.bench.worker",
        f"--workload={workload}",
        f"--modes={','.join(modes)}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--anchor-steps={args.anchor_steps}",
        f"--anchor-warmup={args.anchor_warmup}",
        f"--out={json_path}",
    ] + (["--tiny"] if args.tiny else [])
    env = dict(os.environ)
    env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    error = None
    try:
        code = subprocess.run(command, env=env, timeout=timeout, check=False).returncode
        if code != 0:
            error = f"worker exited with code {code}"
    except subprocess.TimeoutExpired:
        error = f"worker killed after {timeout:.0f} s (time budget)"
    if json_path.exists():
        result = json.loads(json_path.read_text())
    else:
        base = WORKLOADS[workload]
        result = {"workload": base.as_dict(), "rows": [], "env": {}}
    if error:
        result["error"] = error
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = []
    for workload in args.workloads:
        print(f"=== {workload}", flush=True)
        json_path = args.out / f"{args.device_name}.{workload}.worker.json"
        timeout = args.worker_timeout
        if args.deadline is not None:
            # Keep a few seconds for merging and writing the report after the last worker.
            left = args.deadline - (time.perf_counter() - started) - _REPORT_RESERVE_S
            if left < _MIN_WORKER_S:
                results.append({"workload": WORKLOADS[workload].as_dict(), "rows": [], "error": "skipped: deadline"})
                continue
            timeout = left if timeout is None else min(timeout, left)
        results.append(report.derive(run_worker(args, workload, json_path, timeout)))
    merged = {
        "name": args.device_name,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_s": time.perf_counter() - started,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "verdicts": report.verdicts_json(results),
    }
    base = args.out / args.device_name
    Path(f"{base}.json").write_text(json.dumps(merged, indent=1, default=str))
    Path(f"{base}.md").write_text(report.markdown(results, args.device_name))
    try:
        report.plot(results, f"{base}.png")
    except ImportError as err:  # matplotlib is optional (the ``examples`` extra): the numbers still get written
        print(f"no plot: {err}")
    for workload in args.workloads:  # merged now; the per-worker files were only for crash safety
        (args.out / f"{args.device_name}.{workload}.worker.json").unlink(missing_ok=True)
        (args.out / f"{args.device_name}.{workload}.worker.tmp").unlink(missing_ok=True)  # a killed worker's
    print(report.terminal_table(results))
    print(f"wrote {base}.json, .md, .png in {merged['wall_s']:.0f} s")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
