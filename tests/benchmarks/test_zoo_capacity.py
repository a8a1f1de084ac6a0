"""The capacity search on the zoo's rig: bisection finds the longest length that trains, with each probe kept; bad
arguments are refused by name; ``--tiny`` runs every arm on the CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import zoo, zoo_capacity
from tests.processes import run_on_cpu


@pytest.mark.parametrize(("limit", "expected_probes"), [(0, 6), (2048, 6), (20480, 6), (22528, 6), (65536, 1)])
def test_bisection_finds_the_longest_length_that_trains(
    monkeypatch: pytest.MonkeyPatch, limit: int, expected_probes: int
) -> None:
    """A fake child that trains up to ``limit`` tokens: the search returns ``limit`` (a multiple of the step), probes
    the longest length first and then bisects, and keeps every probe sorted by length."""
    probed: list[int] = []

    def fake(config: dict[str, Any], steps: int, tiny: bool, timeout_s: float, run: Any = None) -> dict[str, Any]:
        probed.append(config["seq"])
        assert steps == 8 and not tiny and config["batch"] == 1 and config["hidden"] == 2048
        return {"seq": config["seq"], "trained": config["seq"] <= limit}

    monkeypatch.setattr(zoo, "run_isolated", fake)
    found = zoo_capacity.search("llama1b", "planned", 40 << 30, 2048, 65536, 8, 60.0, tiny=False)
    assert found["longest_seq"] == limit
    assert probed[0] == 65536 and len(probed) == expected_probes
    assert [p["seq"] for p in found["probes"]] == sorted(probed)


def test_a_probe_that_died_counts_as_not_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child that timed out or died returns no ``trained``: it counts as a failure, and the probe keeps its error."""

    def died(config: dict[str, Any], *_: Any, **__: Any) -> dict[str, Any]:
        return {"config": config["name"], "error": "timed out or died"}

    monkeypatch.setattr(zoo, "run_isolated", died)
    found = zoo_capacity.search("llama1b", "ac", 40 << 30, 2048, 8192, 8, 60.0, tiny=False)
    assert found["longest_seq"] == 0
    assert all(p["trained"] is False and p["error"] == "timed out or died" for p in found["probes"])
    assert [p["seq"] for p in found["probes"]] == [2048, 4096, 8192]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arms", "planned,warp"], "--arms 'planned,warp': expected a comma-separated list of planned, ac"),
        (["--model", "gpt5"], "--model 'gpt5': expected one of llama1b, smallvocab-h1024"),
        (["--seq-step", "4096", "--max-seq", "2048"], "--seq-step 4096 --max-seq 2048"),
    ],
)
def test_bad_arguments_are_refused_by_name(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        zoo_capacity.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_config_of_an_unknown_model_names_the_argument() -> None:
    with pytest.raises(ValueError, match="--model 'x': expected one of llama1b, smallvocab-h1024"):
        zoo_capacity.config_of("x", 2048)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
def test_the_tiny_capacity_search_runs_every_arm(tmp_path: Path) -> None:
    """On the CPU nothing is capped: every arm trains at the longest tiny length, found with one probe each."""
    out = tmp_path / "capacity.json"
    done = run_on_cpu("benchmarks.zoo_capacity", "--tiny", "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["arms"]) == list(zoo_capacity.ARMS)
    for found in result["arms"].values():
        assert found["longest_seq"] == 64
        (only,) = found["probes"]
        assert only["trained"] is True and only["seq"] == 64 and only["kinds"]
    assert result["arms"]["planned"]["probes"][0]["arm"] == "planned"
    table = out.with_suffix(".md").read_text()
    assert table.startswith("# Capacity: llama1b at batch 1 without a cap (the rig on the CPU)")
    assert table.count("\n| ") == 1 + len(zoo_capacity.ARMS)  # the header and a row per arm
