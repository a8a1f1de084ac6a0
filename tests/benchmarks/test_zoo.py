"""The model zoo's rig: the seeded configurations cover what users vary, the summary counts what the targets name,
and ``--tiny`` runs every family under every entry point on the CPU."""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
from pathlib import Path

import pytest

from benchmarks import zoo
from tests.processes import run_on_cpu


def test_the_seeded_zoo_varies_what_users_vary() -> None:
    configs = zoo.generate(2026, 42)
    assert len(configs) == 42 + len(zoo.REGRESSIONS)
    assert zoo.generate(2026, 42) == configs  # the same list on every machine
    drawn = configs[len(zoo.REGRESSIONS) :]

    def values(key: str) -> set:
        return {c[key] for c in drawn}

    assert values("family") == set(zoo.FAMILIES) and values("entry") == set(zoo.ENTRIES)
    vocabs = {c["vocab"] for c in drawn if c["family"] != "vit"}
    assert min(vocabs) == 256 and max(vocabs) >= 150_000
    assert values("tied") == {True, False}
    assert min(values("hidden")) == 512 and max(values("hidden")) == 4096
    assert min(values("layers")) <= 6 and max(values("layers")) >= 30
    assert any(c["kv_heads"] < c["heads"] for c in drawn) and any(c["kv_heads"] == c["heads"] for c in drawn)
    assert min(values("batch")) == 1 and max(values("batch")) >= 8
    assert min(values("seq")) <= 1024 and max(values("seq")) == 32768
    assert values("precision") == {"bf16", "bf16-mixed"} and values("optimizer") == {"adamw", "sgd"}
    assert values("loss_inside") == {True, False} and values("accumulate") == {1, 4}
    callbacks = [c for c in drawn if c["entry"] == "callback"]
    assert any(c["sanity"] for c in callbacks) and any(c["val_every"] for c in callbacks)
    assert any(c["fits"] == 2 for c in callbacks)
    assert all(0.5 <= c["fraction"] <= 0.9 for c in drawn)


def test_the_summary_counts_out_of_memory_errors_only_where_the_floor_fits() -> None:
    rows = [
        {"config": "a", "fits_floor": True, "oom_planned": 1, "ratio_ac": 0.9, "ac_fits": True, "observations": []},
        {"config": "b", "fits_floor": True, "oom_planned": 0, "ratio_ac": 1.2, "ac_fits": True, "observations": []},
        {"config": "c", "fits_floor": False, "oom_planned": 0, "oom_step": {"step": 2}, "floor_warned": False},
        {"config": "d", "error": "none ran out of memory uncapped"},
        {"config": "e", "fits_floor": False, "oom_step": {"step": 0, "kind": "measuring"}, "floor_warned": False},
    ]
    summary = zoo.summary(rows)
    assert (summary["rows"], summary["ran"], summary["errors"], summary["floor_fits"]) == (5, 4, 1, 2)
    assert summary["oom_planned"] == 1 and summary["floor_not_fitting_unwarned"] == 1
    assert summary["floor_not_fitting_told_in_first_step"] == 1  # nothing was measured before row e's first step
    assert summary["oom_where_ac_fits"] == 0  # (no row says where its out of memory came)
    rows[0]["oom_step"] = {"step": 3, "kind": "trial"}
    rows[2].update(ac_fits=True, oom_step={"step": 2, "kind": "planned"})
    assert zoo.summary(rows)["oom_where_ac_fits"] == 2
    assert summary["median_ratio_ac"] == pytest.approx(1.05) and summary["max_ratio_ac"] == 1.2


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_the_tiny_zoo_runs_every_family_under_every_entry_point(tmp_path: Path) -> None:
    out = tmp_path / "zoo.json"
    done = run_on_cpu("benchmarks.zoo", "--tiny", "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pipeline OK, 9 rows ran" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {r["entry"] for r in rows} == {"callback", "context", "fabric"}
    assert {r["settings"]["family"] for r in rows} == set(zoo.FAMILIES)
    for row in rows:
        assert {
            "config",
            "entry",
            "fits_floor",
            "oom_planned",
            "ratio_none",
            "ratio_ac",
            "measuring_trial_steps",
        } <= set(row)
        assert row["oom_planned"] == 0 and row["batches"] > 0
        seconds = row["batch_seconds"]
        assert set(seconds) == {"none", "ac", "planned"} and all(t > 0 for times in seconds.values() for t in times)
        if row["ratio_none"] is not None:  # the ratio is the medians of the batches the row lists
            ratio = statistics.median(seconds["planned"]) / statistics.median(seconds["none"])
            assert row["ratio_none"] == pytest.approx(ratio)
    assert out.with_suffix(".md").read_text().count("\n| ") >= len(rows)


def test_merging_parts_keeps_the_traces_each_part_wrote_beside_it(tmp_path: Path) -> None:
    meta = {"device": "test", "seed": 2026}
    for part, index in (("p1", 0), ("p2", 1)):
        row = {"config": f"{index:02d}-row", "settings": {"index": index}, "fits_floor": False, "observations": []}
        zoo._write(tmp_path / f"{part}.json", [{**row, "trace": {"events": [["input", index]]}}], meta)
        assert "trace" not in json.loads((tmp_path / f"{part}.json").read_text())["rows"][0]  # moved beside the part
    out = tmp_path / "merged.json"
    assert zoo.main(["--merge", str(tmp_path / "p2.json"), str(tmp_path / "p1.json"), "--out", str(out)]) == 0
    assert [r["config"] for r in json.loads(out.read_text())["rows"]] == ["00-row", "01-row"]
    traces = json.loads((tmp_path / "merged-traces.json").read_text())
    assert traces == {"00-row": {"events": [["input", 0]]}, "01-row": {"events": [["input", 1]]}}


def test_the_plot_draws_planned_steps_and_nothing_where_none_was_planned(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    planned = {"predicted": 9, "peak": 10, "budget": 10}
    measuring = {"predicted": 0, "peak": 5, "budget": 10}
    zoo._plot([{"entry": "callback", "observations": [planned, measuring]}], tmp_path / "zoo.png")
    assert (tmp_path / "zoo.png").stat().st_size > 1000
    zoo._plot([{"entry": "context", "observations": [measuring]}], tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()


def test_an_arm_settles_once_enough_batches_in_a_row_ran_a_kept_plan() -> None:
    record = zoo.ArmRecord()
    record.kinds = ["measuring", "trial", "planned", "planned"]
    assert not record.settled(3) and record.settled(2) and not record.settled(0)
    record.kinds.append("trial")
    assert not record.settled(1)


def test_an_arm_counts_the_flushes_of_its_timed_batches() -> None:
    """The allocator's flush count read at each batch start and as the arm ends (here by hand: no CUDA): the timed
    batches' flushes are the count's rise over them; an arm that ended at an error or read nothing says nothing."""
    record = zoo.ArmRecord()
    record.retries = [0, 0, 3, 3, 4, 6]  # five batches: the second flushed 3 times, the fourth once, the last twice
    assert record.flushes(3) == 3 and record.flushes(5) == 6 and record.flushes(1) == 2
    assert record.flushes(6) is None and zoo.ArmRecord().flushes(1) is None
    record.oom = {"step": 5}
    assert record.flushes(3) is None


@pytest.mark.parametrize(("pace_s", "timed"), [(0.5, 4), (0.075, 4), (0.05, 6), (0.01, 16), (0.001, 16)])
def test_short_batches_are_timed_by_more_of_them(pace_s: float, timed: int) -> None:
    """An arm times about 0.3 s of batches, 4 at least and 16 at most; an arm that ran out of memory times 4."""
    record = zoo.ArmRecord()
    record.times = [1.0, pace_s, pace_s, pace_s, pace_s]
    assert record.timed_batches() == timed
    record.oom = {"kind": "measuring"}
    assert record.timed_batches() == 4


@pytest.mark.parametrize("entry", ["context", "fabric", "callback"])
def test_the_planned_arm_ends_early_once_settled(entry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry point stops after ``settle`` planned batches (nothing is planned on the CPU: the batch kind is
    faked), and runs all its batches without ``settle``."""
    import torch

    config = next(c for c in zoo.generate(2026, 42, tiny=True) if c["entry"] == entry)
    config = {**config, "accumulate": 1, "fits": 1, "sanity": False, "val_every": 0}
    monkeypatch.setattr(zoo, "_kind", lambda planner: "planned")
    runner = zoo.RUNNERS[entry]
    assert len(runner(config, "none", 7, None, torch.device("cpu"), settle=3).kinds) == 3
    assert len(runner(config, "none", 7, None, torch.device("cpu")).kinds) == 7


def test_the_floor_counts_as_said_by_every_message_that_says_so_before_a_step() -> None:
    from lightning_offload.planner import words

    gib = 1 << 30
    assert zoo.said_floor_over(words.resting_floor_over(gib, gib, gib, 2 * gib, ("AdamW",)))
    assert zoo.said_floor_over(words.budget_taken(gib, 2 * gib))
    assert zoo.said_floor_over(words.frugal_step_passes(gib, 2 * gib, gib, gib, gib, gib))
    assert not zoo.said_floor_over(words.base_grew(gib, gib))


def test_a_plan_said_to_fit_that_ran_out_of_memory_is_the_planners_miss() -> None:
    """The plan of the step that raised is read from the planner's trace: said to fit, its failure counts against the
    planner, whatever the plans after the correction were said to do."""
    fitted = {"events": [["begin", {}, {"phase": "trying", "plan": {"fits": True}}], ["observe", {"raised": True}]]}
    frugal = {"events": [["begin", {}, {"phase": "planned", "plan": {"fits": False}}], ["observe", {"raised": True}]]}
    measuring = {"events": [["begin", {}, {"phase": "measuring", "measure": {}}]]}
    assert zoo.failed_plan_fitted(fitted)
    assert not zoo.failed_plan_fitted(frugal) and not zoo.failed_plan_fitted(measuring)
    assert not zoo.failed_plan_fitted(None) and not zoo.failed_plan_fitted({"events": []})


def test_an_out_of_memory_error_raised_outside_the_engine_is_told_to_it() -> None:
    """Backward or the optimizer's step ran out of memory outside the engine's context: the arm records it, and the
    engine is told as a user's loop would tell it (its planner's trace then holds the failed step)."""
    import torch

    told: list[BaseException] = []

    class Unplanned:  # an engine without `failed` (a model that is not planned): left alone
        def close(self) -> None:
            pass

    class Engine(Unplanned):
        def failed(self, exc: BaseException) -> None:
            told.append(exc)
            # What the planner says after the failure is not heard: the row counts what it said before the step.
            assert logging.getLogger("lightning_offload").disabled

    record = zoo.ArmRecord()
    record.kinds = ["measuring", "trial"]
    phase = zoo._Phase(torch.device("cpu"), track_peak=False)
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 132.00 MiB.")
    with zoo._arm_running(record, phase, lambda: None, lambda: None, Engine()):
        raise error
    assert told == [error] and not logging.getLogger("lightning_offload").disabled
    assert record.oom is not None and record.oom["step"] == 1 and record.oom["kind"] == "trial"
    assert record.allocator == []  # no CUDA here: nothing read
    with zoo._arm_running(zoo.ArmRecord(), phase, lambda: None, lambda: None, Unplanned()):
        raise error
    assert told == [error]


def test_an_out_of_memory_error_keeps_the_figures_cuda_states_at_the_failure() -> None:
    """The allocator read after the exception unwound holds the failed step's freed tensors as unallocated; CUDA's
    message states the figures at the failed allocation (row 31 of the H200 zoo at `c985b31`)."""
    message = (
        "CUDA out of memory. Tried to allocate 132.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "136.96 GiB is free. Including non-PyTorch memory, this process has 2.83 GiB memory in use. 2.13 GiB "
        "allowed; Of the allocated memory 1.89 GiB is allocated by PyTorch, and 139.72 MiB is reserved by PyTorch "
        "but unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    )
    import torch

    def figures(text: str) -> dict[str, float]:
        return zoo.cuda_figures_mib(torch.cuda.OutOfMemoryError(text))

    assert figures(message) == {"requested": 132.0, "allocated": 1935.36, "unallocated": 139.72}
    assert figures("CUDA out of memory. Tried to allocate 2.00 GiB.") == {"requested": 2048.0}
    assert figures("CUDA error: an illegal memory access") == {}


def test_fragments_are_the_free_blocks_of_segments_that_hold_live_ones() -> None:
    mib = 2**20

    def block(address: int, size: int, state: str, where: str) -> dict[str, object]:
        return {
            "address": address,
            "size": size * mib,
            "state": state,
            "frames": [{"filename": where, "line": 1, "name": "f"}],
        }

    held = {
        "segment_type": "large",
        "is_expandable": True,
        "stream": 7,
        "total_size": 60 * mib,
        "blocks": [
            block(0, 20, "active_allocated", "/x/adamw.py"),
            block(20 * mib, 18, "inactive", "/x/free.py"),
            block(38 * mib, 2, "inactive", "/x/free.py"),
            block(40 * mib, 20, "active_allocated", "/x/model.py"),
        ],
    }
    empty = {
        "segment_type": "small",
        "is_expandable": False,
        "total_size": 2 * mib,
        "blocks": [block(0, 2, "inactive", "/x/a.py")],
    }
    summary = zoo.fragments({"segments": [held, empty]})
    assert summary["reserved"] == 62 and summary["allocated"] == 40
    # The small segment is wholly free (a flush returns it): only the 20 MiB between live blocks count.
    assert summary["free_beside_live"] == 20 and summary["largest_free"] == 18
    assert summary["kinds"] == {"large-expandable": 1, "small-fixed": 1}
    (worst,) = summary["worst"]
    assert worst["stream"] == 7 and worst["free_blocks"] == 2
    assert worst["beside_largest"] == ["adamw.py:1:f", "free.py:1:f"]
    assert [site for site, _ in worst["live_sites"]] == ["adamw.py:1:f", "model.py:1:f"]
