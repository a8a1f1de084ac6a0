"""Offloads everything for a few steps in a process of its own (a fresh allocator); prints what
``test_spans_freed_in_backward_are_reused_at_once`` checks, as JSON on the last line."""

from __future__ import annotations

import json

from tests import test_gpu_engine


def main() -> None:
    print(json.dumps(test_gpu_engine.reserved_when_offloading()))


if __name__ == "__main__":
    main()
