"""Runs one function of ``tests.test_gpu_engine`` in a process of its own (a fresh allocator: nothing another test left
allocated or cached) and prints what it returns, as JSON on the last line, for the test that started it:
``python -m tests.gpu.fresh_process NAME``."""

from __future__ import annotations

import json
import sys

from tests import test_gpu_engine


def main() -> None:
    print(json.dumps(getattr(test_gpu_engine, sys.argv[1])()))


if __name__ == "__main__":
    main()
