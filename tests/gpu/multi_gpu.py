"""``ActivationOffloadCallback`` under DDP, FSDP and FSDP2 on several GPUs: memory, time and bit-exactness per rank.

On a machine with two GPUs, from the repository root (not yet run on GPUs; estimated at 3 to 6 minutes on two
H200s, most of it setting up the 30 fits)::

    torchrun --nproc-per-node=2 -m tests.gpu.multi_gpu --out multi_gpu.json

Each strategy (``ddp``: ``DDPStrategy``; ``fsdp``: ``FSDPStrategy`` wrapping each block; ``fsdp2``:
``ModelParallelStrategy`` with ``fully_shard`` on each block and the root in ``configure_model``) trains each model in
five variants, from the same seed, all in the same torchrun processes:

- ``none``: no offloading, no checkpointing; ``ac``: the strategy's own activation checkpointing of the blocks
  (``activation_checkpointing_policy`` for FSDP; torch's ``apply_activation_checkpointing``, which that policy uses,
  for DDP and FSDP2, whose strategies have none);
- ``offload``: ``ActivationOffloadCallback(memory_budget=None)``, streamed; ``ckpt+offload``: the same with
  ``checkpoint="auto"``; ``ac+offload``: ``ac`` and ``offload`` together.

Models: ``mlp``, fp32 residual MLP blocks on deterministic kernels (TF32 off), whose parameters after training are
compared bit for bit with ``none`` on every rank (``exact``); ``llama``, bf16, hidden 2048, 16 layers, sequence
4096, random init (``transformers.LlamaForCausalLM`` when importable, else ``examples/demo_model.py``). Per row and
rank: peak allocated memory, median step time after ``--warmup`` steps (its ratio to ``none`` and to ``ac`` uses the
slowest rank), the host pool's pinned bytes (``callback.stats.host_pinned_bytes``) and the bytes offloaded in the
last step. Rank zero writes the rows as JSON to ``--out`` and prints one table. A row that raises is recorded with
its error and the run goes on.

    python -m tests.gpu.multi_gpu --dry-run --out /tmp/x.json      # arguments, table and JSON only (made-up rows)
    torchrun --nproc-per-node=2 -m tests.gpu.multi_gpu --cpu --out /tmp/x.json   # tiny sizes on gloo (no fsdp)
"""

from __future__ import annotations

import os

# NVLink multicast (NVLS) stays off: on shared hosts a program that uses it can put every GPU of the host out of
# service. Set before torch loads NCCL; a value given beforehand is kept.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
for _name, _value in NO_MULTICAST.items():
    os.environ.setdefault(_name, _value)
# Every row on the same allocator: the engine would otherwise switch expandable segments on at the first offload row.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the fp32 rows

import argparse  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from typing_extensions import override  # noqa: E402

from tests.gpu.multi_gpu_report import GiB, Row, dry_rows, write  # noqa: E402

STRATEGIES = ("ddp", "fsdp", "fsdp2")
VARIANTS = ("none", "ac", "offload", "ckpt+offload", "ac+offload")
MODELS = ("mlp", "llama")
ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.multi_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("multi_gpu.json"), help="where rank zero writes the rows")
    parser.add_argument("--dry-run", action="store_true", help="no distributed work: made-up rows, table and JSON")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU, tiny sizes (fsdp needs a GPU: skipped)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"comma-separated, of {STRATEGIES}")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {MODELS}")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    parser.add_argument("--llama", choices=("auto", "transformers", "demo"), default="auto", help="llama model code")
    parser.add_argument("--llama-shape", default="2048,16,4096", help="hidden,layers,sequence of the llama model")
    parser.add_argument(
        "--host-limit-gib", type=float, help="host_memory_limit per rank (default: the callback's share of free RAM)"
    )
    parser.add_argument("--mlp-shape", default="2048,8,8192", help="width,blocks,tokens per rank of the mlp model")
    args = parser.parse_args(argv)
    for name, allowed in (("strategies", STRATEGIES), ("variants", VARIANTS), ("models", MODELS)):
        chosen = [v for v in getattr(args, name).split(",") if v]
        if not chosen or any(v not in allowed for v in chosen):
            parser.error(f"--{name}={getattr(args, name)!r}: a comma-separated choice of {list(allowed)}")
        setattr(args, name, chosen)
    for name in ("llama_shape", "mlp_shape"):
        try:
            shape = tuple(int(v) for v in getattr(args, name).split(","))
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) <= 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)!r}: three positive integers a,b,c")
        setattr(args, name, shape)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup={args.warmup} --steps={args.steps}: need 0 <= warmup < steps")
    if args.cpu and not args.dry_run:
        args.mlp_shape, args.llama_shape, args.llama = (16, 3, 32), (64, 2, 32), "demo"
    return args


# ----------------------------------------------------------------------------------------------------- models


class MLPBlock(nn.Module):
    """Pre-norm residual MLP: ``x + fc2(gelu(fc1(norm(x))))``, 4x wide inside."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class MLPStack(nn.Module):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class Spec:
    """How to build, feed and shard one model."""

    name: str
    block: type[nn.Module]
    build: Any  # () -> nn.Module
    layers: Any  # model -> the nn.ModuleList of blocks
    loss: Any  # (model, index, device) -> loss
    precision: str


def mlp_spec(width: int, blocks: int, tokens: int) -> Spec:
    def loss(model: nn.Module, index: int, device: torch.device) -> torch.Tensor:
        generator = torch.Generator(device).manual_seed(1000 + index)
        x = torch.randn(4, tokens // 4, width, device=device, generator=generator)
        return model(x).square().mean()

    return Spec("mlp", MLPBlock, lambda: MLPStack(width, blocks), lambda m: m.blocks, loss, "32-true")


def llama_spec(hidden: int, layers: int, seq: int, impl: str) -> Spec:
    vocab = 32000
    if impl != "demo" and importlib.util.find_spec("transformers") is not None:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        config = LlamaConfig(
            hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
            intermediate_size=hidden * 11 // 4, vocab_size=vocab, max_position_embeddings=seq, use_cache=False,
            attn_implementation="sdpa",
        )  # fmt: skip
        config._attn_implementation = "sdpa"  # older releases read only this
        build, block, model_loss = (lambda: LlamaForCausalLM(config)), LlamaDecoderLayer, None
        layers_of = lambda m: m.model.layers  # noqa: E731
        name = "llama(transformers)"
    elif impl == "transformers":
        raise SystemExit("--llama=transformers: transformers is not importable here")
    else:
        path = ROOT / "examples" / "demo_model.py"
        module_spec = importlib.util.spec_from_file_location("multi_gpu_demo_model", path)
        demo = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        module_spec.loader.exec_module(demo)  # type: ignore[union-attr]
        build = lambda: demo.DecoderOnlyTransformer(vocab, hidden, layers, max(1, hidden // 128), seq)  # noqa: E731
        block, model_loss, layers_of, name = demo.Block, "demo", (lambda m: m.blocks), "llama(demo)"

    def loss(model: nn.Module, index: int, device: torch.device) -> torch.Tensor:
        generator = torch.Generator(device).manual_seed(1000 + index)
        ids = torch.randint(0, vocab, (1, seq), device=device, generator=generator)
        if model_loss is None:
            return model(input_ids=ids, labels=ids).loss
        logits = model(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    return Spec(name, block, build, layers_of, loss, "bf16-true")


# ------------------------------------------------------------------------------------------------ one row


def run_row(args: argparse.Namespace, spec: Spec, strategy: str, variant: str) -> dict[str, Any]:
    """Train one row in this process; returns this rank's measurements."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_offload import ActivationOffloadCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))
    ac, offload = variant in ("ac", "ac+offload"), variant.endswith("offload")
    cuda = not args.cpu

    class Bench(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module | None = None

        @override
        def configure_model(self) -> None:
            torch.manual_seed(0)  # the same start in every variant (and on every rank)
            with torch.device(self.trainer.strategy.root_device):
                net = spec.build()
            if ac and strategy != "fsdp":  # FSDPStrategy applies its own policy
                apply_activation_checkpointing(net, check_fn=lambda m: isinstance(m, spec.block))
            if strategy == "fsdp2":
                mesh = self.device_mesh["data_parallel"]
                for layer in spec.layers(net):
                    fully_shard(layer, mesh=mesh)
                fully_shard(net, mesh=mesh)
            self.net = net

        @override
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return spec.loss(self.net, int(batch[0]), self.device)

        @override
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

        @override
        def train_dataloader(self) -> DataLoader:
            items = list(range(world * args.steps))
            sampler = DistributedSampler(items, num_replicas=world, rank=self.global_rank, shuffle=False)
            return DataLoader(items, batch_size=1, sampler=sampler)

    class Meter(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.start = 0.0

        @override
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

        @override
        def on_train_batch_start(self, *args: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        @override
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, *args: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append((time.perf_counter() - self.start) * 1e3)
            self.losses.append(float(outputs["loss"]))

    if strategy == "ddp":
        strat: Any = DDPStrategy()
    elif strategy == "fsdp":
        strat = FSDPStrategy(
            auto_wrap_policy={spec.block}, activation_checkpointing_policy={spec.block} if ac else None
        )
    else:
        strat = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
    options: dict[str, Any] = {"memory_budget": None, "checkpoint": "auto" if variant == "ckpt+offload" else None}
    if args.cpu:
        options.update(compute_device="cpu", min_tensor_bytes=0, resident_tail_bytes=0)
    if args.host_limit_gib is not None:
        options["host_memory_limit"] = int(args.host_limit_gib * GiB)
    callback = ActivationOffloadCallback(**options) if offload else None
    meter = Meter()
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu", devices=world, strategy=strat, precision=spec.precision,
        max_steps=args.steps, deterministic=spec.precision == "32-true", callbacks=[c for c in (callback, meter) if c],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    module = Bench()
    trainer.fit(module)
    digest = hashlib.sha256()
    for param in trainer.model.parameters():  # the wrapped model's: this rank's shards under fsdp and fsdp2
        local = (param.to_local() if isinstance(param, DTensor) else param).detach()
        digest.update(local.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    stats = callback.stats if callback is not None else None
    result = {
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
        "step_ms": round(statistics.median(meter.times[args.warmup :]), 3),
        "pinned_bytes": stats.host_pinned_bytes if stats else 0,
        "offloaded_bytes": stats.offloaded_bytes if stats else 0,
        "losses": meter.losses,
        "digest": digest.hexdigest()[:16],
    }
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = {name: os.environ.get(name) for name in (*NO_MULTICAST, "PYTORCH_CUDA_ALLOC_CONF")}
    meta = {"dry_run": args.dry_run, "cpu": args.cpu, "steps": args.steps, "warmup": args.warmup, "env": env}
    if args.dry_run:
        write(dry_rows(args.models, args.strategies, args.variants), args.out, meta)
        return 0
    import torch.distributed as dist

    from lightning_offload import release_host_memory

    if not args.cpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("gloo" if args.cpu else "nccl")  # Lightning finds it and uses it
    rank, world = dist.get_rank(), dist.get_world_size()
    specs = {"mlp": lambda: mlp_spec(*args.mlp_shape), "llama": lambda: llama_spec(*args.llama_shape, args.llama)}
    rows: list[Row] = []
    started = time.perf_counter()
    for model in args.models:
        spec = specs[model]()
        for strategy in args.strategies:
            for variant in args.variants:
                row = Row(spec.name, strategy, variant)
                if args.cpu and strategy == "fsdp":
                    row.skipped = "Lightning's FSDPStrategy requires a GPU accelerator"
                    rows.append(row)
                    continue
                try:
                    result: dict[str, Any] | None = run_row(args, spec, strategy, variant)
                except Exception as err:  # a row that fails is reported, and the others still run
                    result, row.error = None, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                results: list[Any] = [None] * world
                dist.all_gather_object(results, result)
                if row.error is None and any(r is None for r in results):
                    row.error = "failed on another rank"
                if row.error is None:
                    for key in ("peak_bytes", "step_ms", "pinned_bytes", "offloaded_bytes"):
                        setattr(row, key, [r[key] for r in results])
                    row.losses, row.digests = results[0]["losses"], [r["digest"] for r in results]
                rows.append(row)
                gc.collect()  # also what a failed row left behind
                if not args.cpu:
                    torch.cuda.empty_cache()
                release_host_memory()  # each row's pinned bytes are its own
                if rank == 0:
                    print(f"[{time.perf_counter() - started:6.1f} s] {row.model} {strategy} {variant}", flush=True)
    if rank == 0:
        meta.update(
            world=world, device=torch.cuda.get_device_name() if not args.cpu else "cpu", torch=torch.__version__
        )
        write(rows, args.out, meta)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
