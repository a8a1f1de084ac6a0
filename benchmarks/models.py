"""The benchmark's models: random-init Llama (transformers) or, where transformers is absent, the repo's demo model.

Both are wrapped in :class:`BenchModel`, which gives the runners one interface: the loss of a batch of token ids,
and activation checkpointing of every decoder layer switched on and off. LoRA uses peft where it is installed and
otherwise a minimal adapter defined here (rank-16 update of every linear layer but the LM head, base frozen), so
the CPU pipeline runs after ``pip install -e ".[test]"`` alone; the result records which one ran.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.workloads import Workload
from lightning_offload.checkpointing import apply_checkpointing, remove_checkpointing

_DEMO_MODEL = Path(__file__).resolve().parents[1] / "examples" / "demo_model.py"
LORA_RANK = 16
LORA_ALPHA = 32


def have(*packages: str) -> bool:
    """Whether every one of ``packages`` can be imported (without importing it)."""
    return all(importlib.util.find_spec(name) is not None for name in packages)


def backend() -> str:
    """``"transformers"`` when it is installed, else ``"demo"`` (``examples/demo_model.py``)."""
    return "transformers" if have("transformers") else "demo"


@dataclass
class BenchModel:
    """A model ready to train, with the switches the benchmark needs.

    Attributes:
        module: what is trained (peft-wrapped for LoRA workloads) and what the engine gets as ``model``.
        impl: ``"transformers"`` (``LlamaForCausalLM``) or ``"demo"`` (``DecoderOnlyTransformer``).
        lora: ``None`` (full fine-tuning), ``"peft"`` or ``"bench"`` (the adapter of this module).
        hf_base: the ``LlamaForCausalLM`` under the wrappers (transformers only): its gradient-checkpointing
            switches are the ``ac`` baseline.
    """

    module: nn.Module
    impl: str
    lora: str | None
    hf_base: Any = None
    _ac_on: bool = field(default=False, repr=False)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of ``ids`` (batch x seq), as the model's own loss computes it."""
        if self.impl == "transformers":
            return self.module(input_ids=ids, labels=ids, use_cache=False).loss
        logits = self.module(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def enable_ac(self) -> None:
        """Non-reentrant checkpointing of every decoder layer: HF's own switch, or ours on the demo model."""
        if self.impl == "transformers":
            self.hf_base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            apply_checkpointing(self.module, "auto")
        self._ac_on = True

    def disable_ac(self) -> None:
        if not self._ac_on:
            return
        if self.impl == "transformers":
            self.hf_base.gradient_checkpointing_disable()
        else:
            remove_checkpointing(self.module)
        self._ac_on = False

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def timed_step(self, context: Any, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> float:
        """One training step on ``ids`` with its forward under ``context`` (an engine, or a no-op); wall seconds from
        an idle device to an idle device. Its own frame: after an out-of-memory error, the activations it held go
        away with the exception's traceback."""
        cuda = ids.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(ids.device)
        start = time.perf_counter()
        with context:
            loss = self.loss(ids)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(ids.device)
        return time.perf_counter() - start


def build(workload: Workload, device: torch.device, max_seq: int | None = None) -> BenchModel:
    """Random-init model of ``workload``'s shape in bf16 on ``device``; LoRA-wrapped when the workload says so.

    Args:
        workload: the shape and the training (full fine-tuning or LoRA).
        device: where the weights live.
        max_seq: the longest sequence the model will see (default: the workload's); the demo model's position
            embedding is sized by it.
    """
    max_seq = max(max_seq or workload.seq, workload.seq)
    impl = backend()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # allocate (and initialise) in bf16 directly: no fp32 copy of 8B
    try:
        with torch.device(device):
            module = _llama(workload, max_seq) if impl == "transformers" else _demo(workload, max_seq)
    finally:
        torch.set_default_dtype(previous)
    lora = None
    if workload.lora:
        if have("peft") and impl == "transformers":
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules="all-linear")
            module, lora = get_peft_model(module, config), "peft"
        else:
            add_lora(module, exclude=_head_name(impl))
            lora = "bench"
    module.train()
    hf_base = module.get_base_model() if lora == "peft" else module if impl == "transformers" else None
    return BenchModel(module=module, impl=impl, lora=lora, hf_base=hf_base)


def _llama(workload: Workload, max_seq: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=workload.hidden,
        num_hidden_layers=workload.layers,
        intermediate_size=workload.intermediate,
        num_attention_heads=workload.heads,
        num_key_value_heads=workload.kv_heads,
        vocab_size=workload.vocab,
        tie_word_embeddings=workload.tied,
        max_position_embeddings=max(max_seq, 2048),
        rope_theta=500000.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def _demo(workload: Workload, max_seq: int) -> nn.Module:
    """``examples/demo_model.py``'s ``DecoderOnlyTransformer``, loaded from its file (``examples`` is no package)."""
    spec = importlib.util.spec_from_file_location("benchmarks._demo_model", _DEMO_MODEL)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {_DEMO_MODEL}")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    # GPT-shaped (LayerNorm, GELU MLP of 4 x hidden, learned positions, tied head): hidden, layers, heads and vocab
    # follow the workload; the MLP width and grouped-query attention do not.
    return demo.DecoderOnlyTransformer(workload.vocab, workload.hidden, workload.layers, workload.heads, max_seq + 1)


def _head_name(impl: str) -> str:
    return "lm_head" if impl == "transformers" else "head"


class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) * B(A(x))`` with ``base`` frozen and the adapters in fp32 (``B`` starts at zero).

    Args:
        base: the linear layer to adapt; its parameters are frozen.
        rank: the adapters' rank.
        alpha: the scaling numerator.
    """

    def __init__(self, base: nn.Linear, rank: int = LORA_RANK, alpha: int = LORA_ALPHA) -> None:
        super().__init__()
        self.base = base
        base.requires_grad_(False)
        device = base.weight.device
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=device, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(x.to(self.lora_a.dtype), self.lora_a), self.lora_b) * self.scale
        return self.base(x) + update.to(x.dtype)


def add_lora(model: nn.Module, exclude: str) -> int:
    """Freeze ``model`` and wrap every ``nn.Linear`` but ``exclude`` (the LM head) in :class:`LoRALinear`.

    Returns:
        The number of layers wrapped.
    """
    model.requires_grad_(False)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] != exclude
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module))
    return len(targets)
