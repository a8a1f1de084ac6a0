"""``python -m benchmarks.zoo``: does the memory budget hold on models nobody tuned the planner on?

A seeded generator draws configurations that vary what users vary: the model family (HF Llama, a ViT, a plain
``nn.TransformerEncoder`` language model), vocabulary (256 to 152k, tied or untied), width and depth, MHA or GQA, batch
and sequence, bf16 weights or fp32 weights under bf16 autocast, AdamW or SGD, the loss inside the model or outside,
the entry point (the Lightning callback, ``offload_activations``, ``fabric_offload``) and, for Lightning, sanity
validation, validation every few batches, gradient accumulation and two fits in a row.

Each configuration runs in a fresh process (forked before CUDA is initialised) and in three arms: ``none`` without a
cap (its peak sets the cap), then under a hard cap of 0.5-0.9 of that peak (``set_per_process_memory_fraction``)
``planned`` (``memory_budget`` = the cap) and ``ac`` (HF or torch activation checkpointing of every block, no
offloading). A row says whether the planner's floor fits, how many out-of-memory errors planned or trial steps met,
the step time against ``none`` and ``ac`` (the median of each arm's last 4 batches, or of about 0.3 s of batches where
they are short, up to 16; the planned arm's once one more in a row ran a kept plan: the steps a long fit runs), how
many steps measured or timed plans, and the planner's prediction error per phase.

    python -m benchmarks.zoo --part 1/3 --out benchmarks/out/zoo-1.json   # on a GPU, one part of the zoo
    python -m benchmarks.zoo --merge benchmarks/out/zoo-*.json --out benchmarks/results/zoo/2026-12-03.json
    python -m benchmarks.zoo --tiny                                     # the rig itself, on the CPU (CI)

``--tiny`` draws tiny models and runs every entry point and arm on the CPU without a cap (nothing can be capped or
planned there): it checks the rig, not the budget, and prints ``pipeline OK, N rows ran``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import multiprocessing
import random
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

GiB = float(1 << 30)
FAMILIES = ("llama", "vit", "encoder")
ENTRIES = ("callback", "context", "fabric")
_VOCABS = (256, 1024, 8192, 32000, 50304, 128256, 151936)
_WIDTHS = (512, 768, 1024, 1536, 2048, 3072, 4096)
# What one configuration may cost on an H200: 6 x parameters x tokens (the step's matrix work) and the logits' bytes
# (bf16, their fp32 copy and the log-probabilities), so that a whole zoo runs in minutes and fits uncapped.
_MAX_STEP_FLOP = 1.2e14
_MAX_LOGIT_ELEMENTS = 3.0e9
_MAX_PARAMS = 2.5e9


# ---------------------------------------------------------------------------------------------------- configurations


# Configurations that failed once, kept as rows of every zoo run (drawn ones follow them): a 16-layer Llama of width
# 1024 with a 32000 vocabulary at 8192 tokens ran out of memory under a 6.01 GiB cap through the callback, in its first
# planned step.
_REPRO: dict[str, Any] = {
    "family": "llama",
    "entry": "callback",
    "hidden": 1024,
    "layers": 16,
    "heads": 16,
    "kv_heads": 8,
    "ffn": 2816,
    "vocab": 32000,
    "tied": False,
    "batch": 1,
    "seq": 8192,
    "precision": "bf16",
    "optimizer": "adamw",
    "loss_inside": True,
    "fraction": 0.6,
    "sanity": False,
    "val_every": 0,
    "accumulate": 1,
    "fits": 1,
}
REGRESSIONS: tuple[dict[str, Any], ...] = (_REPRO, {**_REPRO, "entry": "context"})


def generate(seed: int, count: int, tiny: bool = False) -> list[dict[str, Any]]:
    """The regression rows, then ``count`` configurations drawn by a generator seeded with ``seed`` (the same list on
    every machine)."""
    configs = []
    for fixed in REGRESSIONS:
        config = dict(fixed, index=len(configs))
        if tiny:
            config.update(_TINY)
        config["name"] = _name(config["index"], config)
        configs.append(config)
    rng = random.Random(seed)
    while len(configs) < count + len(REGRESSIONS):
        config = _draw(rng, len(configs), tiny)
        if config is not None:
            configs.append(config)
    return configs


_TINY = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "layers": 3, "batch": 2, "seq": 64, "vocab": 512}


def _draw(rng: random.Random, index: int, tiny: bool) -> dict[str, Any] | None:
    # Every family meets every entry point equally often; the rest is drawn.
    family = FAMILIES[index % len(FAMILIES)]
    entry = ENTRIES[(index // len(FAMILIES)) % len(ENTRIES)]
    hidden = rng.choice(_WIDTHS)
    heads = max(4, hidden // 128) if hidden % 128 == 0 else max(4, hidden // 64)
    layers = rng.randint(4, 32)
    gqa = family == "llama" and rng.random() < 0.6 and heads % 4 == 0
    config: dict[str, Any] = {
        "family": family,
        "entry": entry,
        "hidden": hidden,
        "layers": layers,
        "heads": heads,
        "kv_heads": heads // 4 if gqa else heads,
        "ffn": int(rng.choice((2.75, 3.5, 4.0)) * hidden) // 64 * 64,
        "vocab": rng.choice(_VOCABS) if family != "vit" else rng.choice((10, 1000)),
        "tied": family != "vit" and rng.random() < 0.4,
        "batch": rng.choice((1, 1, 2, 4, 8)),
        "seq": rng.choice((1024, 2048, 4096, 8192, 16384, 32768)),
        "precision": rng.choice(("bf16", "bf16", "bf16-mixed")),
        "optimizer": rng.choice(("adamw", "adamw", "sgd")),
        "loss_inside": family != "encoder" and rng.random() < 0.6,
        "fraction": round(rng.uniform(0.5, 0.9), 2),
        "sanity": entry == "callback" and rng.random() < 0.5,
        "val_every": rng.choice((0, 0, 5)) if entry == "callback" else 0,
        "accumulate": rng.choice((1, 1, 4)),
        "fits": 2 if entry == "callback" and rng.random() < 0.3 else 1,
    }
    if family == "vit":
        # Images of side 16 x sqrt(seq) in patches of 16: seq patches (1024-4096), a class token, a small head.
        config["seq"] = rng.choice((1024, 2304, 4096))
        config["batch"] = rng.choice((1, 2, 4))
    if tiny:
        config.update(_TINY, kv_heads=2 if gqa else 4, layers=min(layers, 3) + 1, vocab=min(config["vocab"], 512))
        config["seq"] = 16 if family == "vit" else 64
        if entry == "callback":  # the rig's every Lightning path, in the few rows a CPU run has
            config.update(sanity=True, val_every=2, accumulate=2, fits=2)
    tokens = config["batch"] * config["seq"]
    if not tiny:
        params = _params(config)
        if params > _MAX_PARAMS or 6 * params * tokens > _MAX_STEP_FLOP:
            return None
        if family != "vit" and tokens * config["vocab"] > _MAX_LOGIT_ELEMENTS:
            return None
    config["name"] = _name(index, config)
    config["index"] = index
    return config


def _params(config: dict[str, Any]) -> int:
    h, f, layers = config["hidden"], config["ffn"], config["layers"]
    head_dim = h // config["heads"]
    attention = 2 * h * h + 2 * h * config["kv_heads"] * head_dim
    mlp = (3 if config["family"] == "llama" else 2) * h * f
    embeddings = config["vocab"] * h * (1 if config["tied"] else 2)
    return layers * (attention + mlp) + embeddings


def _name(index: int, config: dict[str, Any]) -> str:
    attention = "gqa" if config["kv_heads"] != config["heads"] else "mha"
    return (
        f"{index:02d}-{config['family']}-h{config['hidden']}x{config['layers']}-{attention}-v{config['vocab']}"
        f"{'t' if config['tied'] else ''}-b{config['batch']}x{config['seq']}-{config['precision']}-"
        f"{config['optimizer']}-{config['entry']}"
    )


# ------------------------------------------------------------------------------------------------------------ models


class _EncoderLM:
    """Builds a plain ``nn.TransformerEncoder`` language model (embedding, pre-norm layers, a head)."""

    @staticmethod
    def build(config: dict[str, Any]) -> Any:
        import torch
        from torch import nn

        class EncoderLM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                h = config["hidden"]
                self.embed = nn.Embedding(config["vocab"], h)
                layer = nn.TransformerEncoderLayer(
                    h, config["heads"], config["ffn"], dropout=0.0, batch_first=True, norm_first=True
                )
                self.encoder = nn.TransformerEncoder(layer, config["layers"], enable_nested_tensor=False)
                self.norm = nn.LayerNorm(h)
                self.head = nn.Linear(h, config["vocab"], bias=False)
                if config["tied"]:
                    self.head.weight = self.embed.weight

            def forward(self, ids: torch.Tensor) -> torch.Tensor:
                return self.head(self.norm(self.encoder(self.embed(ids))))

        return EncoderLM()


def build_model(config: dict[str, Any], device: Any) -> Any:
    """The configuration's model on ``device``, random-init, in the dtype its precision keeps weights in."""
    import torch

    dtype = torch.bfloat16 if config["precision"] == "bf16" else torch.float32
    previous = torch.get_default_dtype()
    torch.manual_seed(config["index"])
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if config["family"] == "llama":
                from transformers import LlamaConfig, LlamaForCausalLM

                hf = LlamaConfig(
                    hidden_size=config["hidden"],
                    intermediate_size=config["ffn"],
                    num_hidden_layers=config["layers"],
                    num_attention_heads=config["heads"],
                    num_key_value_heads=config["kv_heads"],
                    vocab_size=config["vocab"],
                    tie_word_embeddings=config["tied"],
                    max_position_embeddings=max(config["seq"], 128),
                    attn_implementation="sdpa",
                    use_cache=False,
                )
                return LlamaForCausalLM(hf)
            if config["family"] == "vit":
                from transformers import ViTConfig, ViTForImageClassification

                side = 16 * math.isqrt(config["seq"])
                hf = ViTConfig(
                    hidden_size=config["hidden"],
                    num_hidden_layers=config["layers"],
                    num_attention_heads=config["heads"],
                    intermediate_size=config["ffn"],
                    image_size=side,
                    patch_size=16,
                    num_labels=config["vocab"],
                    attn_implementation="sdpa",
                    hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0,
                )
                return ViTForImageClassification(hf)
            return _EncoderLM.build(config)
    finally:
        torch.set_default_dtype(previous)


def make_batch(config: dict[str, Any], device: Any, step: int) -> tuple[Any, Any]:
    """A synthetic batch: token ids (and the same ids as labels) or images and class labels."""
    import torch

    gen = torch.Generator().manual_seed(1000 + step)
    if config["family"] == "vit":
        side = 16 * math.isqrt(config["seq"])
        dtype = torch.bfloat16 if config["precision"] == "bf16" else torch.float32
        images = torch.randn(config["batch"], 3, side, side, generator=gen).to(device, dtype)
        return images, torch.randint(0, config["vocab"], (config["batch"],), generator=gen).to(device)
    ids = torch.randint(0, config["vocab"], (config["batch"], config["seq"]), generator=gen).to(device)
    return ids, ids


def compute_loss(config: dict[str, Any], model: Any, batch: tuple[Any, Any]) -> Any:
    """The configuration's loss: inside the model (HF ``labels=``) or outside it (cross-entropy of its logits)."""
    import torch.nn.functional as F

    inputs, labels = batch
    if config["family"] == "vit":
        if config["loss_inside"]:
            return model(pixel_values=inputs, labels=labels).loss
        return F.cross_entropy(model(pixel_values=inputs).logits.float(), labels)
    if config["family"] == "llama":
        if config["loss_inside"]:
            return model(input_ids=inputs, labels=labels).loss
        logits = model(input_ids=inputs).logits
    else:
        logits = model(inputs)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def blocks_of(config: dict[str, Any], model: Any) -> Any:
    if config["family"] == "llama":
        return model.model.layers
    if config["family"] == "vit":
        return model.vit.encoder.layer
    return model.encoder.layers


@contextlib.contextmanager
def activation_checkpointing(config: dict[str, Any], model: Any) -> Iterator[None]:
    """Every block checkpointed (non-reentrant): HF's own switch, or torch's checkpoint around each encoder layer."""
    if config["family"] in ("llama", "vit"):
        # (Renamed in transformers 5.x; the older name still works there, with a warning.)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            disable = model.activation_checkpointing_disable
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            disable = model.gradient_checkpointing_disable
        try:
            yield
        finally:
            disable()
        return
    import torch.utils.checkpoint

    layers = blocks_of(config, model)
    originals = [layer.forward for layer in layers]
    for layer, forward in zip(layers, originals, strict=True):
        layer.forward = lambda *a, _f=forward, **k: torch.utils.checkpoint.checkpoint(_f, *a, use_reentrant=False, **k)
    try:
        yield
    finally:
        for layer, forward in zip(layers, originals, strict=True):
            layer.forward = forward


def make_optimizer(config: dict[str, Any], params: Any) -> Any:
    import torch

    if config["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=1e-4, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-5)


# -------------------------------------------------------------------------------------------------------------- arms


# The planned arm ends once this many batches in a row ran a kept plan: its last 4, the ones timed, are then steps a
# long fit runs, not plan trials (which a fit of a thousand steps pays once per input).
SETTLE = 5
# Batches of the arms without a planner: the first warms up, the last 4 are timed.
PLAIN_BATCHES = 6
# Each arm times at least 4 batches and, where a batch is short, about TIMED_S seconds of them (at most TIMED_MAX): a
# host-bound step of a few milliseconds drifts between arms run one after another by more than the 10% compared, and
# a median of 4 such batches moved a row by 0.5x checkpointing between runs.
TIMED_S = 0.3
TIMED_MAX = 16
RERUN_SAID = "running it again under"  # what the engine says as a step that ran out of memory runs again
_SNAPSHOT = False  # record the allocator's history in planned arms and summarise what was live at an out of memory


def _block_site(block: dict[str, Any], depth: int = 3) -> str:
    """Where a block of an allocator snapshot was allocated: its frames outside torch, or where none, torch's own."""
    frames = block.get("frames") or []
    ours = [f for f in frames if "/torch/" not in f["filename"] and "<" not in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in (ours or frames)[:depth]) or "?"


def _on_oom(record: ArmRecord) -> None:
    """Called inside the handler of an out-of-memory error, while the failing step's tensors are still alive."""
    if not _SNAPSHOT:
        return
    import torch

    snapshot = torch.cuda.memory._snapshot()
    record.fragments = fragments(snapshot)
    live: dict[str, int] = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            key = _block_site(block)
            live[key] = live.get(key, 0) + block["size"]
    top = sorted(live.items(), key=lambda kv: -kv[1])[:25]
    record.snapshot = [(key, size / GiB) for key, size in top]
    record.snapshot_total = sum(live.values()) / GiB


def fragments(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Where an allocator snapshot's reserved but unallocated bytes lie: free blocks in segments that also hold live
    blocks (a flush cannot return them), per segment with the sites of the live blocks beside the largest free one, the
    segment's pool, stream and whether it is expandable; the 12 segments holding most such bytes, and the totals (MiB).
    """
    mib = 2**20
    rows, totals = [], {"reserved": 0, "allocated": 0, "free_beside_live": 0, "largest_free": 0, "segments": 0}
    kinds: dict[str, int] = {}
    for segment in snapshot["segments"]:
        blocks = sorted(segment["blocks"], key=lambda b: b["address"])
        live = [b for b in blocks if b["state"] != "inactive"]
        free = [b for b in blocks if b["state"] == "inactive"]
        kind = f"{segment.get('segment_type', '?')}-{'expandable' if segment.get('is_expandable') else 'fixed'}"
        kinds[kind] = kinds.get(kind, 0) + 1
        totals["segments"] += 1
        totals["reserved"] += segment["total_size"]
        totals["allocated"] += sum(b["size"] for b in live)
        if not live or not free:
            continue
        largest = max(free, key=lambda b: b["size"])
        index = blocks.index(largest)
        beside = [_block_site(b, 2) for b in (blocks[index - 1 : index] + blocks[index + 1 : index + 2])]
        sites: dict[str, int] = {}
        for b in live:
            sites[_block_site(b, 2)] = sites.get(_block_site(b, 2), 0) + b["size"]
        held = sum(b["size"] for b in free)
        totals["free_beside_live"] += held
        totals["largest_free"] = max(totals["largest_free"], largest["size"])
        rows.append(
            {
                "kind": kind,
                "stream": segment.get("stream", 0),
                "total": round(segment["total_size"] / mib, 1),
                "free": round(held / mib, 1),
                "free_blocks": len(free),
                "largest_free": round(largest["size"] / mib, 1),
                "beside_largest": beside,
                "live_sites": [[k, round(v / mib, 1)] for k, v in sorted(sites.items(), key=lambda kv: -kv[1])[:3]],
            }
        )
    rows.sort(key=lambda r: -r["free"])
    summary: dict[str, Any] = {k: round(v / mib, 1) for k, v in totals.items() if k != "segments"}
    summary.update(segments=totals["segments"], kinds=kinds, worst=rows[:12])
    return summary


class ArmRecord:
    """What one arm of one configuration did, step by step."""

    def __init__(self) -> None:
        self.times: list[float] = []  # seconds per batch, from one batch's start to the next
        self.kinds: list[str] = []  # per batch: "measuring", "trial", "planned", "" (no planner)
        self.oom: dict[str, Any] | None = None
        self.error: str | None = None
        self.peak = 0
        self.optimizer_peak = 0  # the largest peak inside an optimizer step (none arm only)
        self.plan = ""  # the planner's last plan, in words
        self.plan_fits: bool | None = None
        self.observations: list[dict[str, Any]] = []
        self.trace: dict[str, Any] | None = None  # what the planner was told and answered (planner/trace.py)
        self.floor_warned = False  # the planner said, before the failing step, that nothing fits
        self.last_plan = ""
        self.snapshot: list[tuple[str, float]] = []
        self.snapshot_total = 0.0
        self.fragments: dict[str, Any] | None = None  # with --snapshot: where the free bytes lay at a failure
        # Per batch start, then at an out-of-memory error: the allocator's allocated, reserved and inactive-split MiB
        # (free pieces of segments that hold live blocks: fragments a flush cannot return).
        self.allocator: list[list[int]] = []
        # The allocator's flushes so far (a cap met: it freed its cache to retry an allocation), at each batch start
        # and as the arm ends: which arm flushed in its timed batches, where a plan ran as fast as `ac` did not.
        self.retries: list[int] = []
        self._last = 0.0

    def batch_starts(self, kind: str, sync: Callable[[], None]) -> None:
        sync()
        now = time.perf_counter()
        if self._last:
            self.times.append(now - self._last)
        self._last = now
        self.kinds.append(kind)
        self.read_allocator()  # in every arm, so the few microseconds it takes weigh alike on the ratios

    def read_allocator(self, at_end: bool = False) -> None:
        """Read the allocator (at a batch start or an out-of-memory error; ``at_end``: as the arm ends, its flushes
        alone)."""
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats = torch.cuda.memory_stats()
            keys = ("allocated_bytes", "reserved_bytes", "inactive_split_bytes")
            if not at_end:
                self.allocator.append([stats.get(f"{key}.all.current", 0) >> 20 for key in keys])
            self.retries.append(int(stats.get("num_alloc_retries", 0)))

    def finish(self, sync: Callable[[], None]) -> None:
        sync()
        if self._last:
            self.times.append(time.perf_counter() - self._last)
            self.read_allocator(at_end=True)
        self._last = 0.0

    def flushes(self, batches: int) -> int | None:
        """How often the allocator flushed its cache in the arm's last ``batches`` batches (``None``: not read, or the
        arm ended at an error)."""
        if self.oom is not None or self.error is not None or len(self.retries) <= batches:
            return None
        return self.retries[-1] - self.retries[-batches - 1]

    def settled(self, batches: int) -> bool:
        """Whether the last ``batches`` batches all ran a kept plan (``batches`` 0: never; the arm runs all its
        batches)."""
        return 0 < batches <= len(self.kinds) and all(kind == "planned" for kind in self.kinds[-batches:])

    def timed_batches(self) -> int:
        """How many batches each arm times, from this (plain) arm's pace: about :data:`TIMED_S` seconds, 4 to
        :data:`TIMED_MAX`."""
        pace = self.step_seconds()
        if not pace:
            return 4
        return max(4, min(TIMED_MAX, math.ceil(TIMED_S / pace)))

    def step_seconds(self, last: int = 4) -> float | None:
        """The median of the last ``last`` batches' times (``None``: the arm ran out of memory or too few ran)."""
        if self.oom is not None or self.error is not None or len(self.times) < last:
            return None
        return statistics.median(self.times[-last:])


def _keep_planner_facts(record: ArmRecord, planner: Any) -> None:
    """What the row needs of the planner, copied: holding the planner would hold the model into the next arm."""
    if planner is None:
        return
    if planner.plan is not None:
        record.plan = planner.plan.describe(planner.budget)
        record.plan_fits = planner.plan.fits
    record.observations = [o.as_dict() for o in planner.observations]
    core = getattr(planner, "core", None)
    if core is not None:
        record.trace = core.trace.as_dict()


class _Phase:
    """Whether an optimizer step is running (torch's global optimizer hooks), and the peak inside optimizer steps."""

    def __init__(self, device: Any, track_peak: bool, torch_hooks: bool = True) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.device, self.track_peak = device, track_peak
        self.in_optimizer = False
        self.peak = 0  # the largest peak outside optimizer steps (tracked only with track_peak)
        self.optimizer_peak = 0
        # Lightning runs training_step and backward inside `optimizer.step(closure)`: there torch's hooks would take the
        # whole step for the optimizer's, so the Lightning runner calls `_pre` and `_post` from its own hooks instead.
        self._handles = (
            [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]
            if torch_hooks
            else []
        )

    def _pre(self, *_: Any) -> None:
        self.in_optimizer = True
        if self.track_peak and self.device.type == "cuda":
            import torch

            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    def _post(self, *_: Any) -> None:
        if not self.in_optimizer:
            return
        self.in_optimizer = False
        if self.track_peak and self.device.type == "cuda":
            import torch

            self.optimizer_peak = max(self.optimizer_peak, torch.cuda.max_memory_allocated(self.device))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# What CUDA's out-of-memory message states of the allocator at the failed allocation, besides the request (read as
# the engine reads it, `step_driver.requested_bytes`).
_CUDA_FIGURES = {
    "allocated": r"([0-9.]+ [KMGT]?i?B) is allocated by PyTorch",
    "unallocated": r"([0-9.]+ [KMGT]?i?B) is reserved by PyTorch but unallocated",
}


def cuda_figures_mib(exc: BaseException) -> dict[str, float]:
    """The allocator's figures CUDA's out-of-memory error ``exc`` states (MiB, as CUDA rounded them): the request
    that failed, what was allocated and what was reserved but unallocated (fragments, after the allocator's own flush)
    at the failure; those it does not state are left out."""
    from lightning_offload.options import size_in_bytes
    from lightning_offload.step_driver import requested_bytes

    sizes = {"requested": requested_bytes(exc) or None}
    for name, pattern in _CUDA_FIGURES.items():
        found = re.search(pattern, str(exc))
        sizes[name] = size_in_bytes(found.group(1)) if found else None
    return {name: round(size / 2**20, 2) for name, size in sizes.items() if size is not None}


def _oom(record: ArmRecord, exc: BaseException, phase: _Phase) -> None:
    # Read after the exception unwound: the failed step's tensors freed since count as reserved but unallocated here;
    # CUDA's message (``cuda_mib``) holds the figures at the failure.
    record.read_allocator()
    _on_oom(record)
    kind = record.kinds[-1] if record.kinds else ""
    record.oom = {
        "step": len(record.kinds) - 1,
        "kind": kind,
        "in_optimizer": phase.in_optimizer,
        "msg": str(exc)[:300],
        "cuda_mib": cuda_figures_mib(exc),
    }


def _kind(planner: Any) -> str:
    if planner is None:
        return ""
    return "measuring" if planner.measuring else "trial" if planner.trying else "planned"


def run_context(
    config: dict[str, Any], arm: str, steps: int, budget: int | None, device: Any, settle: int = 0
) -> ArmRecord:
    """A plain PyTorch loop; ``arm``: ``none``, ``ac`` or ``planned`` (``offload_activations`` under ``budget``).
    With ``settle``, the loop ends early once that many batches in a row ran a kept plan."""

    from lightning_offload import offload_activations

    record = ArmRecord()
    model = build_model(config, device)
    optimizer = make_optimizer(config, model.parameters())
    off = None
    if arm == "planned":
        options: dict[str, Any] = {"memory_budget": budget}
        if device.type != "cuda":
            options = {"compute_device": "cpu", "memory_budget": None}
        off = offload_activations(model=model, optimizer=optimizer, **options)
    sync = _sync(device)
    phase = _Phase(device, track_peak=arm == "none")
    with _arm_running(record, phase, sync, lambda: getattr(off, "planner", None), off):
        with activation_checkpointing(config, model) if arm == "ac" else contextlib.nullcontext():
            autocast = config["precision"] == "bf16-mixed"
            _train(
                config,
                model,
                optimizer,
                off,
                steps,
                device,
                record,
                sync,
                settle,
                lambda loss: loss.backward(),
                autocast,
            )
    _arm_peaks(record, phase, device)
    return record


def _train(
    config: dict[str, Any],
    model: Any,
    optimizer: Any,
    off: Any,
    steps: int,
    device: Any,
    record: ArmRecord,
    sync: Callable[[], None],
    settle: int,
    backward: Callable[[Any], None],
    autocast: bool = False,
) -> None:
    """Up to ``steps`` optimizer steps, each after one accumulation window of batches, as a user's loop runs them:
    the planned arm runs each window through ``off.run_step``, which runs it again where it ran out of memory and the
    planner made the next step more frugal (the window clears the gradients first, so a window run again adds them
    once)."""
    import torch

    def window(first: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        for step in range(first, first + config["accumulate"]):
            batch = make_batch(config, device, step)
            if off is not None:
                off.input_changed(tuple(batch[0].shape))
            # The step begins where the engine begins it (install), so the planner's view of this batch is known.
            context = off if off is not None else contextlib.nullcontext()
            with context, torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                record.batch_starts(_kind(getattr(off, "planner", None)), sync)
                loss = compute_loss(config, model, batch) / config["accumulate"]
            backward(loss)
            del loss

    for first in range(0, steps * config["accumulate"], config["accumulate"]):
        if off is not None:
            off.run_step(lambda first=first: window(first))
        else:
            window(first)
        optimizer.step()
        if record.settled(settle):
            break


def run_fabric(
    config: dict[str, Any], arm: str, steps: int, budget: int | None, device: Any, settle: int = 0
) -> ArmRecord:
    """A Fabric loop; the arms and ``settle`` as in :func:`run_context` (``fabric_offload`` under ``budget``)."""
    from lightning.fabric import Fabric

    from lightning_offload.fabric import fabric_offload

    record = ArmRecord()
    precision = "bf16-mixed" if config["precision"] == "bf16-mixed" else "32-true"
    fabric = Fabric(accelerator=device.type, devices=1, precision=precision)
    model = build_model(config, device)
    optimizer = make_optimizer(config, model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    off = None
    if arm == "planned":
        options: dict[str, Any] = {"memory_budget": budget}
        if device.type != "cuda":
            options = {"compute_device": "cpu", "memory_budget": None}
        off = fabric_offload(fabric, model, optimizer, **options)
    sync = _sync(device)
    phase = _Phase(device, track_peak=arm == "none")
    with _arm_running(record, phase, sync, lambda: getattr(off, "planner", None), off):
        with activation_checkpointing(config, model.module) if arm == "ac" else contextlib.nullcontext():
            _train(config, model, optimizer, off, steps, device, record, sync, settle, fabric.backward)
    _arm_peaks(record, phase, device)
    return record


def run_callback(
    config: dict[str, Any], arm: str, steps: int, budget: int | None, device: Any, settle: int = 0
) -> ArmRecord:
    """``Trainer.fit`` (once or twice in a row, with validation as configured); ``planned``: with
    ``ActivationOffloadCallback(memory_budget=budget)``. With ``settle``, the last fit stops early once that many
    batches in a row ran a kept plan (an earlier fit runs all its batches)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, Dataset

    from lightning_offload import ActivationOffloadCallback

    record = ArmRecord()
    model = build_model(config, device)

    class Batches(Dataset):
        def __init__(self, count: int) -> None:
            self.count = count

        def __len__(self) -> int:
            return self.count

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            inputs, labels = make_batch({**config, "batch": 1}, "cpu", i)
            return inputs[0], labels[0]

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return compute_loss(config, self.model, batch)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            compute_loss(config, self.model, batch)

        def configure_optimizers(self) -> Any:
            return make_optimizer(config, self.model.parameters())

    sync = _sync(device)

    class Clock(pl.Callback):
        """Times batches, keeps the planner (the callback lets its engine go as fit ends) and marks the optimizer's
        step: from `on_before_optimizer_step` (backward is over) to the batch's end."""

        def __init__(self, offload: Any) -> None:
            self.offload = offload

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            engine = self.offload.engine if self.offload is not None else None
            planner = getattr(engine, "planner", None)
            if planner is not None:
                planners[0] = planner
            record.batch_starts(_kind(planner), sync)

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            phase._pre()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            phase._post()
            last_fit = fits_left[0] == 1
            if last_fit and record.settled(settle):
                trainer.should_stop = True
            if trainer.global_step >= trainer.max_steps or trainer.should_stop:
                # The last batch ends here: timed after `fit` returns, it would hold the fit's teardown too (with 4
                # batches timed, that made the plain arm look up to 10x slower than it is).
                record.finish(sync)

    planners: list[Any] = [None]
    fits_left = [config["fits"]]

    offload = None
    if arm == "planned":
        options: dict[str, Any] = {"memory_budget": budget}
        if device.type != "cuda":
            options = {"compute_device": "cpu", "memory_budget": None}
        offload = ActivationOffloadCallback(**options)
    module = Module()
    batches = steps * config["accumulate"]
    precision = "bf16-mixed" if config["precision"] == "bf16-mixed" else "32-true"
    phase = _Phase(device, track_peak=arm == "none", torch_hooks=False)
    with _arm_running(record, phase, sync, lambda: planners[0]):
        with activation_checkpointing(config, model) if arm == "ac" else contextlib.nullcontext():
            for _ in range(config["fits"]):
                callbacks = [c for c in (offload, Clock(offload)) if c is not None]
                trainer = pl.Trainer(
                    accelerator=device.type,
                    devices=1,
                    precision=precision,
                    max_steps=steps,
                    logger=False,
                    enable_checkpointing=False,
                    enable_progress_bar=False,
                    enable_model_summary=False,
                    num_sanity_val_steps=2 if config["sanity"] else 0,
                    val_check_interval=config["val_every"] * config["accumulate"] or None,
                    check_val_every_n_epoch=None if config["val_every"] else 1,
                    limit_val_batches=2,
                    accumulate_grad_batches=config["accumulate"],
                    callbacks=callbacks,
                )
                loader = DataLoader(Batches(batches), batch_size=config["batch"])
                val = DataLoader(Batches(2 * config["batch"]), batch_size=config["batch"])
                record.times, record.kinds = [], []  # the last fit's are the ones timed
                trainer.fit(module, loader, val if (config["sanity"] or config["val_every"]) else None)
                record.finish(sync)
                fits_left[0] -= 1
    _arm_peaks(record, phase, device)
    return record


RUNNERS = {"callback": run_callback, "context": run_context, "fabric": run_fabric}


@contextlib.contextmanager
def _arm_running(
    record: ArmRecord, phase: _Phase, sync: Callable[[], None], planner: Callable[[], Any], engine: Any = None
) -> Iterator[None]:
    """Run an arm's loop: an out-of-memory error ends the arm and is recorded; whatever happens, the last batch's
    time and the planner's facts are kept, ``engine`` (if any) is closed and the optimizer hooks are removed."""
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        _oom(record, exc, phase)
        # Raised outside the engine's context (backward, the optimizer's step): told as a user's loop would tell it, so
        # the planner's trace holds the failed step. Unheard: what the planner says after the failure is not what it
        # said before the step, which the row's `floor_warned` counts.
        failed = getattr(engine, "failed", None)
        if failed is not None:
            log = logging.getLogger("lightning_offload")
            was, log.disabled = log.disabled, True
            try:
                failed(exc)
            finally:
                log.disabled = was
    finally:
        record.finish(sync)
        _keep_planner_facts(record, planner())
        if engine is not None:
            engine.close()
        phase.remove()


def _sync(device: Any) -> Callable[[], None]:
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _arm_peaks(record: ArmRecord, phase: _Phase, device: Any) -> None:
    import torch

    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    record.peak = max(peak, phase.peak, phase.optimizer_peak)
    record.optimizer_peak = phase.optimizer_peak


def _free(device: Any) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# -------------------------------------------------------------------------------------------------------------- rows


class _PlannerLog(logging.Handler):
    """Collects the planner's warnings (a floor that does not fit is said before the step)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def failed_plan_fitted(trace: dict[str, Any] | None) -> bool:
    """Whether the planner said the plan of the last step it began fits (in a trace that ends in a step that raised,
    the plan that failed)."""
    begins = [event for event in (trace or {}).get("events", []) if event[0] == "begin"]
    plan = begins[-1][2].get("plan") if begins else None
    return bool(plan and plan.get("fits"))


def said_floor_over(message: str) -> bool:
    """Whether a planner's message says, before a step, that no plan fits (the most frugal plan's peak, the floor of
    weights, gradients and optimizer state, or the next measuring step's expected peak)."""
    return any(words in message.lower() for words in ("does not fit", "no plan can keep", "should need about"))


def run_config(config: dict[str, Any], steps: int, tiny: bool) -> dict[str, Any]:
    """One configuration's row: ``none`` uncapped, then ``ac`` and ``planned`` under a cap of ``fraction`` x
    ``none``'s peak (no cap on the CPU). ``planned`` runs at most ``steps`` batches and ends once :data:`SETTLE`
    batches in a row ran a kept plan, so its timed batches are the steps a long fit runs, not plan trials."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not tiny else torch.device("cpu")
    runner = RUNNERS[config["entry"]]
    row: dict[str, Any] = {"config": config["name"], "entry": config["entry"], "settings": config}
    none = runner(config, "none", PLAIN_BATCHES, None, device)
    timed = none.timed_batches() if not tiny else 4  # (the CPU run checks the rig, not the pace)
    # Batches (optimizer steps) an arm without a planner runs to time `timed` of its batches after two warm-up steps.
    plain = max(PLAIN_BATCHES, 2 + math.ceil(timed / config["accumulate"]))
    if plain > PLAIN_BATCHES and none.oom is None and none.error is None:
        _free(device)
        none = runner(config, "none", plain, None, device)  # short batches: again, with enough of them timed
    row["none_peak_gib"] = none.peak / GiB
    row["timed_batches"] = timed
    if none.oom is not None or none.error is not None:
        row["error"] = "none ran out of memory uncapped"
        return row
    cap = None
    if device.type == "cuda":
        _free(device)
        total = torch.cuda.get_device_properties(device).total_memory
        cap = int(config["fraction"] * none.peak)
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
    row["cap_gib"] = cap / GiB if cap else None
    # Checkpointing runs before the planned arm: a planned arm that left memory allocated (zoo row 22 on an H100: the
    # ac arm then could not build its model under the cap) would take it from the arm it is compared with.
    ac = runner(config, "ac", plain, None, device)
    _free(device)
    handler = _PlannerLog()
    logging.getLogger("lightning_offload").addHandler(handler)
    if _SNAPSHOT and device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=200000)
    try:
        # Room for the batches timed past the ones the planner measures and times plans in.
        settle = max(SETTLE, timed + 1)
        planned_steps = steps + math.ceil((settle - SETTLE) / config["accumulate"])
        planned = runner(config, "planned", planned_steps, cap, device, settle=settle)
    finally:
        logging.getLogger("lightning_offload").removeHandler(handler)
        if _SNAPSHOT and device.type == "cuda":
            torch.cuda.memory._record_memory_history(enabled=None)
    planned.floor_warned = any(said_floor_over(m) for m in handler.messages)
    _free(device)
    # What the planned arm left allocated once its model, optimizer and engine are gone (0 where nothing leaked).
    row["left_allocated_gib"] = torch.cuda.memory_allocated(device) / GiB if device.type == "cuda" else 0.0
    none_s, ac_s, planned_s = none.step_seconds(timed), ac.step_seconds(timed), planned.step_seconds(timed)
    arms = {"none": none, "ac": ac, "planned": planned}
    oom_kind = planned.oom["kind"] if planned.oom else None
    # The floor: the least any plan can hold. The optimizer's step holds what no plan changes (weights, gradients,
    # its state and its transient: measured in `none`), and the measuring steps are the most frugal steps there are.
    optimizer_fits = cap is None or none.optimizer_peak <= cap
    # A plan said to fit that ran out of memory outside the optimizer's step is the planner's miss, whatever it said of
    # the plans after its correction (row 00 alone on an H200 was labelled "floor does not fit" by them).
    missed = oom_kind in ("trial", "planned") and not planned.oom["in_optimizer"] and failed_plan_fitted(planned.trace)
    floor_fits = optimizer_fits and oom_kind != "measuring" and (planned.plan_fits is not False or missed)
    row.update(
        fits_floor=floor_fits if device.type == "cuda" else None,
        optimizer_peak_gib=none.optimizer_peak / GiB,
        oom_planned=int(floor_fits and planned.oom is not None and oom_kind in ("trial", "planned")),
        # Steps that ran out of memory and ran again under a more frugal plan (``run_step``; the callback's batches).
        reruns=sum(RERUN_SAID in message for message in handler.messages),
        oom_step=planned.oom,
        floor_warned=planned.floor_warned,
        ratio_none=planned_s / none_s if planned_s and none_s else None,
        ratio_ac=planned_s / ac_s if planned_s and ac_s else None,
        # Each arm's timed batches in seconds, as they came: a ratio that moves between runs is told apart from the
        # arm whose pace moved (a host-bound row's `none` ran twice as fast on one H100 as on another).
        batch_seconds={name: arm.times[-timed:] for name, arm in arms.items()},
        flushes_in_timed={name: arm.flushes(timed) for name, arm in arms.items()},
        ac_fits=ac.oom is None,
        ac_peak_gib=ac.peak / GiB,
        planned_peak_gib=planned.peak / GiB,
        measuring_trial_steps=sum(kind in ("measuring", "trial") for kind in planned.kinds),
        batches=len(planned.kinds),
        kinds="".join(kind[:1] or "-" for kind in planned.kinds),
        plan=planned.plan or None,
        # [allocated, reserved, inactive split] MiB at each planned-arm batch start, the last at an OOM if one came.
        allocator_mib=planned.allocator,
        observations=planned.observations,
        trace=planned.trace,
        planner_warnings=handler.messages[:5],
    )
    if planned.snapshot:
        row["oom_snapshot"] = {"live_gib": planned.snapshot_total, "by_site": planned.snapshot}
    if planned.fragments is not None:
        row["oom_fragments"] = planned.fragments
    if ac.oom is not None:
        row["ratio_ac"] = None
    return row


def _child(run: Callable[..., dict[str, Any]], config: dict[str, Any], steps: int, tiny: bool, queue: Any) -> None:
    try:
        row = run(config, steps, tiny)
    except BaseException as exc:  # the row says what broke; the zoo goes on
        row = {"config": config["name"], "entry": config["entry"], "settings": config, "error": repr(exc)}
        row["traceback"] = traceback.format_exc()[-3000:]
    queue.put(json.dumps(row, default=str))


def run_isolated(
    config: dict[str, Any], steps: int, tiny: bool, timeout_s: float, run: Callable[..., dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``run(config, steps, tiny)`` (:func:`run_config` by default) in a forked child: a fresh CUDA context, allocator
    and planner for every configuration."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=_child, args=(run or run_config, config, steps, tiny, queue))
    start = time.perf_counter()
    process.start()
    try:
        row = json.loads(queue.get(timeout=timeout_s))
    except Exception:
        row = {"config": config["name"], "entry": config["entry"], "settings": config, "error": "timed out or died"}
    process.join(timeout=30)
    if process.is_alive():
        process.kill()
    row["wall_s"] = time.perf_counter() - start
    return row


# ----------------------------------------------------------------------------------------------------------- reports


def prediction_errors(rows: list[dict[str, Any]]) -> list[float]:
    """Every planned or trial step's peak less its prediction, as a share of its budget."""
    errors = []
    for row in rows:
        for o in row.get("observations", []):
            if o["kind"] != "measuring" and o["predicted"] and o["budget"]:
                errors.append((o["peak"] - o["predicted"]) / o["budget"])
    return errors


def timed_in_plans(row: dict[str, Any]) -> bool:
    """Whether every batch a row timed in its planned arm ran a kept plan: a planned arm that reached its last batch
    still timing plans (or timing them again, after its margin grew) compared trial steps with checkpointing."""
    timed, kinds = row.get("timed_batches", 4), row.get("kinds") or ""
    return len(kinds) >= timed and set(kinds[-timed:]) == {"p"}


def _unwarned(row: dict[str, Any]) -> bool:
    return row.get("fits_floor") is False and bool(row.get("oom_step")) and not row.get("floor_warned")


def _failed_first_step(row: dict[str, Any]) -> bool:
    oom = row.get("oom_step") or {}
    return oom.get("step") == 0 and oom.get("kind") == "measuring"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ran = [r for r in rows if "error" not in r]
    fitting = [r for r in ran if r.get("fits_floor")]
    compared = [r for r in fitting if r.get("ratio_ac") is not None]
    ratios_ac = [r["ratio_ac"] for r in compared]
    settled_ac = [r["ratio_ac"] for r in compared if timed_in_plans(r)]
    errors = prediction_errors(ran)
    return {
        "rows": len(rows),
        "ran": len(ran),
        "errors": len(rows) - len(ran),
        "floor_fits": len(fitting),
        "oom_planned": sum(r.get("oom_planned", 0) for r in ran),
        "reruns": sum(r.get("reruns", 0) for r in ran),
        "rows_with_reruns": [r["config"] for r in ran if r.get("reruns")],
        # The user's view, whatever the planner concluded after the fact: ours ran out of memory in a trial or planned
        # step where checkpointing every block trained under the same cap.
        "oom_where_ac_fits": sum(
            1 for r in ran if r.get("ac_fits") and (r.get("oom_step") or {}).get("kind") in ("trial", "planned")
        ),
        # Where the floor does not fit, the planner's message comes before the failing step, except in a run's first
        # step: nothing is measured before it, so its own out of memory is the first word (its error says so).
        "floor_not_fitting_unwarned": sum(1 for r in ran if _unwarned(r) and not _failed_first_step(r)),
        "floor_not_fitting_told_in_first_step": sum(1 for r in ran if _unwarned(r) and _failed_first_step(r)),
        "median_ratio_ac": statistics.median(ratios_ac) if ratios_ac else None,
        "max_ratio_ac": max(ratios_ac) if ratios_ac else None,
        # The same over the rows whose timed batches all ran a kept plan (the steps a long fit runs).
        "median_ratio_ac_kept_plans": statistics.median(settled_ac) if settled_ac else None,
        "max_ratio_ac_kept_plans": max(settled_ac) if settled_ac else None,
        "rows_timed_in_trials": [r["config"] for r in compared if not timed_in_plans(r)],
        "rows_ac_fails_planned_fits": sum(1 for r in fitting if not r.get("ac_fits") and not r.get("oom_planned")),
        "prediction_error_share": _quantiles(errors),
    }


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"n": len(ordered), "min": ordered[0], "p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def fmt(value: Any, digits: int = 2) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "no"
        if isinstance(value, float):
            return f"{value:.{digits}f}"
        return str(value)

    lines = [
        "# Model zoo under a hard cap",
        "",
        f"{meta.get('device', '')}; torch {meta.get('torch', '')}; seed {meta.get('seed')}; {len(rows)} "
        "configurations, each in a fresh process. Cap = budget = `fraction` x the uncapped peak. Ratios: median of "
        "the last 4 batches' time (of about 0.3 s of batches where they are short, up to 16) against the same entry "
        "point without offloading (`none`, uncapped) and with every "
        "block checkpointed under the same cap (`ac`; - where it ran out of memory); (trials): the planned arm's last "
        "batch came while it still timed plans, so the ratio compares trial steps.",
        "",
        "| config | cap GiB | floor fits | OOM planned | run again | x none | x ac | ac fits "
        "| measuring+trial / batches | plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {fmt(r.get('cap_gib'))} | error: {r['error'][:80]} | | | | | | | |")
            continue
        trials = "" if r.get("ratio_none") is None or timed_in_plans(r) else " (trials)"
        lines.append(
            f"| {r['config']} | {fmt(r.get('cap_gib'))} | {fmt(r.get('fits_floor'))} | {r.get('oom_planned')} | "
            f"{r.get('reruns', '-')} | {fmt(r.get('ratio_none'))}{trials} | {fmt(r.get('ratio_ac'))}{trials} | "
            f"{fmt(r.get('ac_fits'))} | "
            f"{r.get('measuring_trial_steps')} / {r.get('batches')} | {(r.get('plan') or '')[:90]} |"
        )
    lines += ["", "```", json.dumps(summary(rows), indent=1), "```", ""]
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.zoo", description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--count", type=int, default=42)
    parser.add_argument("--part", default="1/1", help="i/n: run the i-th of n equal slices of the configurations")
    parser.add_argument("--only", default="", help="comma-separated configuration indices to run")
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help=f"most batches of the planned arm (it ends once {SETTLE} in a row ran a kept plan, more where batches are "
        f"short; none and ac run {PLAIN_BATCHES}, more where batches are short)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the rig, not the budget")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one configuration may take")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--merge", nargs="+", type=Path, default=None, help="merge part files into --out")
    parser.add_argument("--snapshot", action="store_true", help="at an out of memory, list what was live (slow)")
    args = parser.parse_args(argv)
    global _SNAPSHOT
    _SNAPSHOT = args.snapshot

    if args.merge:
        rows = [row for path in args.merge for row in json.loads(path.read_text())["rows"]]
        meta = json.loads(args.merge[0].read_text())["meta"]
        rows.sort(key=lambda r: r["settings"]["index"])
        return _write(args.out, rows, meta, _parts_traces(args.merge))

    configs = generate(args.seed, args.count, tiny=args.tiny)
    index, parts = (int(x) for x in args.part.split("/"))
    configs = configs[index - 1 :: parts]
    if args.only:
        wanted = {int(i) for i in args.only.split(",")}
        configs = [c for c in configs if c["index"] in wanted]
    if args.tiny:
        configs = configs[:9]  # both regression rows, and each family under each entry point
        args.steps = min(args.steps, 6)
    import torch  # in the parent: imported once, before any fork; CUDA is initialised only in the children

    meta = {"seed": args.seed, "count": args.count, "torch": torch.__version__, "tiny": args.tiny}
    meta["device"] = "CPU (tiny)" if args.tiny else _gpu_name()
    import lightning.pytorch  # noqa: F401  (imported once in the parent, so children start at once)

    if not args.tiny:
        import transformers  # noqa: F401
    rows = []
    for config in configs:
        row = run_isolated(config, args.steps, args.tiny, args.timeout)
        rows.append(row)
        tiny_line = row["config"] + (": ran" if "error" not in row else f": ERROR {row['error']}")
        print(tiny_line if args.tiny else _line(row), flush=True)
        if args.out is not None and not args.tiny:  # a part cut short still leaves the rows it ran
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"meta": meta, "summary": summary(rows), "rows": rows}, default=str))
    if args.tiny:  # (no ratios: CPU times of tiny models say nothing of the budget)
        broken = [r for r in rows if "error" in r]
        for r in broken:
            print(r["config"], r["error"], r.get("traceback", ""), file=sys.stderr)
        print(f"pipeline {'OK' if not broken else 'FAILED'}, {len(rows) - len(broken)} rows ran")
        if args.out:
            _write(args.out, rows, meta)
        return 1 if broken else 0
    return _write(args.out, rows, meta)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Each planned or trial step's measured peak against its plan's prediction, both as shares of the budget, by
    entry point; steps above the diagonal peaked above their prediction, above 1.0 past the budget. Nothing is drawn
    where no step was planned (the CPU) or matplotlib is missing."""
    points = [
        (o["predicted"] / o["budget"], o["peak"] / o["budget"], row["entry"])
        for row in rows
        for o in row.get("observations") or ()
        if o.get("predicted") and o.get("budget")
    ]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    if not points:
        return
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for entry, color in zip(ENTRIES, ("tab:blue", "tab:orange", "tab:green"), strict=True):
        xs = [x for x, _, e in points if e == entry]
        ys = [y for _, y, e in points if e == entry]
        ax.scatter(xs, ys, s=10, alpha=0.6, color=color, label=entry)
    low = min(min(x for x, _, _ in points), min(y for _, y, _ in points), 0.5)
    ax.plot([low, 1.05], [low, 1.05], color="grey", linewidth=0.8)
    ax.axhline(1.0, color="red", linewidth=0.8)
    ax.set_xlabel("predicted peak / budget")
    ax.set_ylabel("measured peak / budget")
    ax.set_title("Planned and trial steps under a hard cap (budget = cap)")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _gpu_name() -> str:
    """The GPU's name from nvidia-smi: asking CUDA in this process would initialise it before the children fork."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return "no GPU"
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else "CUDA"


def _line(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['config']}: ERROR {row['error'][:200]}"
    r = row
    return (
        f"{r['config']}: cap {r.get('cap_gib') or 0:.2f} floor_fits={r.get('fits_floor')} oom={r.get('oom_planned')} "
        f"reruns={r.get('reruns')} "
        f"x_none={r.get('ratio_none')} x_ac={r.get('ratio_ac')} kinds={r.get('kinds')} wall={r.get('wall_s', 0):.0f}s "
        f"plan={r.get('plan')} oom_step={r.get('oom_step')}"
    )


def _traces_path(out: Path) -> Path:
    return out.with_name(out.stem + "-traces.json")


def _parts_traces(parts: list[Path]) -> dict[str, Any]:
    """The traces the parts wrote beside them (a part's rows keep none: :func:`_write` moved them out)."""
    traces: dict[str, Any] = {}
    for part in parts:
        if _traces_path(part).exists():
            traces.update(json.loads(_traces_path(part).read_text()))
    return traces


def _write(
    out: Path | None, rows: list[dict[str, Any]], meta: dict[str, Any], traces: dict[str, Any] | None = None
) -> int:
    """The merged rows to ``out`` (JSON, Markdown, plot) and the planners' traces beside it (``<out>-traces.json``, by
    configuration: what the replay tests read): those of ``rows``, and ``traces`` (the parts' of a merge)."""
    traces = {**(traces or {}), **{row["config"]: row.pop("trace") for row in rows if row.get("trace")}}
    text = json.dumps({"meta": meta, "summary": summary(rows), "rows": rows}, indent=1, default=str)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        if traces:
            _traces_path(out).write_text(json.dumps(traces, default=str))
        out.with_suffix(".md").write_text(markdown(rows, meta))
        _plot(rows, out.with_suffix(".png"))
    print(json.dumps(summary(rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
