"""Child process groups for the multi-process tests: started in a session of their own, so a hung run is killed with
every process it started (a launcher and its ranks), and only those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """Start ``command`` from the repository root in a new session, output and errors in one pipe."""
    return subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[str, bool]:
    """Wait for ``proc``; returns its output and whether it finished in time (if not, its group was killed)."""
    try:
        return proc.communicate(timeout=timeout)[0], True
    except subprocess.TimeoutExpired:
        kill(proc)
        return proc.communicate()[0], False


def kill(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc``'s whole session, if it still runs."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_on_cpu(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args...`` from the repository root with ``DEVICE=cpu`` (a benchmark's loop on the CPU),
    its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "DEVICE": "cpu"},
    )
