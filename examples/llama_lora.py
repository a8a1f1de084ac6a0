"""LoRA fine-tuning of a randomly initialised Llama (transformers + peft) with activation offloading.

Nothing is downloaded: the model is built from a config with random weights, the data are random tokens. By default
this is a CPU smoke run with a tiny Llama (``compute_device="cpu"``); on a GPU pick a real shape with ``--preset``.
Needs the ``examples`` extra: ``pip install -e ".[examples]"``.

Examples::

    python examples/llama_lora.py                                     # tiny, CPU, a few steps
    python examples/llama_lora.py --preset llama8b                    # Llama-3-8B shape, LoRA r16, 1 x 8192 tokens
    python examples/llama_lora.py --preset llama8b --checkpoint auto  # offload only each decoder layer's input
    python examples/llama_lora.py --preset llama1b --mode off         # measure without offloading
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model import SyntheticTokens, quiet_lightning

from lightning_offload import ActivationOffloadCallback

GiB = 1 << 30

# Shapes of the reference benchmark workloads (random init). seq/batch are the defaults for each preset.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "seq": 128,
        "batch": 2,
    },
    "llama1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "seq": 4096,
        "batch": 2,
    },
    "llama8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "seq": 8192,
        "batch": 1,
    },
}


class LlamaLoRA(pl.LightningModule):
    """Causal-LM loss of a PEFT-wrapped Hugging Face model; only the LoRA weights train.

    Args:
        model: a ``peft.PeftModel`` around a causal LM.
        lr: AdamW learning rate.
    """

    def __init__(self, model: torch.nn.Module, lr: float = 1e-4) -> None:
        super().__init__()
        self.model = model
        self.lr = lr

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch, use_cache=False).loss  # no KV cache in training
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=self.lr)


def build_model(preset: str, rank: int, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init Llama of ``preset``'s shape with LoRA adapters on every linear layer (not the LM head)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = {k: v for k, v in PRESETS[preset].items() if k not in ("seq", "batch")}
    config = LlamaConfig(**shape, max_position_embeddings=max(PRESETS[preset]["seq"], 256))
    config._attn_implementation = "sdpa"
    # Build directly on the device in the training dtype: an 8B model in fp32 on the host would need 32 GB.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)
    return get_peft_model(model, lora)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Fine-tune for a few steps; returns the callback's figures from ``trainer.callback_metrics``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="GPU default llama1b; CPU: tiny")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sample (default: the preset's)")
    parser.add_argument("--batch", type=int, default=None, help="samples per batch (default: the preset's)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--mode", choices=["streamed", "sync", "off"], default="streamed")
    parser.add_argument("--checkpoint", default=None, help="also checkpoint the decoder layers: 'auto'")
    parser.add_argument("--max-offload-gib", type=float, default=None)
    parser.add_argument("--memory-picture", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is present")
    parser.add_argument("--log-dir", default="lightning_logs")
    args = parser.parse_args(argv)
    quiet_lightning()
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

    gpu = torch.cuda.is_available() and not args.cpu
    preset = args.preset or ("llama1b" if gpu else "tiny")
    if not gpu and preset != "tiny":
        parser.error(f"--preset {preset} needs a GPU; use --preset tiny on the CPU")
    seq = args.seq or PRESETS[preset]["seq"]
    batch = args.batch or PRESETS[preset]["batch"]
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32

    pl.seed_everything(0, verbose=False)
    peft_model = build_model(preset, args.rank, device, dtype)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    print(f"{preset}: {total / 1e6:.1f}M parameters, {trainable / 1e6:.2f}M trainable (LoRA r{args.rank})")

    options: dict[str, Any] = {"mode": args.mode, "checkpoint": args.checkpoint, "memory_picture": args.memory_picture}
    if args.max_offload_gib is not None:
        options["max_offload_bytes"] = int(args.max_offload_gib * GiB)
    if not gpu:
        options.update(compute_device="cpu", min_tensor_bytes=16 << 10, resident_tail_bytes=0)
    callback = ActivationOffloadCallback(**options)
    data = SyntheticTokens(
        vocab_size=PRESETS[preset]["vocab_size"], seq_len=seq, batch_size=batch, num_samples=batch * args.steps
    )
    trainer = pl.Trainer(
        accelerator="gpu" if gpu else "cpu",
        devices=1,
        max_epochs=1,
        precision="bf16-true" if gpu else "32-true",
        logger=pl.loggers.CSVLogger(args.log_dir, name=f"llama_lora_{preset}"),
        callbacks=[callback],
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
    )
    trainer.fit(LlamaLoRA(peft_model), datamodule=data)

    metrics = trainer.callback_metrics
    figures = {k: float(v) for k, v in metrics.items() if k.startswith("offload/") or k == "train_loss"}
    print(f"mode {args.mode!r}, checkpoint {args.checkpoint!r}, {batch} x {seq} tokens, {args.steps} steps")
    print(f"offloaded per step: {figures.get('offload/offloaded_gib_epoch_mean', 0.0):.4f} GiB")
    if gpu:
        print(f"peak allocated: {figures.get('offload/peak_allocated_gib_epoch_max', float('nan')):.2f} GiB")
        if "offload/stall_ms_epoch_mean" in figures:
            print(f"mean stall waiting for copies back: {figures['offload/stall_ms_epoch_mean']:.1f} ms per step")
    else:
        print("peak allocated: CUDA peaks do not exist on the CPU")
    return figures


if __name__ == "__main__":
    main()
