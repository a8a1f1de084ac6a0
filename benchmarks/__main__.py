"""``python -m benchmarks`` (from the repo root): run the workloads (one subprocess each), merge, report, plot.

Example::

    python -m benchmarks --device-name h200 --out benchmarks/results        # everything, on an H200
    python -m benchmarks --workloads llama1b-s4k --modes none,streamed --steps 6
    python -m benchmarks --tiny                                             # the whole pipeline on a CPU
    python -m benchmarks --capacity --capacity-models llama1b --caps 24,40 --deadline 470

Outputs go to ``benchmarks/out/`` (git-ignored) unless ``--out`` names a folder, and are written only when the run
measured something: a run that measured nothing says why and writes no file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import anchors, capacity, models, report
from benchmarks.workloads import (
    CAPACITY_CAPS_GIB,
    CAPACITY_MAX_SEQ,
    CAPACITY_MODELS,
    CAPACITY_MODES,
    CAPACITY_STEP,
    DEFAULT_CAPS_GIB,
    DEFAULT_MAX_SEQ,
    MODES,
    WORKLOADS,
    tiny,
)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("benchmarks/out")
# Where `fetch_anchors.sh install` puts the anchors: on the workers' PYTHONPATH when it exists.
REFIMPL = ROOT / ".refimpl"
_REPORT_RESERVE_S = 15.0
_MIN_WORKER_S = 30.0
DEFAULT_CAPS = ",".join(f"{c:g}" for c in DEFAULT_CAPS_GIB)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description="Benchmark activation offloading on Llama shapes."
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, from {list(WORKLOADS)}")
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated modes run for every workload (default: each workload's own list; with --capacity: "
        f"{list(CAPACITY_MODES)}); known: {list(MODES)}. `none` always runs first.",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per mode (default 6; 2 with --tiny; --capacity: 3)"
    )
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per mode (default 2; 1 with --tiny)")
    parser.add_argument(
        "--anchor-steps",
        type=int,
        default=None,
        help="timed steps of the anchors, 4-7x slower per step (default 4; --steps with --tiny)",
    )
    parser.add_argument("--anchor-warmup", type=int, default=None, help="warm-up steps of the anchors (default 1)")
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output folder (default {DEFAULT_OUT}, git-ignored; the committed results live in benchmarks/results)",
    )
    parser.add_argument("--device-name", default=None, help="names the outputs <out>/<name>.{json,md,png}")
    parser.add_argument("--tiny", action="store_true", help="shrink every model so the pipeline runs on a CPU")
    parser.add_argument("--worker-timeout", type=float, default=None, help="seconds per workload before it is killed")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds for the whole run: a worker still running then is killed (what it finished is kept) and "
        "the report is written anyway; work left after it is skipped",
    )
    group = parser.add_argument_group("capacity (--capacity): the longest sequence each mode trains under hard caps")
    group.add_argument("--capacity", action="store_true", help="run the capacity search instead of the workloads")
    group.add_argument(
        "--capacity-models",
        default=",".join(CAPACITY_MODELS),
        help=f"comma-separated, from {list(CAPACITY_MODELS)}",
    )
    group.add_argument(
        "--caps",
        default=None,
        help=f"comma-separated GiB for every model (default {DEFAULT_CAPS}; "
        + "; ".join(f"{m}: {','.join(f'{c:g}' for c in caps)}" for m, caps in CAPACITY_CAPS_GIB.items())
        + f"; {DEFAULT_CAPS} with --tiny)",
    )
    group.add_argument(
        "--max-seq",
        type=int,
        default=None,
        help=f"longest sequence tried, for every model (default {DEFAULT_MAX_SEQ}; "
        + "; ".join(f"{m}: {n}" for m, n in CAPACITY_MAX_SEQ.items())
        + f"; {capacity.TINY_MAX_SEQ} with --tiny)",
    )
    group.add_argument(
        "--capacity-from",
        default="{}",
        help="JSON {mode: tokens}: where each mode's search starts at the smallest cap (its first probe; default "
        "the step). Skips the growth phase where an earlier run found the region; nothing is assumed to fit.",
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
    names = [m for m in args.capacity_models.split(",") if m]
    unknown = [m for m in names if m not in CAPACITY_MODELS]
    if unknown or not names:
        parser.error(
            f"--capacity-models {args.capacity_models!r}: unknown {unknown}; choose from {list(CAPACITY_MODELS)}"
        )
    args.capacity_models = names
    caps = None
    if args.caps is not None:
        try:
            caps = sorted({float(c) for c in args.caps.split(",") if c})
        except ValueError:
            parser.error(f"--caps {args.caps!r}: must be comma-separated numbers of GiB, e.g. {DEFAULT_CAPS}")
        if not caps or min(caps) <= 0:
            parser.error(f"--caps {args.caps!r}: must be positive numbers of GiB, e.g. {DEFAULT_CAPS}")
    try:
        first = json.loads(args.capacity_from)
    except json.JSONDecodeError:
        first = None
    if not isinstance(first, dict) or not all(isinstance(v, int) and v > 0 for v in first.values()):
        parser.error(
            f"--capacity-from {args.capacity_from!r}: must be a JSON object of positive token counts, "
            "e.g. '{\"ac\": 34816}'"
        )
    args.capacity_from = first
    default_caps = list(DEFAULT_CAPS_GIB)
    args.caps = {
        m: caps or (default_caps if args.tiny else list(CAPACITY_CAPS_GIB.get(m, default_caps)))
        for m in args.capacity_models
    }
    default_steps = 3 if args.capacity else (2 if args.tiny else 6)
    args.steps = args.steps if args.steps is not None else default_steps
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.anchor_steps = args.anchor_steps if args.anchor_steps is not None else (args.steps if args.tiny else 4)
    args.anchor_warmup = args.anchor_warmup if args.anchor_warmup is not None else (args.warmup if args.tiny else 1)
    if min(args.steps, args.warmup, args.anchor_steps, args.anchor_warmup) < 1:
        parser.error("--steps and --warmup must be >= 1 (the first warm-up step gives the gradient comparison)")
    args.step = capacity.TINY_STEP if args.tiny else CAPACITY_STEP
    if args.max_seq is not None and args.max_seq < args.step:
        parser.error(f"--max-seq {args.max_seq}: must be at least one step ({args.step} tokens)")
    args.max_seq = {
        m: args.max_seq or (capacity.TINY_MAX_SEQ if args.tiny else CAPACITY_MAX_SEQ.get(m, DEFAULT_MAX_SEQ))
        for m in args.capacity_models
    }
    base = args.device_name or ("tiny" if args.tiny else "gpu")
    args.device_name = f"{base}-capacity" if args.capacity and not base.endswith("-capacity") else base
    return args


def missing_requirements(args: argparse.Namespace) -> str | None:
    """Why this run cannot start (packages missing for what it would build), or ``None``.

    ``--tiny`` needs nothing beyond the test extra: without transformers the demo model stands in for Llama and
    a small adapter of this package for peft. Full-size runs build the real shapes: transformers (and peft for
    LoRA) must be there; only the small-vocab capacity model may use the demo model.
    """
    if args.tiny:
        return None
    if args.capacity:
        shapes = [CAPACITY_MODELS[m] for m in args.capacity_models if not m.startswith("smallvocab")]
    else:
        shapes = [WORKLOADS[w] for w in args.workloads]
    needed = {"transformers"} if shapes else set()
    if any(w.lora for w in shapes):
        needed.add("peft")
    missing = sorted(name for name in needed if not models.have(name))
    if not missing:
        return None
    what = ", ".join(w.name for w in shapes)
    return (
        f"python -m benchmarks: {what} need {' and '.join(sorted(needed))}, and {', '.join(missing)} "
        'cannot be imported: install the examples extra (pip install -e ".[examples]"), or run --tiny, which '
        "needs only the test extra."
    )


def worker_env() -> dict[str, str]:
    """The workers' environment: this one, the anchors' settings, and the folders of ``.refimpl/`` on
    ``PYTHONPATH`` (``pkgs``: the anchors; ``ao``: the torchao torchtune needs, which the workers hide from peft)."""
    env = dict(os.environ)
    for key, value in anchors.ENVIRONMENT.items():
        env.setdefault(key, value)
    folders = [str(REFIMPL / name) for name in ("pkgs", "ao") if (REFIMPL / name).is_dir()]
    if folders:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*folders, env.get("PYTHONPATH", "")) if p)
    return env


def cuda_available() -> bool:
    """Whether this machine has CUDA (the workers run on it then)."""
    import torch

    return torch.cuda.is_available()


def split_modes(modes: list[str], cuda: bool) -> tuple[list[str], list[str]]:
    """``modes`` split into those that run on this machine and those that need CUDA where it has none.

    A row that needs CUDA would only say so: leaving it out of the worker's list keeps one line per workload about
    them instead of one row each.

    Args:
        modes: The modes asked for, in order.
        cuda: Whether this machine has CUDA.

    Returns:
        (the modes to run, the modes skipped), each in the given order.
    """
    skipped = [m for m in modes if MODES[m].needs_cuda and not cuda]
    return [m for m in modes if m not in skipped], skipped


def workload_spec(args: argparse.Namespace, workload: str) -> dict[str, Any]:
    """The workload as its worker would describe it: shrunk (and named ``tiny-...``) with ``--tiny``."""
    return (tiny(WORKLOADS[workload]) if args.tiny else WORKLOADS[workload]).as_dict()


def run_worker(
    args: argparse.Namespace, workload: str, json_path: Path, timeout: float | None, cuda: bool = True
) -> dict[str, Any]:
    """Run one workload in its own process; return its JSON (partial if it crashed or timed out).

    Args:
        args: The parsed command line.
        workload: The workload's name in :data:`~benchmarks.workloads.WORKLOADS`.
        json_path: Where the worker writes its result.
        timeout: Seconds before the worker is killed; ``None``: no limit.
        cuda: Whether this machine has CUDA; without it the modes that need it are not run, and listed in the
            result's ``skipped_need_cuda``.

    Returns:
        The worker's result, with ``error`` where it failed.
    """
    asked = args.modes if args.modes is not None else list(WORKLOADS[workload].modes)
    modes, skipped = split_modes(asked, cuda)
    command = [
        sys.executable,
        "-m",
        "benchmarks.worker",
        f"--workload={workload}",
        f"--modes={','.join(modes)}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--anchor-steps={args.anchor_steps}",
        f"--anchor-warmup={args.anchor_warmup}",
        f"--out={json_path}",
    ] + (["--tiny"] if args.tiny else [])
    error = None
    try:
        code = subprocess.run(command, env=worker_env(), timeout=timeout, check=False).returncode
        if code != 0:
            error = f"worker exited with code {code}"
    except subprocess.TimeoutExpired:
        error = f"worker killed after {timeout:.0f} s (time budget)"
    if json_path.exists():
        result = json.loads(json_path.read_text())
    else:
        result = {"workload": workload_spec(args, workload), "rows": [], "env": {}}
    if skipped:
        result["skipped_need_cuda"] = skipped
    if error:
        result["error"] = error
    return result


def measured(results: list[dict[str, Any]]) -> bool:
    """Whether any row was measured (``status == "ok"``): only then is a report written."""
    return any(row.get("status") == "ok" for result in results for row in result.get("rows", []))


def capacity_measured(results: list[dict[str, Any]]) -> bool:
    """Whether any capacity probe ran."""
    return any(entry.get("probes") for result in results for entry in result.get("searches", []))


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def skipped_summary(results: list[dict[str, Any]]) -> str | None:
    """One line for the rows left out because they need CUDA (``None`` if none were)."""
    skipped = {r["workload"]["name"]: r["skipped_need_cuda"] for r in results if r.get("skipped_need_cuda")}
    if not skipped:
        return None
    modes = list(dict.fromkeys(m for names in skipped.values() for m in names))
    count = sum(len(names) for names in skipped.values())
    return f"not run without CUDA: {count} rows of {len(skipped)} workloads ({', '.join(modes)})"


def run_workloads(args: argparse.Namespace, scratch: Path, started: float) -> int:
    results = []
    cuda = cuda_available()
    # Tiny models check the pipeline: their numbers are overhead-dominated noise, and verdicts on them would report
    # misses (and passes) that mean nothing. Only full-size runs are judged.
    judged = not args.tiny
    for workload in args.workloads:
        spec = workload_spec(args, workload)
        print(f"=== {spec['name']}", flush=True)
        json_path = scratch / f"{workload}.worker.json"
        timeout = args.worker_timeout
        if args.deadline is not None:
            # Keep a few seconds for merging and writing the report after the last worker.
            left = args.deadline - (time.perf_counter() - started) - _REPORT_RESERVE_S
            if left < _MIN_WORKER_S:
                results.append({"workload": spec, "rows": [], "error": "skipped: deadline"})
                continue
            timeout = left if timeout is None else min(timeout, left)
        results.append(report.derive(run_worker(args, workload, json_path, timeout, cuda)))
    print(report.terminal_table(results, judged=judged))
    summary = skipped_summary(results)
    if summary:
        print(summary)
    if not measured(results):
        errors = "; ".join(f"{r['workload']['name']}: {r.get('error', 'no row measured')}" for r in results)
        print(f"nothing measured ({errors}): no report written to {args.out}")
        return 1
    contents: dict[str, Any] = {"results": results}
    if judged:
        contents["verdicts"] = report.verdicts_json(results)
    markdown = report.markdown(results, args.device_name, judged=judged)
    base, wall_s = _write_document(args, started, None, contents, markdown)
    written = [".json", ".md"]
    if not report.plottable(results):
        # The plot draws peak allocated memory, which only CUDA measures: without it every panel would be empty.
        print("no plot: no row measured a peak of device memory (CUDA only)")
    else:
        try:
            report.plot(results, f"{base}.png")
            written.append(".png")
        except ImportError as err:  # matplotlib is optional (the ``plot`` extra): the numbers still get written
            print(f"no plot: {err}")
    print(f"wrote {base}{', '.join(written)} in {wall_s:.0f} s")
    failed = [f"{r['workload']['name']}: {r['error']}" for r in results if "error" in r]
    if args.tiny:
        rows = [(r["workload"]["name"], row) for r in results for row in r.get("rows", [])]
        ran = sum(1 for _, row in rows if row.get("status") == "ok")
        # A tiny model fits anywhere: a row that failed or ran out of memory is a broken pipeline, not a finding.
        failed += [
            f"{name}/{row['mode']}: {row['status']}" for name, row in rows if row["status"].startswith(("error", "OOM"))
        ]
        print(f"pipeline {'FAILED' if failed else 'OK'}, {ran} rows ran" + (f"; {'; '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def _write_document(
    args: argparse.Namespace, started: float, kind: str | None, contents: dict[str, Any], markdown: str
) -> tuple[Path, float]:
    """Write ``<out>/<device name>.json`` (the run's arguments and ``contents``) and its ``.md``; returns the base
    path and the run's wall time."""
    document: dict[str, Any] = {"name": args.device_name}
    if kind is not None:
        document["kind"] = kind
    wall_s = time.perf_counter() - started
    document.update(created=time.strftime("%Y-%m-%d %H:%M:%S"), wall_s=wall_s, args=_arguments(args), **contents)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / args.device_name
    Path(f"{base}.json").write_text(json.dumps(document, indent=1, default=str))
    Path(f"{base}.md").write_text(markdown)
    return base, wall_s


def run_capacity(args: argparse.Namespace, scratch: Path, started: float) -> int:
    modes = args.modes if args.modes is not None else list(CAPACITY_MODES)
    deadline_at = time.time() + (args.deadline - _REPORT_RESERVE_S if args.deadline is not None else 7 * 24 * 3600)
    results = capacity.drive(
        args.capacity_models,
        args.caps,
        modes,
        args.steps,
        args.step,
        args.max_seq,
        args.tiny,
        scratch,
        deadline_at,
        worker_env(),
        first=args.capacity_from,
    )
    print(report.capacity_table(results))
    if not capacity_measured(results):
        errors = "; ".join(f"{r['model']['name']} @ {r['cap_gib']:g}: {r.get('error', 'no probe')}" for r in results)
        print(f"nothing measured ({errors}): no report written to {args.out}")
        return 1
    contents = {"capacity": results, "verdicts": report.capacity_verdicts_json(results)}
    markdown = report.capacity_markdown(results, args.device_name)
    base, wall_s = _write_document(args, started, "capacity", contents, markdown)
    print(f"wrote {base}.json, .md in {wall_s:.0f} s")
    return 0 if all("error" not in r for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = missing_requirements(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    started = time.perf_counter()
    # The workers' files stay out of --out: a run that measures nothing leaves no trace there.
    with tempfile.TemporaryDirectory(prefix="benchmarks-") as scratch:
        if args.capacity:
            return run_capacity(args, Path(scratch), started)
        return run_workloads(args, Path(scratch), started)


if __name__ == "__main__":
    sys.exit(main())
