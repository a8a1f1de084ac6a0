"""The capacity run on a CPU (``--capacity --tiny``: real training steps, caps simulated by a memory formula)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import capacity
from benchmarks.search import SearchState
from benchmarks.worker import NO_BUDGET_API, memory_budget_available
from benchmarks.workloads import CAPACITY_MODELS, CAPACITY_MODES

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_capacity_pipeline(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks", "--capacity", "--tiny", "--capacity-models=smallvocab-h1024"]
    done = subprocess.run(
        [*command, "--caps=24,80", f"--out={tmp_path}", "--device-name=cpu"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-capacity.json", "cpu-capacity.md"]
    document = json.loads((tmp_path / "cpu-capacity.json").read_text())
    assert document["kind"] == "capacity" and {v["key"] for v in document["verdicts"]} == {"B3", "B5"}
    results = document["capacity"]
    assert [(r["model"]["name"], r["cap_gib"]) for r in results] == [
        ("tiny-smallvocab-h1024", 24),
        ("tiny-smallvocab-h1024", 80),
    ]
    longest = {}
    for result in results:
        assert result["simulated"] and result["model"]["hidden"] == 64
        entries = {e["mode"]: e for e in result["searches"]}
        assert list(entries) == list(CAPACITY_MODES)
        for mode in ("none", "ac"):
            entry = entries[mode]
            assert entry["status"] == "ok" and entry["complete"], entry
            # The answer is the edge of the simulated cap: the longest fits, one step more does not.
            assert entry["first_fail"] == entry["longest"] + capacity.TINY_STEP
            assert all(p["seq"] <= entry["longest"] for p in entry["probes"] if p["fits"])
            if entry["longest"]:
                assert entry["tokens_per_s"] > 0  # measured from real steps at the longest sequence
            longest[(result["cap_gib"], mode)] = entry["longest"]
        for anchor in ("save_on_cpu", "torchtune", "trl"):
            assert entries[anchor]["status"] == "skipped: needs CUDA"
        if not memory_budget_available():
            assert entries["ours-budget"]["status"] == NO_BUDGET_API
    # More memory never fits less, and checkpointing fits more than keeping everything.
    assert longest[(80, "none")] >= longest[(24, "none")] and longest[(80, "ac")] >= longest[(24, "ac")]
    assert longest[(80, "ac")] > longest[(80, "none")] > 0
    # The search at 80 GiB started above what fitted at 24 GiB.
    first_80 = next(e for e in results[1]["searches"] if e["mode"] == "ac")["probes"][0]["seq"]
    assert first_80 == longest[(24, "ac")] + capacity.TINY_STEP
    text = (tmp_path / "cpu-capacity.md").read_text()
    assert "Simulated caps (no CUDA)" in text and "## tiny-smallvocab-h1024" in text and "| B3 |" in text


def test_simulated_memory_orders_the_modes() -> None:
    model = CAPACITY_MODELS["smallvocab-h1024"]
    peaks = {
        mode: capacity.simulated_peak_bytes(model, mode, 65536, trainable_params=10**8, params=10**8)
        for mode in ("none", "ac", "save_on_cpu", "ours-budget")
    }
    assert peaks["none"] > peaks["save_on_cpu"] > peaks["ac"] > peaks["ours-budget"]
    # Per token: 24 layers x (12 h + 4 h_kv + 8 f) x 1.18 bytes without checkpointing, for h = 1024, f = 4096.
    per_token = (peaks["none"] - capacity.simulated_peak_bytes(model, "none", 0, 10**8, 10**8)) / 65536
    assert per_token == pytest.approx(24 * (12 * 1024 + 4 * 256 + 8 * 4096) * 1.18 + 10 * 256)


def test_a_restarted_worker_continues_the_saved_search(tmp_path: Path) -> None:
    # What a worker leaves when it exits to be replaced: one search in progress, with its probes so far.
    out = tmp_path / "state.json"
    saved = {
        "searches": [
            {
                "mode": "none",
                "status": "running",
                "step": capacity.TINY_STEP,
                "max_seq": capacity.TINY_MAX_SEQ,
                "probes": [{"seq": 128, "fits": True, "wall_s": 0.1}, {"seq": 1024, "fits": False, "wall_s": 0.1}],
            }
        ],
        "restarts": 0,
    }
    out.write_text(json.dumps(saved))
    code = capacity.run_worker(
        "smallvocab-h1024",
        80,
        ["none"],
        steps=2,
        step=capacity.TINY_STEP,
        max_seq=capacity.TINY_MAX_SEQ,
        tiny_run=True,
        out=out,
        deadline_at=time.time() + 300,
    )
    assert code == 0
    result = json.loads(out.read_text())
    entry = result["searches"][0]
    assert result["restarts"] == 1
    assert [p["seq"] for p in entry["probes"][:2]] == [128, 1024]  # kept, not probed again
    assert len(entry["probes"]) > 2 and all(128 < p["seq"] < 1024 for p in entry["probes"][2:])
    assert entry["status"] == "ok" and entry["complete"] and 128 <= entry["longest"] < 1024


def test_a_worker_that_dies_in_a_probe_counts_it_as_not_fitting(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    running = {"mode": "save_on_cpu", "status": "running", "step": 2048, "max_seq": 131072, "pending": 40960}
    running["probes"] = [{"seq": 20480, "fits": True, "wall_s": 5.0}]
    path.write_text(json.dumps({"model": {"name": "llama1b"}, "cap_gib": 80, "searches": [running]}))
    assert capacity._count_crash_as_no_fit(path, -9)
    entry = json.loads(path.read_text())["searches"][0]
    assert "pending" not in entry
    assert entry["probes"][-1]["seq"] == 40960 and entry["probes"][-1]["fits"] is False
    assert "exit code -9" in entry["probes"][-1]["note"]
    state = SearchState.from_dict(entry)  # what the restarted worker continues from
    assert (state.longest, state.first_fail) == (20480, 40960)
    # A worker that died outside any probe (while building the model, say) is not retried.
    assert not capacity._count_crash_as_no_fit(path, -9)
    assert not capacity._count_crash_as_no_fit(tmp_path / "missing.json", 1)
