"""``python -m benchmarks.planner_sensitivity``: which planner constants change what it decides on recorded runs?

Every trace under ``tests/data/traces/`` (steps of real runs: the model zoo on a GPU, and the CPU scenarios) is told
again to a fresh planner with one constant of ``lightning_offload/planner/`` halved, then doubled (an integer is
rounded, and kept at 1 or more). A trace counts as changed where any directive differs from the one it recorded. A
constant that changes no trace either way is one that no recorded run distinguishes: what it guards has not acted in
them (or acts only past what halving and doubling reach).

A replay tells a trace's observations again: it shows what the planner would have decided, not what the step would
then have done (a different watermark would have measured other peaks). Where a constant acts only through what the
datapath then does, or only in a situation no trace holds (a budget of ``"auto"``, many inputs), it reads 0 here.

A constant is patched wherever a planner module holds it by that name. A default argument or a value derived from it
when its module was imported (a constant computed from another at import) keeps its old value: each is a
constant of its own here.

    python -m benchmarks.planner_sensitivity                  # the table, to standard output
    python -m benchmarks.planner_sensitivity --out table.md   # and to a file
    python -m benchmarks.planner_sensitivity --all-recorded   # every trace under benchmarks/results/ too
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pkgutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "data" / "traces"
RESULTS = ROOT / "benchmarks" / "results"
# Not tuning: formats, bounds of what is recorded, identities.
SKIPPED = {"PLANS_VERSION", "TRACE_VERSION", "TRACED_EVENTS", "NO_INPUT"}
FACTORS = (0.5, 2.0)


def planner_modules() -> list[ModuleType]:
    import lightning_offload.planner as package

    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]


def constants(modules: list[ModuleType]) -> dict[str, tuple[ModuleType, float]]:
    """Numeric module-level constants (upper-case names, leading underscore or not), by name, with the module that
    defines them (the first that holds the name)."""
    found: dict[str, tuple[ModuleType, float]] = {}
    for module in modules:
        for name, value in vars(module).items():
            bare = name.lstrip("_")
            if not bare or not bare[0].isalpha() or bare.upper() != bare or name in SKIPPED:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            found.setdefault(name, (module, value))
    return found


@contextlib.contextmanager
def patched(modules: list[ModuleType], name: str, value: float) -> Iterator[None]:
    """``name`` set to ``value`` in every planner module that holds it, for the duration."""
    old = {m: vars(m)[name] for m in modules if name in vars(m)}
    try:
        for module in old:
            setattr(module, name, value)
        yield
    finally:
        for module, previous in old.items():
            setattr(module, name, previous)


def recorded_traces(results: Path = RESULTS) -> dict[str, dict[str, Any]]:
    """Every planner trace the runs under ``results`` kept, by file and row: the zoo's ``*-traces.json`` (one trace a
    configuration) and the benchmark workloads' rows (``row["trace"]``)."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(results.rglob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        where = path.relative_to(results).with_suffix("").as_posix()
        if path.name.endswith("-traces.json") and isinstance(data, dict):
            found.update({f"{where}/{row[:2]}": t for row, t in data.items() if isinstance(t, dict) and "events" in t})
            continue
        workloads = data.get("results") if isinstance(data, dict) else None
        for workload in workloads if isinstance(workloads, list) else []:
            for row in workload.get("rows") or [] if isinstance(workload, dict) else []:
                trace = row.get("trace") if isinstance(row, dict) else None
                if isinstance(trace, dict) and "events" in trace:
                    found[f"{where}/{workload['workload']['name']}/{row['mode']}"] = trace
    return found


def replayed(trace: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The directives a fresh planner answers ``trace`` with (``None`` where the replay raises)."""
    from lightning_offload.planner.replay import replay

    try:
        return replay(trace)[1]
    except Exception:  # a patched constant or a rule switched off may break an invariant: that is a change too
        return None


def changed_traces(traces: dict[str, dict[str, Any]]) -> list[str]:
    """The traces whose replay answers otherwise than they recorded (or raises)."""
    from lightning_offload.planner.trace import recorded_answers

    return [name for name, trace in traces.items() if replayed(trace) != recorded_answers(trace)]


def short_name(trace: str) -> str:
    """A zoo trace by its row (``04``, ``after-04``), any other by its name."""
    for prefix in ("h100-zoo-after-", "h100-zoo-"):
        if trace.startswith(prefix):
            return ("after-" if "after" in prefix else "") + trace.removeprefix(prefix)[:2]
    return trace


def scaled(value: float, factor: float) -> float:
    return max(1, round(value * factor)) if isinstance(value, int) else value * factor


def main(argv: list[str] | None = None) -> int:
    description = __doc__.split("\n")[0]
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_sensitivity", description=description)
    parser.add_argument("--traces", type=Path, default=TRACES)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--all-recorded",
        action="store_true",
        help="also every trace under benchmarks/results/; those the planner now answers otherwise are left out, named",
    )
    args = parser.parse_args(argv)
    traces = {p.stem: json.loads(p.read_text()) for p in sorted(args.traces.glob("*.json"))}
    if not traces:
        print(f"no traces under {args.traces}", file=sys.stderr)
        return 1
    baseline = changed_traces(traces)
    if baseline:
        print(f"traces that do not replay as recorded even unpatched: {baseline}", file=sys.stderr)
        return 1
    if args.all_recorded:
        recorded = recorded_traces()
        # Runs recorded before a deliberate change answer otherwise from then on: they cannot tell a constant's effect.
        stale = set(changed_traces(recorded))
        print(f"left out, answered otherwise since they were recorded: {sorted(stale)}", file=sys.stderr)
        traces.update({name: t for name, t in recorded.items() if name not in stale})
    modules = planner_modules()
    lines = [
        f"# The planner's constants against {len(traces)} recorded traces",
        "",
        "Traces changed (any directive differs) with the constant halved / doubled.",
        "",
        "| constant | module | value | halved | doubled | traces changed (either way) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (module, value) in sorted(constants(modules).items()):
        counts, names = [], set()
        for factor in FACTORS:
            with patched(modules, name, scaled(value, factor)):
                changed = changed_traces(traces)
            counts.append(len(changed))
            names.update(changed)
        shown = ", ".join(sorted(short_name(n) for n in names))
        short = module.__name__.rsplit(".", 1)[-1]
        lines.append(f"| `{name}` | {short} | {value:g} | {counts[0]} | {counts[1]} | {shown or '-'} |")
    return write_table(lines, args.out)


def write_table(lines: list[str], out: Path | None) -> int:
    """Print a Markdown table's ``lines``, and write them to ``out`` where given; the exit status."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
