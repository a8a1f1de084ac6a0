"""The benchmark pipeline on a CPU (``--tiny``), and the verdicts on hand-made numbers."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_offload.bench import anchors, report
from lightning_offload.bench.__main__ import parse_args
from lightning_offload.bench.workloads import MODES, WORKLOADS, engine_kwargs

GiB = 1 << 30
HAVE_HF = all(importlib.util.find_spec(name) is not None for name in ("transformers", "peft", "matplotlib"))


# ---------------------------------------------------------------------------------------------- the pipeline


@pytest.mark.skipif(not HAVE_HF, reason="needs transformers, peft and matplotlib")
def test_tiny_pipeline_writes_json_markdown_and_plot(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "lightning_offload.bench", "--tiny", "--steps=1", "--warmup=1"]
    done = subprocess.run(
        [*command, f"--out={tmp_path}", "--device-name=cpu-test"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "wrote" in done.stdout and "P1" in done.stdout

    merged = json.loads((tmp_path / "cpu-test.json").read_text())
    assert [r["workload"]["name"] for r in merged["results"]] == list(WORKLOADS)
    assert {v["key"] for v in merged["verdicts"]} == {"P1", "P1b", "P2", "P3", "P4", "G"}
    for result in merged["results"]:
        name = result["workload"]["name"]
        assert result["workload"]["hidden"] == 64  # shrunk
        rows = {row["mode"]: row for row in result["rows"]}
        assert list(rows) == list(WORKLOADS[name].modes), name  # none first, then the workload's list
        for mode, row in rows.items():
            if MODES[mode].needs_cuda and not torch.cuda.is_available():
                assert row["status"] == "skipped: needs CUDA"
                continue
            assert row["status"] == "ok", (name, mode, row["status"])
            for key in ("step_s", "ratio", "tokens_per_s", "fwd_s", "bwd_s", "opt_s", "grad_rel_diff"):
                assert row[key] is not None, (name, mode, key)
            # Checkpointing and offloading restore bit-identical tensors on the CPU.
            assert row["grad_rel_diff"] == 0.0, (name, mode)
            if MODES[mode].engine is not None:
                assert "offloaded_bytes" in row["engine"] and "offloaded_gib" in row
        if "streamed-all" in rows:
            stats = rows["streamed-all"]["engine"]
            assert stats["offloaded_bytes"] > 0
            assert stats["offloaded_bytes"] == stats["eligible_bytes"]  # no tail, no pacing: everything left
        if "off" in rows:
            assert rows["off"]["engine"]["offloaded_bytes"] == 0

    text = (tmp_path / "cpu-test.md").read_text()
    assert "## Verdicts" in text and "## Environment" in text
    for name in WORKLOADS:
        assert f"## {name}" in text
    assert (tmp_path / "cpu-test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.worker.json"))  # merged and removed


def test_cli_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--workloads", "llama1b-s4k,nope"])
    with pytest.raises(SystemExit):
        parse_args(["--modes", "none,warp-speed"])
    args = parse_args(["--tiny"])
    assert (args.steps, args.warmup, args.device_name) == (2, 1, "tiny")
    assert parse_args([]).steps == 6


def test_tiny_byte_knobs_keep_zero_and_none() -> None:
    knobs = engine_kwargs(MODES["streamed-all"], tiny_run=True)
    assert knobs["resident_tail_bytes"] == 0 and knobs["max_inflight_bytes"] is None
    assert engine_kwargs(MODES["pace-2G"], tiny_run=True)["max_inflight_bytes"] == 2 * GiB // 1024
    assert engine_kwargs(MODES["pace-2G"], tiny_run=False) == {"mode": "streamed", "max_inflight_bytes": 2 * GiB}


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
    from lightning_offload.bench.worker import _hooks_restored

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


def test_p1_and_p1b() -> None:
    none = _row("none", 0.35, 30.0, fwd=0.1, bwd=0.2, opt=0.05)
    close = _row("streamed-all", 0.50, 20.0, offloaded_gib=11e9 / GiB, d2h=50.0, h2d=48.0)
    verdicts = _by_key([_result("llama1b-s4k", [none, close])])
    assert verdicts["P1"].status == "met" and "1.11x" in verdicts["P1"].detail
    assert verdicts["P1b"].status == "met"
    slow = _row("streamed-all", 0.60, 20.0, offloaded_gib=11e9 / GiB, d2h=30.0, h2d=48.0)
    verdicts = _by_key([_result("llama1b-s4k", [none, slow])])
    assert verdicts["P1"].status == "missed"
    assert verdicts["P1b"].status == "missed" and "55%" in verdicts["P1b"].detail
    # No link measured (CPU): nothing to judge.
    verdicts = _by_key([_result("llama1b-s4k", [none, slow], link={})])
    assert verdicts["P1"].status == "n/a" and verdicts["P1b"].status == "n/a"


def test_p2_against_both_checkpointing_rows() -> None:
    base = [_row("none", 1.0, 100.0), _row("ac", 1.40, 43.0), _row("ac-ours", 1.38, 43.0)]
    good = _by_key([_result("llama8b-lora-s8k", [*base, _row("ac+offload", 1.42, 31.0, offloaded_gib=4.0)])])
    assert good["P2"].status == "met"
    assert "the time of ac," in good["P2"].detail and "the time of ac-ours," in good["P2"].detail
    slow = _by_key([_result("llama8b-lora-s8k", [*base, _row("ac+offload", 1.50, 31.0, offloaded_gib=4.0)])])
    assert slow["P2"].status == "missed"  # 1.087x ac-ours
    fat = _by_key([_result("llama8b-lora-s8k", [*base, _row("ac+offload", 1.40, 44.0, offloaded_gib=4.0)])])
    assert fat["P2"].status == "missed"  # no memory saved


def test_p3_needs_a_faster_row_at_the_anchor_memory() -> None:
    base = [_row("none", 0.18, 34.1), _row("trl", 0.73, 24.5), _row("save_on_cpu", 1.29, 20.9)]
    ours = [_row("streamed", 0.40, 21.0, offloaded_gib=10.0), _row("pace-2G", 0.25, 26.0, offloaded_gib=4.0)]
    verdicts = _by_key([_result("llama1b-s4k", base + ours)])
    assert verdicts["P3"].status == "met"  # streamed fits both anchors' peaks (21.0 <= 20.9 * 1.05) and is faster
    assert "streamed" in verdicts["P3"].detail
    slow = [_row("streamed", 1.5, 21.0, offloaded_gib=10.0)]
    verdicts = _by_key([_result("llama1b-s4k", base + slow)])
    assert verdicts["P3"].status == "missed"
    big = [_row("pace-2G", 0.25, 30.0, offloaded_gib=4.0)]
    verdicts = _by_key([_result("llama1b-s4k", base + big)])
    assert verdicts["P3"].status == "missed" and "none of ours reaches" in verdicts["P3"].detail
    # Anchors that did not run leave nothing to judge.
    missing = {**_row("trl", 0.0), "status": "not available: trl: ModuleNotFoundError"}
    verdicts = _by_key([_result("llama1b-s4k", [base[0], missing, *ours])])
    assert verdicts["P3"].status == "n/a"


def test_p4_do_no_harm() -> None:
    rows = [_row("none", 0.100, 3.0), _row("off", 0.101, 3.0, offloaded_gib=0.0), _row("streamed", 0.104, 2.5)]
    rows[2]["engine"] = {"offloaded_bytes": 0.5 * GiB}
    assert _by_key([_result("small-h512", rows)])["P4"].status == "met"
    rows[2]["step_s"] = 0.2
    verdict = _by_key([_result("small-h512", rows)])["P4"]
    assert verdict.status == "missed" and "2.000x" in verdict.detail
    rows[2]["step_s"] = 0.1
    rows[1]["peak_alloc_gib"] = 4.0
    assert _by_key([_result("small-h512", rows)])["P4"].status == "missed"


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
    assert _by_key([_result("llama1b-s4k", rows[:2])])["G"].status == "met"


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


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [_row("none", 1.0, 30.0), _row("streamed", 1.2, 20.0, offloaded_gib=5.0), _row("trl", 4.0, 24.0)]
    results = [_result("llama1b-s4k", rows), _result("small-h512", [_row("none", 1.0)])]
    report.plot(results, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
