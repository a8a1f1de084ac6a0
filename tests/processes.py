"""Child process groups for the multi-process tests: started in a session of their own, so a hung run is killed with
every process it started (a launcher and its ranks), and only those."""

from __future__ import annotations

import os
import signal
import subprocess
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
