"""A small decoder-only transformer, a LightningModule for it and synthetic token data: nothing to download.

Shared by the examples (``cli.py``, ``train_transformer.py``, ``plain_pytorch.py``). The model is plain PyTorch
(:class:`DecoderOnlyTransformer`); :class:`DemoTransformer` trains it with next-token prediction, and
:class:`SyntheticTokens` feeds it random sequences with a learnable pattern (each token is a fixed function of the
one before it, with noise), so the loss falls and a run shows that training works.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["DecoderOnlyTransformer", "DemoTransformer", "SyntheticTokens"]


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention (SDPA) and a GELU MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class DecoderOnlyTransformer(nn.Module):
    """GPT-style language model: token and position embeddings, ``layers`` blocks, a tied output head.

    Args:
        vocab_size: number of token ids.
        dim: model width.
        layers: number of decoder blocks.
        heads: attention heads (must divide ``dim``).
        max_seq_len: longest sequence the position embedding covers.
    """

    def __init__(self, vocab_size: int, dim: int, layers: int, heads: int, max_seq_len: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"DecoderOnlyTransformer(dim={dim}, heads={heads}): heads must divide dim")
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(max_seq_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.embed.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class DemoTransformer(pl.LightningModule):
    """Next-token prediction with :class:`DecoderOnlyTransformer` and AdamW.

    Args:
        vocab_size: number of token ids (match the data's).
        dim: model width.
        layers: number of decoder blocks.
        heads: attention heads.
        max_seq_len: longest sequence the model accepts.
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        vocab_size: int = 1024,
        dim: int = 256,
        layers: int = 4,
        heads: int = 4,
        max_seq_len: int = 512,
        lr: float = 3e-4,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = DecoderOnlyTransformer(vocab_size, dim, layers, heads, max_seq_len)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class _TokenSequences(Dataset):
    """``size`` sequences where token ``i+1`` is ``(5 * token_i + 3) % vocab`` 90% of the time."""

    def __init__(self, size: int, seq_len: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(vocab_size, (size, 1), generator=generator)
        tokens = torch.empty(size, seq_len, dtype=torch.long)
        tokens[:, 0] = start[:, 0]
        for t in range(1, seq_len):
            tokens[:, t] = (5 * tokens[:, t - 1] + 3) % vocab_size
        noise = torch.rand(size, seq_len, generator=generator) < 0.1
        tokens[noise] = torch.randint(vocab_size, (int(noise.sum()),), generator=generator)
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


class SyntheticTokens(pl.LightningDataModule):
    """Random token sequences with a learnable next-token pattern; generated in memory, no downloads.

    Args:
        vocab_size: number of token ids (match the model's).
        seq_len: tokens per sample (the model sees ``seq_len - 1`` and predicts the next of each).
        batch_size: samples per batch.
        num_samples: samples per epoch.
        seed: seed of the generator, so every process builds the same data.
    """

    def __init__(
        self,
        vocab_size: int = 1024,
        seq_len: int = 257,
        batch_size: int = 8,
        num_samples: int = 256,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.seed = seed
        self._train: Dataset | None = None

    def setup(self, stage: str) -> None:
        if self._train is None:
            self._train = _TokenSequences(self.num_samples, self.seq_len, self.vocab_size, self.seed)

    def train_dataloader(self) -> DataLoader:
        if self._train is None:
            self.setup("fit")
        return DataLoader(self._train, batch_size=self.batch_size, shuffle=True, drop_last=True)


def parameter_count(module: nn.Module) -> str:
    """A human-readable parameter count, e.g. ``"12.6M"``."""
    count = sum(p.numel() for p in module.parameters())
    return f"{count / 1e6:.1f}M" if count >= 1e5 else f"{count / 1e3:.1f}K" if count else "0"


def quiet_lightning() -> None:
    """Keep the examples' output to what they print: no Lightning banners, no version-skew deprecation notes."""
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*litlogger.*")
