"""The diagnostic tools on the CPU: `benchmarks.diagnose` records every step, `benchmarks.interleaved` times plain and
default steps alike."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import diagnose, interleaved
from lightning_offload.checkpointing import apply_checkpointing
from lightning_offload.policy import backward_running


def test_diagnose_records_each_step_with_its_waits_and_offloaded_bytes(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    args = ["--workload", "small-h512", "--budget-gib", "2", "--steps", "2", "--tiny", "--out", str(out)]
    # Off CUDA the engine says the budget goes unused (no allocator counters to plan by); the run still records.
    unused = (
        pytest.warns(UserWarning, match="memory_budget is not used: the memory-budget planner needs a CUDA device")
        if not torch.cuda.is_available()
        else contextlib.nullcontext()
    )
    with unused:
        assert diagnose.main(args) == 0
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]] == [0, 1]
    for step in result["steps"]:
        assert step["wall_s"] > 0
        assert {"fwd_wait_ms", "bwd_stall_ms", "offloaded_gib", "host_allocations"} <= set(step)
    assert result["budget_gib"] == 2.0 and "oom" not in result


def test_diagnose_runs_a_manual_offload_limit_with_plain_steps_alternating_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "d.json"
    args = ["--workload", "small-h512", "--max-offload-gib", "0.5", "--steps", "3", "--plain-steps", "2", "--tiny"]
    assert diagnose.main([*args, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["max_offload_gib"] == 0.5 and result["budget_gib"] is None
    assert [s["step"] for s in result["steps"]] == [0, 1, 2]
    assert "measuring" not in result["steps"][-1]  # no planner without a budget
    assert len(result["plain_steps"]) == 2 and all(p["plain_wall_s"] > 0 for p in result["plain_steps"])


def test_diagnose_takes_a_budget_or_a_manual_limit_not_both(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        diagnose.main(["--workload", "small-h512", "--budget-gib", "2", "--max-offload-gib", "1", "--tiny"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_diagnose_refuses_plain_steps_under_a_budget(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        diagnose.main(["--workload", "small-h512", "--budget-gib", "2", "--plain-steps", "2", "--tiny"])
    assert "--plain-steps: only with --max-offload-gib" in capsys.readouterr().err


def test_interleaved_times_plain_and_default_steps_alike(tmp_path: Path) -> None:
    out = tmp_path / "i.json"
    assert interleaved.main(["--workload", "small-h512", "--pairs", "3", "--tiny", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["rounds"] == 3 and result["plain_ms"] > 0 and result["default_ms"] > 0
    assert result["ratio"] == pytest.approx(result["default_ms"] / result["plain_ms"])


def test_interleaved_runs_every_kind_of_arm_on_its_own_model_in_turn(tmp_path: Path) -> None:
    out = tmp_path / "i.json"
    arms = "none,ac,ckpt,ckpt+offload-0mib,ckpt+offload-0.01mib"
    argv = ["--arms", arms, "--rounds", "2", "--min-tensor-bytes", "0", "--tiny", "--out", str(out)]
    assert interleaved.main(argv) == 0
    result = json.loads(out.read_text())
    assert list(result["arms"]) == arms.split(",")
    assert all(len(arm["times_ms"]) == 2 for arm in result["arms"].values())
    assert result["ratio_to_none"]["none"] == 1.0 and result["ratio_to_ac"]["ac"] == 1.0
    # The manual arm offloads what its limit allows (the checkpointed blocks' inputs), the others nothing.
    assert 0 < result["arms"]["ckpt+offload-0.01mib"]["offloaded_bytes"] <= 0.01 * 2**20
    assert result["arms"]["ckpt"]["offloaded_bytes"] == result["arms"]["ckpt+offload-0mib"]["offloaded_bytes"] == 0
    # The host time inside the engine's entry points, per step: only for arms with an engine, every hook it ran.
    assert all(result["arms"][name]["engine_host_us"] is None for name in ("none", "ac", "ckpt"))
    for name in ("ckpt+offload-0mib", "ckpt+offload-0.01mib"):
        host = result["arms"][name]["engine_host_us"]
        assert set(host) == {"install", "pack", "unpack", "total"}
        assert all(host[entry] > 0 for entry in ("install", "pack", "unpack"))
        assert host["total"] >= max(host["install"], host["pack"], host["unpack"])


@pytest.mark.parametrize(
    ("arms", "message"),
    [("none,warp", "unknown arm 'warp'"), ("none,none", "names an arm twice"), ("budget-0.9x", "unknown arm")],
)
def test_interleaved_refuses_unknown_or_repeated_arms(
    arms: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        interleaved.main(["--arms", arms, "--tiny"])
    err = capsys.readouterr().err
    assert "--arms" in err and message in err


class _Counter:
    """A peak counter the test drives: ``use(n)`` holds ``n`` GiB for a moment."""

    def __init__(self) -> None:
        self._peak = 0

    def use(self, gib: int) -> None:
        self._peak = max(self._peak, gib << 30)

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = 0


def test_phase_peaks_split_a_step_at_backward_start_first_rebuilt_block_and_backward_end() -> None:
    counter = _Counter()
    model = torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    )
    blocks = list(model)
    # The engine's checkpointing replaces the block's forward: the rebuild in backward runs the original one, which
    # skips the block's own hooks (an H200 run never saw a block-level phase), but calls its parts.
    apply_checkpointing(model, ["1"])
    marks = SimpleNamespace(memory=counter, backward_started=lambda: None, backward_finished=lambda: None)
    planner = SimpleNamespace(memory=counter, marks=marks)
    phases = diagnose._split_phases(planner, blocks)
    # Registered after the phases' own hooks: the rebuilt block's 9 GiB count in the phase it starts.
    blocks[1][0].register_forward_pre_hook(lambda module, args: counter.use(9 if backward_running() else 4))

    planner.memory.reset_peak()
    out = model(torch.randn(2, 4, requires_grad=True))
    counter.use(5)  # the rest of forward, the loss's forward included
    planner.marks.backward_started()  # what the datapath calls at backward's first unpack
    counter.use(7)  # the loss's backward
    assert planner.memory.peak() == 7 << 30
    out.sum().backward()  # the checkpointed block runs again: backward's own phase begins
    planner.marks.backward_finished()
    counter.use(3)  # the optimizer step
    assert planner.memory.peak() == 9 << 30  # the whole step's, as the planner reads it
    assert phases.close() == {"forward": 5.0, "loss_backward": 7.0, "backward": 9.0, "optimizer": 3.0}
    assert planner.memory.peak() == 9 << 30  # until the next step resets it
    planner.memory.reset_peak()
    assert planner.memory.peak() == 0
    phases.remove()
