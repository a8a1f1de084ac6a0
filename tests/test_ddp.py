"""``ActivationOffloadCallback`` under two-process CPU DDP (gloo), with ``strategy="ddp"`` and ``"ddp_spawn"``.

Each strategy runs ``tests/ddp_script.py`` once in a subprocess (``ddp`` re-launches its script for rank 1, which
does not work from inside pytest; ``ddp_spawn`` pickles the callback into spawned workers). The script trains a tiny
per-token MLP for three SGD steps without and then with the callback, in the same processes and seeded alike, and
writes each rank's parameters, what each rank offloaded and its host pool, and rank zero's CSV log. The two ranks
see different sequence lengths, so they offload different amounts. Both runs start together and take about 35 s
on two cores, most of it importing Lightning in the seven processes they start.
"""

from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_offload import offload_activations, release_host_memory
from lightning_offload.host_pool import pool_for
from lightning_offload.metrics import HOST_PINNED, OFFLOADED
from lightning_offload.options import GiB
from tests import processes
from tests.ddp_script import BATCH, OFFLOAD_OPTIONS, STEPS, WORLD, TokenData, TokenMLP

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("ddp_script.py")
STRATEGIES = ("ddp", "ddp_spawn")
TIMEOUT_S = 150
STEP_KEYS = ("offload/offloaded_gib", "offload/host_pinned_gib")
CPU = torch.device("cpu")
# Variables of an enclosing launcher that would stop Lightning from starting its own processes, or skew them.
LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "GLOBAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


@dataclass
class Run:
    """The files one strategy's script run wrote."""

    out: Path
    log: str

    def record(self, tag: str, rank: int) -> dict[str, Any]:
        path = self.out / f"{tag}_rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no {path.name}; script output:\n{self.log}"
        return json.loads(path.read_text())

    def params(self, tag: str, rank: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"{tag}_params_rank{rank}.pt", weights_only=True)

    def csv_rows(self) -> list[dict[str, str]]:
        with open(self.out / "logs" / "offload" / "version_0" / "metrics.csv", newline="") as handle:
            return list(csv.DictReader(handle))


def _free_ports(n: int) -> list[int]:
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def _tail(text: str, limit: int = 6000) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def _start(strategy: str, out: Path, port: int, base_env: dict[str, str]) -> subprocess.Popen[str]:
    env = {**base_env, "MASTER_PORT": str(port)}
    return processes.start([sys.executable, str(SCRIPT), str(out), strategy], env)


def _outcome(strategy: str, proc: subprocess.Popen[str], out: Path) -> Run | str:
    """The run's files, or why it failed."""
    log, in_time = processes.finish(proc, TIMEOUT_S)
    if not in_time:
        return f"strategy={strategy!r}: no result within {TIMEOUT_S} s; output:\n{_tail(log)}"
    if proc.returncode != 0:
        return f"strategy={strategy!r}: exit status {proc.returncode}; output:\n{_tail(log)}"
    return Run(out, _tail(log))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    """Runs the script once per strategy, both at once; fails with the script's output if either fails.

    A worker that aborted as its process exited, after both fits ended (``terminate called without an active
    exception``: a C++ thread of torch's left joinable at exit; seen once in CI on ``ddp_spawn``, and not in eight
    runs after), is run once more, alone: a second failure fails the tests."""
    base_env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    base_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    base_env["MASTER_ADDR"] = "127.0.0.1"
    started: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    for strategy, port in zip(STRATEGIES, _free_ports(len(STRATEGIES)), strict=True):
        out = tmp_path_factory.mktemp(strategy)
        started[strategy] = (_start(strategy, out, port, base_env), out)
    results: dict[str, Run] = {}
    failures: list[str] = []
    try:
        for strategy, (proc, out) in started.items():
            outcome = _outcome(strategy, proc, out)
            if isinstance(outcome, str) and "terminate called without an active exception" in outcome:
                out = tmp_path_factory.mktemp(f"{strategy}-again")
                proc = _start(strategy, out, _free_ports(1)[0], base_env)
                started[strategy] = (proc, out)
                outcome = _outcome(strategy, proc, out)
            if isinstance(outcome, str):
                failures.append(outcome)
            else:
                results[strategy] = outcome
    finally:
        for proc, _ in started.values():
            processes.kill(proc)
    if failures:
        pytest.fail("\n\n".join(failures), pytrace=False)
    yield results


@pytest.fixture(params=STRATEGIES)
def run(request: pytest.FixtureRequest, runs: dict[str, Run]) -> Run:
    return runs[request.param]


def rank_batch(rank: int, step: int = 0) -> torch.Tensor:
    """The batch rank ``rank`` trains on at ``step``: the unshuffled ``DistributedSampler`` deals items in turn."""
    data = TokenData()
    return torch.stack([data[rank + WORLD * (step * BATCH + j)] for j in range(BATCH)])


def single_process_reference(rank: int) -> tuple[int, int]:
    """Bytes one training step on ``rank``'s batch offloads, and the host pool it needs, in this process alone."""
    release_host_memory()
    pool = pool_for(CPU)
    before = pool.reserved_bytes
    torch.manual_seed(0)
    model = TokenMLP()
    engine = offload_activations(**OFFLOAD_OPTIONS, model=model)
    with engine:
        loss = model.training_step(rank_batch(rank), 0)
    loss.backward()
    offloaded = engine.stats.offloaded_bytes
    return offloaded, pool.reserved_bytes - before


def test_parameters_equal_a_run_without_the_callback(run: Run) -> None:
    baseline = run.params("baseline", 0)
    offload = run.params("offload", 0)
    assert baseline.keys() == offload.keys()
    different = [name for name in baseline if not torch.equal(baseline[name], offload[name])]
    assert not different, f"parameters differ from the run without the callback after {STEPS} steps: {different}"
    # DDP kept the replicas identical, and training really moved the parameters away from their seeded start.
    replica = run.params("offload", 1)
    assert all(torch.equal(offload[name], replica[name]) for name in offload)
    torch.manual_seed(0)
    initial = dict(TokenMLP().named_parameters())
    assert not any(torch.equal(initial[name].detach(), offload[name]) for name in offload)
    for tag in ("baseline", "offload"):
        for rank in range(WORLD):
            record = run.record(tag, rank)
            assert (record["rank"], record["world_size"], record["global_step"]) == (rank, WORLD, STEPS)


def test_every_rank_offloads_its_own_activations(run: Run) -> None:
    records = [run.record("offload", rank) for rank in range(WORLD)]
    assert len({record["pid"] for record in records}) == WORLD, "the ranks did not run in separate processes"
    for rank, record in enumerate(records):
        offloaded = record["offloaded_bytes"]
        assert len(offloaded) == STEPS
        assert all(value > 0 for value in offloaded), f"rank {rank} offloaded nothing: {offloaded}"
        # Each rank offloads exactly what one process offloads on that rank's batch: its own activations.
        expected, _ = single_process_reference(rank)
        assert offloaded == [expected] * STEPS, f"rank {rank}"
    assert records[1]["offloaded_bytes"][0] > records[0]["offloaded_bytes"][0]  # longer sequences on rank 1


def test_metrics_are_logged_by_rank_zero_only(run: Run) -> None:
    files = sorted(path.relative_to(run.out) for path in run.out.rglob("*.csv"))
    assert files == [Path("logs/offload/version_0/metrics.csv")]
    rows = run.csv_rows()
    assert set(rows[0]) >= {*STEP_KEYS, OFFLOADED, HOST_PINNED, "step"}
    for key in (*STEP_KEYS, OFFLOADED, HOST_PINNED):
        steps = [int(row["step"]) for row in rows if row[key]]
        assert len(steps) == len(set(steps)), f"{key} logged twice for a step: {steps}"
    step_rows = [row for row in rows if row["offload/offloaded_gib"]]
    assert [int(row["step"]) for row in step_rows] == list(range(STEPS))
    # The per-step values are rank zero's, not rank one's (the ranks offload different amounts).
    rank0 = run.record("offload", 0)
    logged = [float(row["offload/offloaded_gib"]) for row in step_rows]
    assert logged == pytest.approx([b / GiB for b in rank0["offloaded_bytes"]], rel=1e-6)
    pinned = [float(row["offload/host_pinned_gib"]) for row in step_rows]
    assert pinned == pytest.approx([b / GiB for b in rank0["pool_reserved_bytes"]], rel=1e-6)
    assert [row for row in rows if row[OFFLOADED]] == [row for row in rows if row[HOST_PINNED]]
    assert len([row for row in rows if row[OFFLOADED]]) == 1  # one epoch, one summary row


def test_epoch_summary_is_reduced_over_both_ranks(run: Run) -> None:
    records = [run.record("offload", rank) for rank in range(WORLD)]
    (summary,) = [row for row in run.csv_rows() if row[OFFLOADED]]
    all_steps = [b / GiB for record in records for b in record["offloaded_bytes"]]
    rank0_mean = sum(records[0]["offloaded_bytes"]) / STEPS / GiB
    expected = sum(all_steps) / len(all_steps)
    assert expected != pytest.approx(rank0_mean, rel=0.1)  # the check below can tell the two apart
    assert float(summary[OFFLOADED]) == pytest.approx(expected, rel=1e-5), (
        f"logged {summary[OFFLOADED]}: rank 0's mean alone is {rank0_mean}, both ranks' mean is {expected}"
    )
    # The max too is taken over both ranks (rank 1's pool is the larger), and every rank computed the same values.
    largest_pool = max(b for record in records for b in record["pool_reserved_bytes"])
    assert float(summary[HOST_PINNED]) == pytest.approx(largest_pool / GiB, rel=1e-5)
    assert largest_pool > max(records[0]["pool_reserved_bytes"])
    assert [record["epoch_offloaded_gib"] for record in records] == pytest.approx([expected] * WORLD, rel=1e-5)


def test_every_rank_has_its_own_host_pool(run: Run) -> None:
    pools = []
    for rank in range(WORLD):
        record = run.record("offload", rank)
        assert record["pool_reserved_at_start"] == 0
        # The pool holds what this rank's own activations need (one process on the same batch), not the other's.
        _, expected = single_process_reference(rank)
        assert record["pool_reserved_bytes"] == [expected] * STEPS, f"rank {rank}"
        assert record["host_pinned_bytes"] == record["pool_reserved_bytes"], f"rank {rank}"
        pools.append(expected)
    assert pools[0] != pools[1]


def test_default_host_limit_is_split_between_the_ranks(run: Run) -> None:
    """``host_memory_limit=None``: 80% of the RAM available at first use, divided by the processes on this host.

    (torchrun exports ``LOCAL_WORLD_SIZE``; Lightning's own ``ddp`` and ``ddp_spawn`` launchers do not, so the
    record's ``env`` shows what the rank could see.)
    """
    for rank in range(WORLD):
        record = run.record("offload", rank)
        share = record["available_at_start"] * 0.8 / WORLD
        expected = record["pool_reserved_at_start"] + share
        assert record["host_limit"] == pytest.approx(expected, rel=0.05), (
            f"rank {rank}: engine.host_limit() = {record['host_limit'] / GiB:.2f} GiB, expected about "
            f"{expected / GiB:.2f} GiB (available {record['available_at_start'] / GiB:.2f} GiB * 0.8 / {WORLD} "
            f"processes); the rank's environment: {record['env']}"
        )
