"""The benchmark pipeline on a CPU (``--tiny``), its command line, and the verdicts on hand-made numbers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks import __main__ as cli
from benchmarks import anchors, capacity, models, report
from benchmarks.__main__ import parse_args
from benchmarks.worker import (
    NO_BUDGET_API,
    PLANNER_WARMUP,
    SETTLED_WARMUP,
    budget_bytes,
    memory_budget_available,
    run_workload,
)
from benchmarks.workloads import BUDGET_MODES, MODES, WORKLOADS, Mode, engine_kwargs, ordered, tiny
from lightning_offload.options import OffloadOptions

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
VERDICT_KEYS = {"P1", "P1b", "P2", "P3", "P4", "G", "B1", "B2", "B4", "B5"}


# ---------------------------------------------------------------------------------------------- the pipeline


def test_tiny_pipeline_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    """``--tiny`` checks the pipeline: "pipeline OK, N rows ran", the tiny models' own names, no verdicts (their
    numbers judge nothing), no plot without CUDA peaks, and one line for the rows that need CUDA where it is missing."""
    # Runs with the test extra alone: without transformers the demo model stands in (recorded in the env).
    command = [sys.executable, "-m", "benchmarks", "--tiny", "--steps=1", "--warmup=1"]
    done = subprocess.run(
        [*command, f"--out={tmp_path}", "--device-name=cpu-test"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    cuda = torch.cuda.is_available()

    merged = json.loads((tmp_path / "cpu-test.json").read_text())
    assert "verdicts" not in merged
    assert [r["workload"]["name"] for r in merged["results"]] == [f"tiny-{name}" for name in WORKLOADS]
    ran = 0
    for result, name in zip(merged["results"], WORKLOADS, strict=True):
        assert result["workload"]["hidden"] == 64  # shrunk
        assert result["env"]["model_impl"] == models.backend()
        assert result["env"]["memory_budget_api"] == memory_budget_available()
        rows = {row["mode"]: row for row in result["rows"]}
        need_cuda = [m for m in ordered(WORKLOADS[name].modes) if MODES[m].needs_cuda and not cuda]
        assert result.get("skipped_need_cuda", []) == need_cuda, name
        # none first, the default, then the workload's list (budget rows last among ours), less what needs CUDA here
        assert list(rows) == [m for m in ordered(WORKLOADS[name].modes) if m not in need_cuda], name
        assert "ours-default" in rows, name
        if cuda:
            assert set(BUDGET_MODES) <= set(rows), name  # on every workload
        for mode, row in rows.items():
            if MODES[mode].budget is not None and not memory_budget_available():
                assert row["status"] == NO_BUDGET_API
                continue
            if row["status"].startswith("not available"):  # an anchor not installed (on a GPU)
                continue
            assert row["status"] == "ok", (name, mode, row["status"])
            ran += 1
            for key in ("step_s", "ratio", "tokens_per_s", "fwd_s", "bwd_s", "opt_s", "grad_rel_diff"):
                assert row[key] is not None, (name, mode, key)
            if not cuda:
                # Checkpointing and offloading restore bit-identical tensors on the CPU.
                assert row["grad_rel_diff"] == 0.0, (name, mode)
                if mode == "none":  # and the CPU's kernels repeat a step exactly: no noise to allow for
                    assert row["grad_noise"] == 0.0, name
            if MODES[mode].engine is not None:
                assert "offloaded_bytes" in row["engine"] and "offloaded_gib" in row
        if "streamed-all" in rows:
            stats = rows["streamed-all"]["engine"]
            assert stats["offloaded_bytes"] > 0
            assert stats["offloaded_bytes"] == stats["eligible_bytes"]  # no tail, no budget: everything left
        if "off" in rows:
            assert rows["off"]["engine"]["offloaded_bytes"] == 0
        assert rows["ours-default"]["knobs"] == {}  # no argument at all

    out = done.stdout
    assert f"pipeline OK, {ran} rows ran" in out.splitlines()[-1], out[-3000:]
    # No verdict at all: neither a line of the table nor a missed requirement.
    assert not [line for line in out.splitlines() if line.split(" ", 1)[0] in VERDICT_KEYS], out[-3000:]
    assert "missed" not in out and "needs CUDA" not in out
    skipped_lines = [line for line in out.splitlines() if line.startswith("not run without CUDA")]
    assert len(skipped_lines) == (0 if cuda else 1), out[-3000:]
    if not cuda:
        total = sum(len(r.get("skipped_need_cuda", [])) for r in merged["results"])
        assert f"{total} rows of {len(WORKLOADS)} workloads" in skipped_lines[0]
        assert "no plot" in out

    text = (tmp_path / "cpu-test.md").read_text()
    assert "## Verdicts" not in text and report.TINY_NOTE in text
    assert "## Environment" in text and "## Definitions" in text
    for key in VERDICT_KEYS:
        assert f"- **{key}**" not in text and f"\n| {key} | **" not in text, key
    for name in WORKLOADS:
        assert f"## tiny-{name}" in text
    files = ["cpu-test.json", "cpu-test.md"] + (["cpu-test.png"] if cuda else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == files
    if cuda:
        assert (tmp_path / "cpu-test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The verdicts still run on the rows the pipeline made, when asked (as a full-size run asks).
    judged = report.markdown(merged["results"], "judged")
    for key in VERDICT_KEYS:
        assert f"\n| {key} | **" in judged, key  # one verdict line each


def test_a_run_that_measures_nothing_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results"
    # A deadline too short for any worker: every workload is skipped.
    assert cli.main(["--tiny", "--deadline", "1", "--out", str(out)]) == 1
    assert not out.exists()
    assert "nothing measured" in capsys.readouterr().out


def test_full_size_run_names_the_missing_extra_before_doing_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models, "have", lambda *names: False)
    out = tmp_path / "results"
    assert cli.main(["--workloads", "llama8b-lora-s8k", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert 'pip install -e ".[examples]"' in captured.err and "peft" in captured.err and "--tiny" in captured.err
    assert captured.out == "" and not out.exists()  # no worker started, no file written
    # The small-vocab capacity model falls back to the demo model: it needs nothing.
    assert cli.missing_requirements(parse_args(["--capacity", "--capacity-models", "smallvocab-h1024"])) is None
    problem = cli.missing_requirements(parse_args(["--capacity", "--capacity-models", "llama1b"]))
    assert problem is not None and "transformers" in problem and "peft" not in problem
    assert cli.missing_requirements(parse_args(["--tiny"])) is None


def test_default_output_folder_is_git_ignored() -> None:
    assert parse_args([]).out == Path("benchmarks/out")
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/benchmarks/out/" in ignored and "/.refimpl/" in ignored and "/.whl/" in ignored
    assert parse_args(["--out", "elsewhere"]).out == Path("elsewhere")


def test_importing_the_benchmarks_changes_no_environment_or_path() -> None:
    code = (
        "import os, sys\n"
        "env, path = dict(os.environ), list(sys.path)\n"
        "import benchmarks, benchmarks.__main__, benchmarks.anchors, benchmarks.capacity, benchmarks.merge\n"
        "import benchmarks.models, benchmarks.report, benchmarks.search, benchmarks.worker, benchmarks.workloads\n"
        "assert dict(os.environ) == env, set(os.environ) ^ set(env)\n"
        "assert sys.path == path\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k not in anchors.ENVIRONMENT}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_workers_get_the_anchor_folders_and_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "REFIMPL", tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    monkeypatch.delenv("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", raising=False)
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "ao").mkdir()
    env = cli.worker_env()
    # torchao apart from the anchors: hiding it from peft must not hide TRL (whose rows read "No module named 'trl'")
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "pkgs"), str(tmp_path / "ao"), "/somewhere"]
    assert env["TORCHAO_FORCE_SKIP_LOADING_SO_FILES"] == "1"
    assert "TORCHAO_FORCE_SKIP_LOADING_SO_FILES" not in __import__("os").environ  # a copy, not this process
    monkeypatch.setattr(cli, "REFIMPL", tmp_path / "absent")
    assert cli.worker_env()["PYTHONPATH"] == "/somewhere"


def test_cli_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "llama1b-s4k,nope"])
    with pytest.raises(SystemExit):
        parse_args(["--modes", "none,warp-speed"])
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "--capacity-models", "llama70b"])
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "--caps", "24,lots"])
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "--caps", "0"])
    args = parse_args(["--tiny"])
    assert (args.steps, args.warmup, args.device_name) == (2, 1, "tiny")
    assert parse_args([]).steps == 6
    args = parse_args(["--capacity", "--caps", "80,24", "--capacity-models", "llama1b,smallvocab-h1024"])
    assert (args.steps, args.step, args.device_name) == (3, 2048, "gpu-capacity")
    assert args.caps == {"llama1b": [24.0, 80.0], "smallvocab-h1024": [24.0, 80.0]}  # --caps: for every model
    assert args.max_seq == {"llama1b": 131072, "smallvocab-h1024": 196608}
    # Defaults: 24/40/80 GiB, but 6/8/12 GiB for the small-vocab model (AC would train ~200k tokens at 24 GiB).
    args = parse_args(["--capacity"])
    assert args.caps == {"llama1b": [24, 40, 80], "llama8b-lora": [24, 40, 80], "smallvocab-h1024": [6, 8, 12]}
    args = parse_args(["--capacity", "--tiny", "--max-seq", "1024"])
    assert args.caps["smallvocab-h1024"] == [24, 40, 80] and set(args.max_seq.values()) == {1024}
    assert args.step == 128
    with pytest.raises(SystemExit):
        parse_args(["--capacity", "--max-seq", "1000"])  # less than one step


def test_capacity_from_sets_each_modes_first_probe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for bad in ("34816", '{"ac": -2048}', '{"ac": "lots"}', "{nope"):
        with pytest.raises(SystemExit):
            parse_args(["--capacity", "--capacity-from", bad])
    args = parse_args(["--capacity", "--capacity-from", '{"ac": 34816}'])
    assert args.capacity_from == {"ac": 34816}
    commands = []
    monkeypatch.setattr(
        subprocess, "run", lambda command, **_: commands.append(command) or subprocess.CompletedProcess(command, 0)
    )
    capacity.drive(
        ["llama1b"],
        {"llama1b": [24.0, 40.0]},
        ["ac", "none"],
        3,
        2048,
        {"llama1b": 65536},
        False,
        tmp_path,
        time.time() + 3600,
        {},
        first={"ac": 34816},
    )
    # A worker starts one step above what it is given; with no result at 24 GiB, 40 GiB starts where 24 GiB did.
    starts = [json.loads(next(a for a in c if a.startswith("--starts=")).split("=", 1)[1]) for c in commands]
    assert starts == [{"ac": 32768}, {"ac": 32768}]


def test_budget_rows_take_their_budget_from_earlier_rows() -> None:
    rows = {"none": {"status": "ok", "peak_alloc_gib": 30.0}, "ac+offload": {"status": "ok", "peak_alloc_gib": 16.0}}
    assert budget_bytes(MODES["ours-budget-0.7x"], rows) == (pytest.approx(21.0 * GiB), "")
    assert budget_bytes(MODES["ours-budget-floor"], rows) == (pytest.approx(17.6 * GiB), "")
    assert budget_bytes(MODES["ours-budget-0.5x"], {"none": {"status": "OOM"}}) == (
        None,
        "no peak of `none` to take a fraction of",
    )
    assert budget_bytes(MODES["ours-budget-floor"], {"none": rows["none"]})[0] is None
    assert {MODES[m].budget for m in BUDGET_MODES} == {0.95, 0.9, 0.7, 0.5, "floor"}
    assert budget_bytes(MODES["ours-budget-8gib"], {}) == (8 * GiB, "")  # absolute: needs no earlier row
    assert engine_kwargs(MODES["ours-default"], tiny_run=True) == {}  # --tiny scaling leaves the default alone


def test_tiny_byte_knobs_keep_zero_and_none() -> None:
    MiB = 1 << 20
    # Hand-tuned rows switch the planner off where the engine has one: they measure exactly the knobs they name.
    planner = {"memory_budget": None} if memory_budget_available() else {}
    # streamed-all: only the tail is set, to 0, and 0 stays 0 (not the tiny default tail); pacing is the engine's.
    assert engine_kwargs(MODES["streamed-all"], tiny_run=False) == {
        "mode": "streamed",
        "resident_tail_bytes": 0,
        **planner,
    }
    knobs = engine_kwargs(MODES["streamed-all"], tiny_run=True)
    assert knobs == {"mode": "streamed", "resident_tail_bytes": 0, "min_tensor_bytes": 1024, **planner}
    # Without a tail of its own, a --tiny row gets the tiny default tail.
    assert engine_kwargs(MODES["streamed"], tiny_run=True)["resident_tail_bytes"] == 256 * MiB // 1024
    # Budgets are ints: scaled by 1024 in --tiny runs, untouched otherwise.
    assert engine_kwargs(MODES["budget-2G"], tiny_run=False) == {
        "mode": "streamed",
        "max_offload_bytes": 2 * GiB,
        **planner,
    }
    assert engine_kwargs(MODES["budget-2G"], tiny_run=True)["max_offload_bytes"] == 2 * GiB // 1024
    # Every int byte knob scales; None (no limit) and 0 keep their meaning.
    mode = Mode(
        "x",
        "ours",
        engine={"resident_tail_bytes": 8 * GiB, "max_inflight_bytes": 512 * MiB, "max_offload_bytes": None},
    )
    knobs = engine_kwargs(mode, tiny_run=True)
    assert knobs["resident_tail_bytes"] == 8 * MiB and knobs["max_inflight_bytes"] == 512 * 1024
    assert knobs["max_offload_bytes"] is None
    mode = Mode("y", "ours", engine={"max_inflight_bytes": None, "max_offload_bytes": 0})
    knobs = engine_kwargs(mode, tiny_run=True)
    assert knobs["max_inflight_bytes"] is None and knobs["max_offload_bytes"] == 0
    assert mode.engine == {"max_inflight_bytes": None, "max_offload_bytes": 0}  # the mode itself is not changed


def test_budget_modes_and_every_engine_mode_is_valid() -> None:
    assert not [name for name in MODES if name.startswith(("pace-", "tail-"))]
    budgets = {name: mode.engine["max_offload_bytes"] for name, mode in MODES.items() if name.startswith("budget-")}
    assert budgets and all(value == int(name[len("budget-") : -1]) * GiB for name, value in budgets.items())
    assert all(MODES[name].sweep for name in budgets)
    for workload in WORKLOADS.values():
        assert set(workload.modes) <= set(MODES), workload.name
    # The kwargs of every mode, full-size and tiny, pass the engine's own validation.
    for mode in MODES.values():
        if mode.engine is not None:
            for tiny_run in (False, True):
                OffloadOptions.create("test", **engine_kwargs(mode, tiny_run))


def test_missing_anchor_is_reported_not_raised() -> None:
    if importlib.util.find_spec("torchtune") is None:
        with pytest.raises(anchors.AnchorUnavailable, match="torchtune"):
            anchors.torchtune(torch.nn.Linear(2, 2))
    if importlib.util.find_spec("trl") is None:
        with pytest.raises(anchors.AnchorUnavailable, match="trl"):
            anchors.trl(torch.nn.Linear(2, 2))


def test_old_torchao_detection(tmp_path: Path) -> None:
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text("")
    (tmp_path / "torchao-0.15.0.dist-info").mkdir()
    assert anchors._old_torchao_at(str(tmp_path))
    (tmp_path / "torchao-0.15.0.dist-info").rename(tmp_path / "torchao-0.16.0.dist-info")
    assert not anchors._old_torchao_at(str(tmp_path))
    assert not anchors._old_torchao_at(str(tmp_path / "elsewhere"))


def test_hooks_registered_by_a_mode_are_removed() -> None:
    from benchmarks.worker import _hooks_restored

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    keep = model[1].register_forward_hook(lambda *args: None)
    with _hooks_restored(model):
        model[1].register_forward_pre_hook(lambda *args: None)
        model[1].register_forward_hook(lambda *args: None, always_call=True)
        model[0].register_forward_hook(lambda *args: None)
    assert list(model[1]._forward_hooks) == [keep.id]
    assert not model[1]._forward_pre_hooks and not model[0]._forward_hooks
    assert not model[1]._forward_hooks_always_called


# ---------------------------------------------------------------------------------------------- verdicts


def _row(mode: str, step: float, peak: float | None = None, offloaded_gib: float | None = None, **extra: Any) -> dict:
    spec = MODES[mode]
    row = {
        "mode": mode,
        "group": spec.group,
        "checkpoint": spec.checkpoint,
        "sweep": spec.sweep,
        "status": "ok",
        "step_s": step,
        "fwd_s": extra.pop("fwd", step * 0.3),
        "bwd_s": extra.pop("bwd", step * 0.6),
        "opt_s": extra.pop("opt", step * 0.1),
        "peak_alloc_gib": peak,
        "grad_rel_diff": extra.pop("grad", 0.0 if mode == "none" else 1e-3),
    }
    if offloaded_gib is not None:
        row["engine"] = {
            "offloaded_bytes": offloaded_gib * GiB,
            "d2h_gbps": extra.pop("d2h", 50.0),
            "h2d_gbps": extra.pop("h2d", 50.0),
            "stall_ms": 1.0,
        }
    row.update(extra)
    return row


def _result(name: str, rows: list[dict], link: dict | None = None) -> dict:
    link = link if link is not None else {"d2h_gbps": 55.0, "h2d_gbps": 55.0, "both_gbps": 100.0}
    return report.derive({"workload": {**WORKLOADS[name].as_dict()}, "link": link, "rows": rows})


def _by_key(results: list[dict]) -> dict[str, report.Verdict]:
    return {v.key: v for v in report.verdicts(results)}


def test_copy_bound_arithmetic() -> None:
    # none: fwd 0.1 s, bwd 0.2 s, opt 0.05 s; 11 GB over 55 GB/s = 0.2 s each way.
    none = _row("none", 0.35, 30.0, fwd=0.1, bwd=0.2, opt=0.05)
    result = _result("llama1b-s4k", [none, _row("streamed-all", 0.5, 20.0, offloaded_gib=11e9 / GiB)])
    everything = result["rows"][1]
    assert everything["t_bound_s"] == pytest.approx(0.2 + 0.2 + 0.05)
    assert everything["bound_ratio"] == pytest.approx(0.5 / 0.45)
    assert everything["ratio"] == pytest.approx(0.5 / 0.35)
    assert everything["offloaded_gib"] == pytest.approx(11e9 / GiB)
    assert report.copy_bound(none, 1e9, {}) is None


def test_bound_of_checkpointed_rows_uses_checkpointing_alone() -> None:
    rows = [
        _row("none", 0.30, 30.0, fwd=0.1, bwd=0.15, opt=0.05),
        _row("ac-ours", 0.40, 20.0, fwd=0.1, bwd=0.25, opt=0.05),
        _row("ac+offload", 0.41, 15.0, offloaded_gib=0.5),
    ]
    result = _result("llama1b-s4k", rows)
    assert result["rows"][2]["t_bound_s"] == pytest.approx(0.1 + 0.25 + 0.05)  # D/B small: compute-bound


def test_checkpoint_input_bytes() -> None:
    # layers x batch x seq x hidden x 2 bytes (bf16)
    assert report.checkpoint_input_gib(WORKLOADS["llama8b-lora-s8k"].as_dict()) == pytest.approx(2.0)  # 32x1x8192x4096
    assert report.checkpoint_input_gib(WORKLOADS["llama1b-s4k"].as_dict()) == pytest.approx(0.5)  # 16x2x4096x2048
    assert report.checkpoint_input_gib(WORKLOADS["llama1b-s16k"].as_dict()) == pytest.approx(1.0)  # 16x1x16384x2048


def test_p1_streamed_all_against_the_copy_bound() -> None:
    # T_bound = 0.2 + 0.2 + 0.05 = 0.45 s (11 GB each way over 55 GB/s).
    none = _row("none", 0.35, 30.0, fwd=0.1, bwd=0.2, opt=0.05)
    close = _row("streamed-all", 0.50, 20.0, offloaded_gib=11e9 / GiB)
    verdict = _by_key([_result("llama1b-s4k", [none, close])])["P1"]
    assert verdict.status == "met" and "1.11x" in verdict.detail  # 0.50 / 0.45
    slow = _row("streamed-all", 0.52, 20.0, offloaded_gib=11e9 / GiB)
    verdict = _by_key([_result("llama1b-s4k", [none, slow])])["P1"]
    assert verdict.status == "missed" and "1.16x" in verdict.detail  # 0.52 / 0.45 > 1.15
    # Any workload over the bound misses P1.
    verdict = _by_key([_result("llama1b-s4k", [none, close]), _result("llama1b-s16k", [none, slow])])["P1"]
    assert verdict.status == "missed" and "llama1b-s4k" in verdict.detail and "llama1b-s16k" in verdict.detail
    # Only `streamed-all` is judged: another row at the bound does not stand in for it.
    other = _row("streamed", 0.45, 22.0, offloaded_gib=11e9 / GiB)
    assert _by_key([_result("llama1b-s4k", [none, other])])["P1"].status == "n/a"
    # No link measured (CPU): nothing to judge.
    assert _by_key([_result("llama1b-s4k", [none, slow], link={})])["P1"].status == "n/a"


def test_p1b_ahead_of_every_anchor() -> None:
    base = [_row("none", 0.18, 34.1), _row("trl", 0.73, 24.5), _row("save_on_cpu", 1.29, 20.9)]
    ours = [_row("streamed", 0.40, 20.9, offloaded_gib=10.0), _row("budget-2G", 0.25, 26.0, offloaded_gib=4.0)]
    verdict = _by_key([_result("llama1b-s4k", base + ours)])["P1b"]
    assert verdict.status == "met"  # streamed: peak <= both anchors' (equal counts) and faster than both
    assert "llama1b-s4k/trl" in verdict.detail and "llama1b-s4k/save_on_cpu" in verdict.detail
    assert "vs streamed" in verdict.detail and "3.23x faster" in verdict.detail  # 1.29 / 0.40
    # The fastest row under each anchor's peak is the one compared: budget-4G fits trl (24.0 <= 24.5).
    budget = _row("budget-4G", 0.30, 24.0, offloaded_gib=6.0)
    verdict = _by_key([_result("llama1b-s4k", [*base, *ours, budget])])["P1b"]
    assert verdict.status == "met" and "vs budget-4G" in verdict.detail
    # Equal peak and equal step time are enough, anchor by anchor.
    tie = [_row("streamed", 1.29, 20.9, offloaded_gib=10.0), _row("budget-4G", 0.73, 24.5, offloaded_gib=6.0)]
    assert _by_key([_result("llama1b-s4k", base + tie)])["P1b"].status == "met"
    # Missed on time: at the anchors' memory but slower than save_on_cpu.
    slow = [_row("streamed", 1.5, 20.0, offloaded_gib=10.0)]
    assert _by_key([_result("llama1b-s4k", base + slow)])["P1b"].status == "missed"
    # Missed on memory: no slack on the peak, 21.0 GiB does not reach save_on_cpu's 20.9.
    fat = [_row("streamed", 0.40, 21.0, offloaded_gib=10.0)]
    verdict = _by_key([_result("llama1b-s4k", base + fat)])["P1b"]
    assert verdict.status == "missed" and "save_on_cpu: none of ours reaches its peak 20.9 GiB" in verdict.detail
    # Checkpointing rows and `off` are not offloading rows: they cannot stand in.
    others = [
        _row("ac+offload", 0.30, 15.0, offloaded_gib=1.0),
        _row("off", 0.18, 20.0, offloaded_gib=0.0),
        _row("ac-ours", 0.22, 18.0),
    ]
    verdict = _by_key([_result("llama1b-s4k", base + others)])["P1b"]
    assert verdict.status == "missed" and "none of ours reaches" in verdict.detail
    # Anchors that did not run leave nothing to judge.
    missing = {**_row("trl", 0.0), "status": "not available: trl: ModuleNotFoundError"}
    assert _by_key([_result("llama1b-s4k", [base[0], missing, *ours])])["P1b"].status == "n/a"


def test_p1b_and_p3_do_not_count_planner_rows_whose_plan_checkpoints() -> None:
    """A memory-budget row has no ``checkpoint`` of its own, but its plan may checkpoint blocks (whole or with
    elementwise recompute): such a row is not one of "our offloading rows (no checkpointing)". A plan that only
    offloads still counts."""
    base = [_row("none", 0.18, 34.1), _row("trl", 0.73, 22.3)]
    plan = {"offload_bytes": 0, "checkpoint_blocks": 12, "light_blocks": 0, "split": False, "peak": 19 * GiB}
    checkpointing = _row("ours-budget-0.7x", 0.21, 19.3, offloaded_gib=0.0, plan=plan)
    verdict = _by_key([_result("llama1b-s4k", [*base, checkpointing])])["P1b"]
    assert verdict.status == "missed" and "trl: none of ours reaches its peak 22.3 GiB" in verdict.detail
    light = {**plan, "checkpoint_blocks": 0, "light_blocks": 8}
    elementwise = _row("ours-budget-0.9x", 0.185, 28.0, offloaded_gib=0.0, plan=light)
    verdict = _by_key([_result("llama1b-s4k", [base[0], elementwise])])["P3"]
    assert verdict.status == "missed" and "no row of ours within 1.05x" in verdict.detail
    offloading = {**plan, "checkpoint_blocks": 0, "offload_bytes": 12 * GiB}
    only_offload = _row("ours-budget-0.7x", 0.30, 22.0, offloaded_gib=12.0, plan=offloading)
    verdict = _by_key([_result("llama1b-s4k", [*base, only_offload])])["P1b"]
    assert verdict.status == "met" and "vs ours-budget-0.7x" in verdict.detail


def test_p1b_survives_a_failed_none_row() -> None:
    rows = [{**_row("none", 0.0), "status": "OOM"}, _row("trl", 0.73, 24.5), _row("streamed", 0.4, 20.0)]
    verdicts = _by_key([_result("llama1b-s4k", rows)])
    assert verdicts["P1b"].status == "met" and "1.82x faster" in verdicts["P1b"].detail
    assert report.markdown([_result("llama1b-s4k", rows)], "unit")


def test_p2_time_and_checkpoint_input_bytes_against_ac() -> None:
    # llama8b-lora-s8k: checkpoint inputs 2.0 GiB, so the peak must be <= 43.0 - 0.8 x 2.0 = 41.4 GiB.
    # `ac-ours` is deliberately faster: P2 compares with `ac` only.
    base = [_row("none", 1.0, 100.0), _row("ac", 1.40, 43.0), _row("ac-ours", 1.30, 43.0)]
    good = _by_key([_result("llama8b-lora-s8k", [*base, _row("ac+offload", 1.44, 41.4, offloaded_gib=4.0)])])["P2"]
    assert good.status == "met"  # 1.029x `ac`, peak on the target
    assert "1.029x the time of `ac`" in good.detail
    assert "target <= 41.40" in good.detail and "checkpoint inputs 2.00 GiB" in good.detail
    slow = _by_key([_result("llama8b-lora-s8k", [*base, _row("ac+offload", 1.45, 31.0, offloaded_gib=4.0)])])["P2"]
    assert slow.status == "missed" and "1.036x" in slow.detail  # 1.45 / 1.40 > 1.03
    # Below `ac`'s peak, but by less than 80% of the checkpoint inputs.
    fat = _by_key([_result("llama8b-lora-s8k", [*base, _row("ac+offload", 1.40, 41.5, offloaded_gib=4.0)])])["P2"]
    assert fat.status == "missed"
    # The input bytes scale with the workload: on llama1b-s4k (0.5 GiB of inputs) 42.5 GiB is enough.
    small = [_row("none", 1.0, 60.0), _row("ac", 1.40, 43.0), _row("ac+offload", 1.40, 42.6, offloaded_gib=1.0)]
    assert _by_key([_result("llama1b-s4k", small)])["P2"].status == "met"
    small[-1]["peak_alloc_gib"] = 42.7
    assert _by_key([_result("llama1b-s4k", small)])["P2"].status == "missed"
    # Without `ac` (or without peaks, on a CPU) there is nothing to judge.
    no_ac = [base[0], base[2], _row("ac+offload", 1.30, 31.0, offloaded_gib=4.0)]
    assert _by_key([_result("llama8b-lora-s8k", no_ac)])["P2"].status == "n/a"
    no_peaks = [_row("none", 1.0), _row("ac", 1.4), _row("ac+offload", 1.4, offloaded_gib=4.0)]
    assert _by_key([_result("llama8b-lora-s8k", no_peaks)])["P2"].status == "n/a"


def test_p3_free_memory_within_five_percent_of_none() -> None:
    # none: 0.180 s, fwd 0.055 s; link 55 GB/s: 55e9 x 0.055 B = 2.82 GiB moves during forward.
    none = _row("none", 0.180, 34.1, fwd=0.055)
    ours = [
        _row("budget-2G", 0.185, 32.0, offloaded_gib=2.0),  # 1.028x, saves 2.1 GiB
        _row("budget-4G", 0.1885, 31.0, offloaded_gib=4.0),  # 1.047x, saves 3.1 GiB: the largest "free" saving
        _row("streamed", 0.50, 20.0, offloaded_gib=14.0),  # saves more, but 2.78x: not free
        _row("ac+offload", 0.185, 20.0, offloaded_gib=1.0),  # checkpointing: not counted
        _row("off", 0.180, 30.0, offloaded_gib=0.0),  # nothing offloaded: not counted
    ]
    verdict = _by_key([_result("llama1b-s4k", [none, *ours])])["P3"]
    assert verdict.status == "met"
    assert "budget-4G saves 3.10 GiB of peak at 1.047x" in verdict.detail
    assert "link x forward time = 2.82 GiB" in verdict.detail
    # Missed: nothing of ours within 1.05x of `none`.
    slow = [_row("streamed", 0.50, 20.0, offloaded_gib=14.0), _row("budget-4G", 0.19, 31.0, offloaded_gib=4.0)]
    verdict = _by_key([_result("llama1b-s4k", [none, *slow])])["P3"]
    assert verdict.status == "missed" and "no row of ours within 1.05x" in verdict.detail  # 0.19 / 0.18 = 1.056x
    # Missed: within 1.05x but no memory saved.
    nothing = [_row("budget-1G", 0.181, 34.1, offloaded_gib=0.0)]
    assert _by_key([_result("llama1b-s4k", [none, *nothing])])["P3"].status == "missed"
    # One workload without free memory misses P3 for the benchmark.
    both = [_result("llama1b-s4k", [none, *ours]), _result("llama1b-s16k", [none, *nothing])]
    assert _by_key(both)["P3"].status == "missed"
    # No peaks (CPU): nothing to judge.
    cpu = [_row("none", 0.18), _row("budget-2G", 0.185, offloaded_gib=2.0)]
    assert _by_key([_result("llama1b-s4k", cpu)])["P3"].status == "n/a"


def test_p4_do_no_harm() -> None:
    rows = [_row("none", 0.100, 3.0), _row("off", 0.101, 3.0, offloaded_gib=0.0), _row("streamed", 0.104, 2.5)]
    rows[2]["engine"] = {"offloaded_bytes": 0.5 * GiB}
    assert _by_key([_result("small-h512", rows)])["P4"].status == "met"
    rows[1]["peak_alloc_gib"] = 4.0  # peaks are not part of P4
    assert _by_key([_result("small-h512", rows)])["P4"].status == "met"
    rows[2]["step_s"] = 0.2
    verdict = _by_key([_result("small-h512", rows)])["P4"]
    assert verdict.status == "missed" and "small-h512/streamed: 2.000x" in verdict.detail
    rows[2]["step_s"] = 0.1
    rows[1]["step_s"] = 0.103  # off at 1.03x
    assert _by_key([_result("small-h512", rows)])["P4"].status == "missed"
    # `off` is judged wherever it ran; `streamed` only on small-h512 (elsewhere it is meant to trade time).
    big = [_row("none", 0.18, 34.1), _row("off", 0.1836, 34.1, offloaded_gib=0.0), _row("streamed", 0.5, 22.0)]
    verdict = _by_key([_result("llama1b-s4k", big)])["P4"]
    assert verdict.status == "met" and "llama1b-s4k/off: 1.020x" in verdict.detail and "streamed" not in verdict.detail
    big[1]["step_s"] = 0.185  # 1.028x
    assert _by_key([_result("llama1b-s4k", big)])["P4"].status == "missed"
    # Neither row ran: nothing to judge.
    assert _by_key([_result("llama8b-lora-s8k", [big[0], big[2]])])["P4"].status == "n/a"


def test_gradient_agreement_and_failed_rows() -> None:
    rows = [
        _row("none", 1.0, 30.0),
        _row("streamed", 1.2, 20.0, offloaded_gib=5.0),
        {**_row("sync", 0.0), "status": "OOM"},
        _row("ac", 1.3, 20.0, grad=0.5),
    ]
    result = _result("llama1b-s4k", rows)
    assert "ratio" not in result["rows"][2]  # failed rows get no derived numbers
    verdict = _by_key([result])["G"]
    assert verdict.status == "missed" and "llama1b-s4k/ac" in verdict.detail
    assert "streamed" not in verdict.detail  # only the rows out of tolerance are listed
    assert _by_key([_result("llama1b-s4k", rows[:2])])["G"].status == "met"
    # The tolerance is inclusive; `none` itself is not compared.
    edge = [_row("none", 1.0, 30.0, grad=1.0), _row("streamed", 1.2, 20.0, grad=report.GRAD_TOLERANCE)]
    verdict = _by_key([_result("llama1b-s4k", edge)])["G"]
    assert verdict.status == "met" and verdict.detail.startswith("1 rows compared")
    edge[1]["grad_rel_diff"] = 2.1e-2
    assert _by_key([_result("llama1b-s4k", edge)])["G"].status == "missed"
    assert _by_key([_result("llama1b-s4k", rows[:1])])["G"].status == "n/a"


def test_gradient_tolerance_widens_to_twice_what_none_differs_from_itself() -> None:
    rows = [_row("none", 1.0, 30.0, grad_noise=1.5e-2), _row("streamed", 1.2, 20.0, grad=2.9e-2)]
    verdict = _by_key([_result("llama8b-lora-s8k", rows)])["G"]
    assert verdict.status == "met" and "llama8b-lora-s8k 1.5e-02" in verdict.detail
    rows[1]["grad_rel_diff"] = 3.1e-2  # beyond twice the noise
    verdict = _by_key([_result("llama8b-lora-s8k", rows)])["G"]
    assert verdict.status == "missed" and "3.10e-02 (tolerance 3.00e-02)" in verdict.detail
    # Noise below the fixed tolerance does not narrow it.
    rows = [_row("none", 1.0, 30.0, grad_noise=1e-4), _row("streamed", 1.2, 20.0, grad=report.GRAD_TOLERANCE)]
    assert _by_key([_result("llama8b-lora-s8k", rows)])["G"].status == "met"


def test_markdown_and_terminal_table_render_every_row() -> None:
    rows = [
        _row("none", 1.0, 30.0),
        _row("streamed", 1.2, 20.0, offloaded_gib=5.0),
        {**_row("trl", 0.0), "status": "not available: trl: ModuleNotFoundError: No module named 'trl'"},
        {**_row("sync", 0.0), "status": "OOM"},
    ]
    results = [_result("llama1b-s4k", rows)]
    text = report.markdown(results, "unit")
    assert "| streamed | ok | 1.200 | 1.20 |" in text
    assert "not available: trl" in text and "| OOM |" in text
    table = report.terminal_table(results)
    assert "streamed" in table and "OOM" in table and "P3" in table
    # Tiny models are not judged: the same rows, no verdict, and the report says why.
    assert "P3" not in report.terminal_table(results, judged=False).split()
    unjudged = report.markdown(results, "unit", judged=False)
    assert "| streamed | ok | 1.200 | 1.20 |" in unjudged and report.TINY_NOTE in unjudged
    assert "## Verdicts" not in unjudged and "**P3**" not in unjudged
    # A name longer than the column (a tiny model's) keeps the table aligned.
    tiny_result = {**_result("llama8b-lora-s8k", rows), "workload": tiny(WORKLOADS["llama8b-lora-s8k"]).as_dict()}
    header, *lines = report.terminal_table([tiny_result], judged=False).splitlines()
    assert [line.index(row["mode"]) for line, row in zip(lines, rows, strict=True)] == [header.index("mode")] * 4


def test_markdown_shows_the_plan_and_the_allocators_flushes_of_a_budget_row() -> None:
    """A memory-budget row shows the plan it ran last with its predicted peak, and its cache flushes per step."""
    GiB = 1 << 30
    plan = {"offload_bytes": int(15.77 * GiB), "checkpoint_blocks": 8, "peak": int(66.09 * GiB)}
    rows = [
        _row("none", 1.0, 99.4),
        {**_row("ours-budget-0.7x", 1.18, 66.1), "plan": plan, "alloc_flushes_per_step": 0.5, "budget_gib": 69.6},
    ]
    text = report.markdown([_result("llama8b-lora-s8k", rows)], "unit")
    budget_line = next(line for line in text.splitlines() if line.startswith("| ours-budget-0.7x |"))
    assert "| 0.5 | 69.6 | 8 ckpt + 15.77 GiB, pred 66.09 |" in budget_line
    none_line = next(line for line in text.splitlines() if line.startswith("| none |"))
    assert "| - | - | - |" in none_line  # no flushes recorded, no budget, no plan
    assert "timed step(s) ran another plan" not in text


def test_markdown_flags_a_budget_row_whose_timed_steps_ran_trials() -> None:
    """A row whose timed steps still ran the planner's trials (or another plan) times more than its plan: it says so."""
    plan = {"offload_bytes": 0, "checkpoint_blocks": 0, "peak": 70 << 30, "light_blocks": 23}
    rows = [_row("none", 1.0, 99.4), {**_row("ours-budget-0.7x", 1.18, 66.1), "plan": plan, "unsettled_timed_steps": 3}]
    text = report.markdown([_result("llama8b-lora-s8k", rows)], "unit")
    budget_line = next(line for line in text.splitlines() if line.startswith("| ours-budget-0.7x |"))
    assert "23 ew + 0 ckpt + 0.00 GiB, pred 70.00; **3 timed step(s) ran another plan or a trial**" in budget_line


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [_row("none", 1.0, 30.0), _row("streamed", 1.2, 20.0, offloaded_gib=5.0), _row("trl", 4.0, 24.0)]
    results = [_result("llama1b-s4k", rows), _result("small-h512", [_row("none", 1.0)])]
    assert report.plottable(results)
    report.plot(results, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    # Rows without a peak (a CPU run) leave nothing to draw.
    cpu_rows = [{**row, "peak_alloc_gib": None} for row in rows]
    assert not report.plottable([_result("llama1b-s4k", cpu_rows)])


def test_rows_that_plan_warm_up_past_the_planners_measuring_steps(tmp_path: Path) -> None:
    """The engine makes its planner at its first step, so the row's mode decides the warm-up: a planning row's timed
    steps start after its two measuring steps and its first planned step (which pins the plan's host buffers); an
    engine's that does not plan after its third (its second and third may empty the cache the steps before left)."""
    result = run_workload("small-h512", ["none", "streamed", "ours-default"], 1, 1, True, tmp_path / "w.json")
    warmups = {row["mode"]: row["warmup"] for row in result["rows"]}
    assert warmups == {"none": 1, "streamed": SETTLED_WARMUP, "ours-default": PLANNER_WARMUP}
    unsettled = {row["mode"]: row.get("unsettled_timed_steps") for row in result["rows"]}
    assert unsettled == {"none": None, "streamed": None, "ours-default": 0}


class _PlannerEngine:
    """Stands in for an engine whose memory-budget planner keeps everything: like ``offload_activations``'s, the planner
    resets the device's peak counters as each step begins (``reset``); ``step_ran``: what the step allocated."""

    def __init__(self, reset: Callable[[], None], step_ran: Callable[[], None]) -> None:
        self.planner = SimpleNamespace(plan=None, trying=False, profile=None)
        self._reset, self._step_ran = reset, step_ran

    def __enter__(self) -> _PlannerEngine:
        self._reset()  # the planner's begin_step
        return self

    def __exit__(self, *exc: object) -> None:
        self._step_ran()

    def collect_stats(self, wait: bool) -> Any:
        from lightning_offload.stats import OffloadStats

        return OffloadStats()

    @property
    def stats(self) -> Any:
        return self.collect_stats(wait=True)


def test_a_rows_peaks_are_the_most_over_its_timed_steps_when_its_planner_resets_the_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A planner made by ``offload_activations`` owns the peak counters and resets them as each step begins: a row's
    peak allocated and reserved are still the most any of its timed steps reached, not the last step's (the CUDA
    counters are simulated on the CPU)."""
    import benchmarks.worker as worker

    counters = {"allocated": 0.0, "reserved": 0.0}

    def reset(device: object = None) -> None:
        counters.update(allocated=0.0, reserved=0.0)

    peaks = iter([50, 50, 50, 10, 12, 8])  # GiB: three warm-up steps, then the timed ones

    def step_ran() -> None:
        peak = next(peaks) * GiB
        counters.update(allocated=peak, reserved=1.05 * peak)

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: counters["reserved"])
    monkeypatch.setattr(worker, "read_counters", lambda device: SimpleNamespace(alloc_retries=0))
    monkeypatch.setattr(worker, "allocator_segments", lambda: "expandable")
    runner = worker.Runner(tiny(WORKLOADS["small-h512"]), 3, 1, True, 1, 1)
    runner.cuda = True  # the device stays the CPU: clocks and synchronizations as there
    engine = _PlannerEngine(reset, step_ran)
    optimizer = torch.optim.AdamW([p for _, p in runner.trainable], lr=1e-5)
    row: dict[str, Any] = {}
    runner._measure(MODES["ours-default"], row, lambda: engine, optimizer, engine)
    assert row["warmup"] == PLANNER_WARMUP and row["steps"] == 3
    assert row["peak_alloc_gib"] == pytest.approx(12.0) and row["peak_reserved_gib"] == pytest.approx(12.6)


def test_a_nan_gradient_is_not_read_as_agreeing_with_none() -> None:
    """A row whose first-step gradient holds a NaN differs from `none` by NaN, which G reads as missed (Python's
    ``max`` keeps the difference found before a NaN, so it read as 0 and G as met)."""
    import math

    from benchmarks.worker import Runner

    runner = Runner(tiny(WORKLOADS["small-h512"]), 1, 1, True, 1, 1)
    for _, param in runner.trainable:
        param.grad = torch.ones_like(param)
    runner.reference_grads = {name: param.grad.clone() for name, param in runner.trainable}
    assert runner._difference_to_reference() == 0.0
    runner.trainable[-1][1].grad.view(-1)[0] = float("nan")
    diff = runner._difference_to_reference()
    assert diff is not None and math.isnan(diff)
    rows = [_row("none", 1.0, 10.0), _row("streamed", 1.2, 8.0, offloaded_gib=1.0, grad=diff)]
    verdict = _by_key([_result("small-h512", rows)])["G"]
    assert verdict.status == "missed" and "small-h512/streamed: nan" in verdict.detail


def test_collector_clock_counts_the_collections_of_each_generation_while_open() -> None:
    """Rows report Python's garbage collections per timed step: the clock counts those made while it is open."""
    import gc

    from benchmarks.worker import _CollectorClock

    with _CollectorClock() as clock:
        gc.collect(2)
        gc.collect(0)
    gc.collect(2)  # after it closed: not counted
    assert clock.collections[2] == 1 and clock.collections[0] >= 1  # (the interpreter may collect on its own too)
    assert clock.ms[2] > 0 and all(ms >= 0 for ms in clock.ms)


def test_baseline_rows_run_under_the_cap_the_environment_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BENCH_CAP_GIB`` caps the rows without a budget of their own (does AC fit under a budget row's cap?), but not
    ``none``, the reference whose peak budgets are fractions of, nor the default, which plans for the device: each
    capped row records the cap it ran under (on the CPU the cap itself is not applied)."""
    from benchmarks.worker import BASELINE_CAP_VARIABLE

    monkeypatch.setenv(BASELINE_CAP_VARIABLE, "2.5")
    result = run_workload("small-h512", ["none", "ac", "ours-default"], 1, 1, True, tmp_path / "w.json")
    assert {row["mode"]: row.get("cap_gib") for row in result["rows"]} == {
        "none": None,
        "ac": 2.5,
        "ours-default": None,
    }
    monkeypatch.delenv(BASELINE_CAP_VARIABLE)
    result = run_workload("small-h512", ["ac"], 1, 1, True, tmp_path / "w.json")
    assert "cap_gib" not in result["rows"][-1]


def test_segment_summary_tells_holes_in_fixed_segments_from_expandable_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capped row that runs out of memory records the allocator's segments by kind: free bytes inside a fixed segment
    that also holds live blocks are holes no flush returns."""
    from benchmarks.worker import segment_summary

    mib = 2**20
    snapshot = [
        {
            "segment_type": "large",
            "is_expandable": False,
            "total_size": 700 * mib,
            "allocated_size": 291 * mib,
            "blocks": [
                {"size": 291 * mib, "state": "active_allocated"},
                {"size": 129 * mib, "state": "inactive"},
                {"size": 80 * mib, "state": "inactive"},
                {"size": 200 * mib, "state": "active_pending_free"},  # freed, its stream still using it: not free
            ],
        },
        {
            "segment_type": "large",
            "is_expandable": True,
            "total_size": 520 * mib,
            "allocated_size": 500 * mib,
            "blocks": [{"size": 500 * mib, "state": "active_allocated"}, {"size": 20 * mib, "state": "inactive"}],
        },
        {
            "segment_type": "large",
            "is_expandable": True,
            "total_size": 500 * mib,
            "allocated_size": 500 * mib,
            "blocks": [{"size": 500 * mib, "state": "active_allocated"}],
        },
    ]
    other_device = {**snapshot[0], "device": 1}  # another GPU's segment: not this device's
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: [*snapshot, other_device])
    assert segment_summary(torch.device("cuda", 0)) == [
        {
            "pool": "large",
            "expandable": True,
            "segments": 2,
            "bytes": 1020 * mib,
            "allocated": 1000 * mib,
            "largest_free": 20 * mib,
        },
        {
            "pool": "large",
            "expandable": False,
            "segments": 1,
            "bytes": 700 * mib,
            "allocated": 291 * mib,
            "largest_free": 129 * mib,
        },
    ]


def test_the_default_row_runs_right_after_none() -> None:
    """Before any offloading row switches the process's allocator to expandable segments: the default is compared
    with `none` under the allocator a user who adds it to a model that fits has."""
    assert ordered(["ac", "ac+offload", "ours-budget-0.9x", "ours-default", "sac"]) == [
        "none",
        "ours-default",
        "ac",
        "sac",
        "ac+offload",
        "ours-budget-0.9x",
    ]


def test_references_whose_reserved_passes_a_budget_run_again_under_its_cap() -> None:
    """After every row, a row B2 would compare a budget row with, whose peak allocated fits the budget and whose peak
    reserved does not, runs once more under the budget's cap; the budget row keeps how it went, and the reference's
    own row is left as it was (on the CPU the cap itself is not applied, and peaks are made up)."""
    from benchmarks.worker import Runner

    runner = Runner(tiny(WORKLOADS["small-h512"]), 1, 1, True, 1, 1)
    rows = [runner.run(MODES["none"]), runner.run(MODES["ac"])]
    rows[1].update(peak_alloc_gib=1.0, peak_reserved_gib=1.2)
    fitting = {"mode": "ours-budget-floor", "group": "ours", "status": "ok", "step_s": 1.0, "budget_gib": 1.1}
    roomy = {"mode": "ours-budget-0.9x", "group": "ours", "status": "ok", "step_s": 1.0, "budget_gib": 1.3}
    below = {"mode": "ours-budget-0.5x", "group": "ours", "status": "ok", "step_s": 1.0, "budget_gib": 1.05}
    saves = []
    runner.run_capped_references([*rows, fitting, roomy, below], lambda: saves.append(1))
    capped = fitting["capped_references"]["ac"]
    assert set(capped) == {
        "status",
        "step_s",
        "peak_alloc_gib",
        "peak_reserved_gib",
        "alloc_flushes_per_step",
        "oom_step",
        "allocator",
    }
    assert capped["allocator"] is None  # no CUDA allocator on a CPU
    assert capped["status"] == "ok" and capped["step_s"] > 0
    assert "capped_references" not in roomy  # AC's 1.2 GiB reserved fits under 1.3: nothing to find out
    assert "capped_references" not in below  # below the floor row's budget: B2 does not count it
    assert saves == [1] and runner.rows["ac"] is rows[1]
