"""Trains a model whose budget only checkpointing by parts meets, under a hard cap, in a process of its own; prints
what ``test_a_budget_only_checkpointing_by_parts_meets_trains_under_a_hard_cap`` checks, as JSON on the last line."""

from __future__ import annotations

import json
import os

import torch

from tests import test_gpu_engine


def main() -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # The deterministic kernels the GPU tests compare gradients with (see test_gpu_engine's fixture).
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    print(json.dumps(test_gpu_engine.train_by_parts_under_a_cap()))


if __name__ == "__main__":
    main()
