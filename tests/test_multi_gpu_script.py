"""``tests/gpu/multi_gpu.py`` on the CPU: its ``--dry-run`` (arguments, table, JSON), its row arithmetic, and a tiny
``--cpu`` run of the real thing under torchrun (DDP and FSDP2 over gloo; FSDP needs a GPU), about 15 s.

The script runs in subprocesses: it sets NCCL and allocator variables when imported, which must not leak into the
test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests import processes
from tests.gpu.multi_gpu_report import GiB, Row, dry_rows, finish, table

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
LAUNCHER_ENV = ("LOCAL_RANK", "RANK", "GLOBAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
SCRIPT_ENV = (*MULTICAST_OFF, "PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG")


def _run(args: list[str], launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_ENV, *SCRIPT_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, *(launcher or []), "-m", "tests.gpu.multi_gpu", *args]
    proc = processes.start(command, env)
    out, in_time = processes.finish(proc, TIMEOUT_S)
    if not in_time:
        pytest.fail(f"{command}: no result within {TIMEOUT_S} s; output:\n{out[-6000:]}", pytrace=False)
    return subprocess.CompletedProcess(command, proc.returncode, out, None)


def _rows(path: Path) -> tuple[dict[str, Any], dict[tuple[str, str, str], dict[str, Any]]]:
    data = json.loads(path.read_text())
    return data, {(r["model"], r["strategy"], r["variant"]): r for r in data["rows"]}


def test_dry_run_prints_the_table_and_writes_the_json(tmp_path: Path) -> None:
    out = tmp_path / "dry.json"
    done = _run(["--dry-run", "--out", str(out)])
    assert done.returncode == 0, done.stdout
    data, rows = _rows(out)
    assert data["dry_run"] is True and data["steps"] == 6 and data["warmup"] == 2
    assert data["env"] == {**MULTICAST_OFF, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert len(rows) == 2 * 3 * 5  # models x strategies x variants
    lines = done.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["model", "strategy", "variant"] and len(lines) == 1 + len(rows)
    assert sum("ERROR: RuntimeError: made-up failure" in line for line in lines) == len(rows) // 5
    none, offload = rows[("mlp", "fsdp2", "none")], rows[("mlp", "fsdp2", "offload")]
    assert offload["vs_none"] == round(max(offload["step_ms"]) / max(none["step_ms"]), 3)
    assert offload["exact"] is True and none["exact"] is None


def test_bad_arguments_name_the_allowed_values(tmp_path: Path) -> None:
    done = _run(["--dry-run", "--out", str(tmp_path / "x.json"), "--variants", "none,fast"])
    assert done.returncode == 2
    assert "--variants='none,fast': a comma-separated choice of ['none', 'ac', 'offload'" in done.stdout
    done = _run(["--dry-run", "--out", str(tmp_path / "x.json"), "--steps", "2", "--warmup", "2"])
    assert done.returncode == 2 and "--warmup=2 --steps=2: need 0 <= warmup < steps" in done.stdout


def test_ratios_use_the_slowest_rank_and_exactness_every_rank() -> None:
    rows = [Row("m", "ddp", v) for v in ("none", "ac", "offload", "ac+offload")]
    times = ([10.0, 12.0], [15.0, 14.0], [20.0, 18.0], [30.0, 30.0])
    digests = (["a", "b"], ["a", "b"], ["a", "x"], ["a", "b"])
    for row, step_ms, digest in zip(rows, times, digests, strict=True):
        row.step_ms, row.digests, row.peak_bytes = step_ms, digest, [GiB, 2 * GiB]
    rows.append(Row("m", "ddp", "ckpt+offload", error="ValueError: boom"))
    finish(rows)
    none, ac, offload, both, failed = rows
    assert (none.vs_none, none.vs_ac, none.exact) == (None, 0.8, None)
    assert (ac.vs_none, ac.vs_ac, ac.exact) == (1.25, None, True)
    assert (offload.vs_none, offload.vs_ac, offload.exact) == (1.667, 1.333, False)  # rank 1's parameters differ
    assert (both.vs_none, both.vs_ac, both.exact) == (2.5, 2.0, True)
    assert failed.vs_none is None and failed.exact is None
    text = table(rows)
    assert "1.00/2.00" in text and "ERROR: ValueError: boom" in text and " NO " in text


def test_dry_rows_cover_every_combination() -> None:
    rows = dry_rows(["mlp"], ["ddp", "fsdp"], ["none", "offload"])
    assert [(r.model, r.strategy, r.variant) for r in rows] == [
        ("mlp", "ddp", "none"),
        ("mlp", "ddp", "offload"),
        ("mlp", "fsdp", "none"),
        ("mlp", "fsdp", "offload"),
    ]


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed + gloo")
def test_cpu_run_trains_every_gloo_strategy_bit_exactly(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = _run(["--cpu", "--steps", "3", "--warmup", "1", "--out", str(out)], launcher)
    assert done.returncode == 0, done.stdout[-6000:]
    data, rows = _rows(out)
    assert data["world"] == 2 and data["cpu"] is True
    assert len(rows) == 30
    for (model, strategy, variant), row in rows.items():
        where = f"{model} {strategy} {variant}: {row}"
        if strategy == "fsdp":
            assert row["skipped"] == "Lightning's FSDPStrategy requires a GPU accelerator", where
            continue
        assert row["error"] is None and len(row["step_ms"]) == 2 and len(row["losses"]) == 3, where
        assert row["exact"] is (None if variant == "none" else True), where  # every variant trains bit-identically
        offloads = variant.endswith("offload")
        assert all((b > 0) == offloads for b in row["offloaded_bytes"] + row["pinned_bytes"]), where
        # DDP keeps replicas; FSDP2 gives each rank its own shard.
        assert (row["digests"][0] == row["digests"][1]) == (strategy == "ddp"), where
    for model in ("mlp", "llama(demo)"):
        for strategy in ("ddp", "fsdp2"):
            # Checkpointing the blocks leaves only their inputs to offload.
            full, ckpt = (rows[(model, strategy, v)]["offloaded_bytes"] for v in ("offload", "ckpt+offload"))
            assert all(c < f for c, f in zip(ckpt, full, strict=True)), (model, strategy, full, ckpt)
