"""Trains a few steps under a user's budget in a process of its own (a fresh allocator, fixed segments cached first);
prints what ``test_a_users_budget_trains_in_expandable_segments_from_its_first_step`` checks, as JSON on the last
line."""

from __future__ import annotations

import json

from tests import test_gpu_engine


def main() -> None:
    print(json.dumps(test_gpu_engine.allocations_under_a_users_budget()))


if __name__ == "__main__":
    main()
