"""Runs a planned step that CUDA fails mid-backward through ``run_step`` in a process of its own (no other test's
memory shapes the plans); prints what the test of ``run_step`` in ``tests/test_gpu_engine.py`` checks, as JSON on the
last line."""

from __future__ import annotations

import json

from tests import test_gpu_engine


def main() -> None:
    print(json.dumps(test_gpu_engine.rerun_after_cuda_oom()))


if __name__ == "__main__":
    main()
