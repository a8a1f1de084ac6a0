"""Offloads everything for a few steps in a process of its own (a fresh allocator); prints what
``test_offloading_everything_reserves_at_most_1_10x_what_it_allocates`` checks, as JSON on the last line."""

from __future__ import annotations

import json

from tests import test_gpu_engine


def main() -> None:
    print(json.dumps(test_gpu_engine.reserved_when_offloading()))


if __name__ == "__main__":
    main()
