"""Trains a model under a budget, drops it, then plans a second one under a budget in the same process (its cache
left behind); prints what the second-model test in ``tests/test_gpu_engine.py`` checks, as JSON on the last line."""

from __future__ import annotations

import json

from tests import test_gpu_engine


def main() -> None:
    print(json.dumps(test_gpu_engine.second_model_under_budget()))


if __name__ == "__main__":
    main()
