"""The engine and the callback under two-process CPU FSDP2 (``fully_shard``, DTensor parameters, gloo).

``tests/fsdp2_script.py`` runs once under torchrun (``--standalone``, two processes): a plain torch loop without
offloading, with ``offload_activations`` in ``sync`` and in ``streamed`` mode, and Lightning's
``ModelParallelStrategy`` without and with ``ActivationOffloadCallback``, all from the same seed, plus a census of
what one forward saves. About 10 s on two cores.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import processes
from tests.fsdp2_script import STEPS, TOKENS, WORLD

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("fsdp2_script.py")
TIMEOUT_S = 180
ENGINE_RUNS = ("sync", "streamed", "pl_offload")
# Variables of an enclosing launcher that torchrun would otherwise inherit.
LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "GLOBAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


class Out:
    """The files the script wrote, by run name and rank."""

    def __init__(self, path: Path, returncode: int, log: str) -> None:
        self.path, self.returncode, self.log = path, returncode, log

    def _file(self, name: str) -> Path:
        file = self.path / name
        assert file.exists(), f"no {name} (exit status {self.returncode}); script output:\n{self.log}"
        return file

    def record(self, run: str, rank: int) -> dict[str, Any]:
        return json.loads(self._file(f"{run}_rank{rank}.json").read_text())

    def params(self, run: str, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(self._file(f"{run}_params_rank{rank}.pt"), weights_only=True)


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Out:
    path = tmp_path_factory.mktemp("fsdp2")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    proc = processes.start([*command, str(SCRIPT), str(path)], env)
    log, in_time = processes.finish(proc, TIMEOUT_S)
    if not in_time:
        pytest.fail(f"no result within {TIMEOUT_S} s; output:\n{log[-6000:]}", pytrace=False)
    # A run that crashes (a segfault, say) still leaves the files of the runs before it for the other tests.
    return Out(path, proc.returncode, log[-6000:])


def test_script_exits_cleanly(out: Out) -> None:
    assert out.returncode == 0, f"exit status {out.returncode}; output:\n{out.log}"


@pytest.mark.parametrize("run", ENGINE_RUNS)
def test_parameters_are_bit_equal_to_training_without_offloading(out: Out, run: str) -> None:
    reference = "pl_baseline" if run.startswith("pl_") else "baseline"
    shards = []
    for rank in range(WORLD):
        expected, got = out.params(reference, rank), out.params(run, rank)
        assert expected.keys() == got.keys()
        different = [name for name in expected if not torch.equal(expected[name], got[name])]
        assert not different, f"rank {rank}: {run} differs from {reference} after {STEPS} steps in {different}"
        # Training moved every parameter away from the seeded start.
        initial = out.params("initial", rank)
        assert not [name for name in got if torch.equal(initial[name], got[name])], f"rank {rank}"
        shards.append(got)
    # Each rank holds its own half of every weight (FSDP2 shards dim 0), not a replica.
    weight = "blocks.0.fc1.weight"
    assert shards[0][weight].shape == shards[1][weight].shape
    assert not torch.equal(shards[0][weight], shards[1][weight])


def test_lightning_model_parallel_trains_like_the_plain_loop(out: Out) -> None:
    for rank in range(WORLD):
        plain, lightning = out.params("baseline", rank), out.params("pl_baseline", rank)
        assert all(torch.equal(plain[name], lightning[name]) for name in plain), f"rank {rank}"


@pytest.mark.parametrize("run", ENGINE_RUNS)
def test_every_step_offloads_exactly_the_activations(out: Out, run: str) -> None:
    """The census splits what one forward saves by storage; the engine must copy the activations' bytes, no more.

    Were the all-gathered weights (or their transposes, which the linear layers save) offloaded, every step would
    copy ``param_bytes_saved`` more.
    """
    for rank in range(WORLD):
        census = out.record("census", rank)
        assert census["param_types"] == ["Parameter"]  # the pre-hooks saw unsharded parameters, not DTensors
        assert census["param_storages_saved"] > 0 and census["param_bytes_saved"] > 0
        assert census["activation_bytes"] > 0
        offloaded = out.record(run, rank)["offloaded_bytes"]
        assert offloaded == [census["activation_bytes"]] * STEPS, f"rank {rank}: census {census}"
    # The ranks see different sequence lengths, so each offloads its own activations.
    assert TOKENS[0] != TOKENS[1]
    assert out.record("census", 0)["activation_bytes"] != out.record("census", 1)["activation_bytes"]


@pytest.mark.parametrize("run", ENGINE_RUNS)
def test_unsharded_parameters_are_saved_but_never_offloaded(out: Out, run: str) -> None:
    for rank in range(WORLD):
        watch = out.record(run, rank)["watch"]
        census = out.record("census", rank)
        # The policy was asked about every saved tensor of every step: the weights FSDP2 gathered among them.
        assert watch["param_saves"] == census["param_tensors_saved"] * STEPS, f"rank {rank}: {watch}"
        assert watch["param_offloaded"] == 0, f"rank {rank}: unsharded parameters were offloaded: {watch}"
        assert watch["activation_saves"] == watch["activation_offloaded"] > 0, f"rank {rank}: {watch}"


def test_runs_without_the_engine_install_no_hooks(out: Out) -> None:
    for run in ("baseline", "pl_baseline"):
        for rank in range(WORLD):
            watch = out.record(run, rank)["watch"]
            assert watch["param_saves"] == watch["activation_saves"] == 0, f"{run} rank {rank}: {watch}"


def test_the_ranks_ran_in_separate_processes(out: Out) -> None:
    for run in ("baseline", *ENGINE_RUNS):
        records = [out.record(run, rank) for rank in range(WORLD)]
        assert [r["rank"] for r in records] == list(range(WORLD))
        assert len({r["pid"] for r in records}) == WORLD
