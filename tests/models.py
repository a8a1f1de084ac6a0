"""Small CPU models for the engine tests, each stressing one way autograd saves tensors.

Every model takes the batch built by its ``make_batch`` and returns a scalar loss. Sizes are tiny: the tests
compare gradients bit for bit, so what matters is the variety of saved tensors, not their size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_offload import OffloadEngine, offload_activations


class MLP(nn.Module):
    """Linear / GELU / LayerNorm / ReLU stack: saves inputs, outputs and norm statistics."""

    def __init__(self, width: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(F.gelu(self.fc1(x)))
        h = torch.relu(self.fc2(h))
        return self.fc3(h).pow(2).mean()


class Mix(nn.Module):
    """A block's part that saves more than its input: a hidden layer ``expansion`` times as wide, and tanh's output (as
    attention and MLP do)."""

    def __init__(self, width: int, expansion: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, expansion * width)
        self.down = nn.Linear(expansion * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Attention(nn.Module):
    """Causal self-attention from one fused qkv projection, by SDPA or by an explicit softmax."""

    def __init__(self, dim: int, heads: int, kind: str) -> None:
        super().__init__()
        self.heads, self.kind = heads, kind
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (y.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        if self.kind == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool).triu(1)
            y = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class TinyTransformer(nn.Module):
    """Pre-norm transformer blocks (attention + MLP) over token embeddings."""

    def __init__(self, kind: str, vocab: int = 50, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(
                nn.ModuleDict(
                    {
                        "ln1": nn.LayerNorm(dim),
                        "attn": Attention(dim, heads, kind),
                        "ln2": nn.LayerNorm(dim),
                        "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
                    }
                )
            )
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block["attn"](block["ln1"](h))
            h = h + block["mlp"](block["ln2"](h))
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class LengthBlock(nn.Module):
    """A pre-norm transformer block (causal SDPA attention, GELU MLP) whose parts the planner can checkpoint apart;
    ``sim`` (a :class:`~lightning_offload.streams.SimulatedStreams`) takes ``ms`` of simulated compute per forward.
    ``dropout``: on the output of the attention and of the MLP (none at 0)."""

    def __init__(self, dim: int, heads: int, sim: Any = None, ms: float = 2.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads, "sdpa")
        self.ln2, self.mlp = (
            nn.LayerNorm(dim),
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)),
        )
        self.drop: nn.Module = nn.Dropout(dropout) if dropout else nn.Identity()
        self.sim, self.ms = sim, ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sim is not None:
            self.sim.advance(self.ms)
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class LengthLM(nn.Module):
    """A small causal language model for inputs whose sequence length changes: token embedding, ``layers``
    :class:`LengthBlock`, a head and next-token cross entropy. Its weights are fixed by a seed, so every build is
    identical; ``sim`` times its blocks (and 1 ms for the loss) on a simulated clock."""

    def __init__(
        self,
        sim: Any = None,
        vocab: int = 128,
        dim: int = 64,
        heads: int = 4,
        layers: int = 6,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(LengthBlock(dim, heads, sim, dropout=dropout) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)
        self.sim = sim

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        if self.sim is not None:
            self.sim.advance(1.0)
        logits = self.head(self.ln_f(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def length_tokens(length: int, batch: int = 2, vocab: int = 128) -> torch.Tensor:
    """A batch of ``length`` tokens per row for :class:`LengthLM`, the same for the same length."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(length))


def sgd_update_recorded(model: nn.Module, optimizer: torch.optim.Optimizer, out: dict[str, list[Any]]) -> None:
    """After a backward: note each parameter's gradient in ``out["grads"]``, step ``optimizer`` and note the weights
    after the update in ``out["weights"]`` (the tests of lengths that change compare both with plain training)."""
    out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
    optimizer.step()
    out["weights"].append({n: p.detach().clone() for n, p in model.named_parameters()})


class ViewsModel(nn.Module):
    """Saves transposes, strided slices, expands, permutes and chunk/split views of one projection."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 3 * dim)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj(x)  # (b, t, 3d)
        a, b, c = p.chunk(3, dim=-1)
        s1, s2 = p.split([p.shape[-1] // 3, 2 * p.shape[-1] // 3], dim=-1)
        t = a.transpose(-2, -1)  # non-contiguous
        m = torch.tanh(t) @ b  # saves tanh(t) output and b (a strided view)
        strided = c[:, ::2] * s1[:, 1::2]  # both strided views of p
        row = self.gain.unsqueeze(0).unsqueeze(0)
        expanded = torch.sigmoid(a[:, :1]).expand(-1, c.shape[1], -1)  # stride-0 expand of an output
        e = expanded * c * row
        perm = s2.permute(2, 0, 1)  # (2d, b, t)
        q = torch.sin(perm.contiguous().permute(1, 2, 0))  # saves a permuted view
        return m.square().mean() + strided.square().mean() + e.square().mean() + (q * s2).mean()


class InplaceModel(nn.Module):
    """Legal in-place ops: relu_, add_, mul_, sigmoid_ on non-leaf activations."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.bias = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h.add_(self.bias)  # saves nothing
        h.relu_()  # saves its output (version 2)
        g = self.fc2(h)  # saves h again: same storage, same version
        g.mul_(2.0)  # saves nothing
        g.sigmoid_()  # saves its output
        return (g * h).sum()


class TiedLM(nn.Module):
    """Embedding tied to the output projection: the weight is saved through ``weight.t()``."""

    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(self.norm(self.embed(tokens))))
        logits = h @ self.embed.weight.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.roll(1, dims=-1).reshape(-1))


class DropoutModel(nn.Module):
    """Dropout masks are saved activations; the test reseeds the RNG before each run."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 64)
        self.drop = nn.Dropout(0.3)
        self.fc2 = nn.Linear(64, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(F.gelu(self.fc1(x)))).square().mean()


class CheckpointModel(nn.Module):
    """A non-reentrant checkpointed block between two plain layers."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.pre = nn.Linear(dim, dim)
        self.block = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, dim))
        self.post = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.pre(x))
        h = checkpoint(self.block, h, use_reentrant=False)
        return self.post(torch.relu(h)).square().mean()


class Swish(torch.autograd.Function):
    """``x * sigmoid(x)`` saving its input and its output with ``ctx.save_for_backward``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.sigmoid(x)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x, y = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * (s + y * (1 - s))


class CustomFunctionModel(nn.Module):
    """Two layers joined by a custom autograd Function."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 48)
        self.fc2 = nn.Linear(48, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(Swish.apply(self.fc1(x))).square().mean()


@dataclass(frozen=True)
class Case:
    """A model factory and the batch it trains on."""

    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[], torch.Tensor]


def _floats(*shape: int) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        return torch.randn(*shape, generator=torch.Generator().manual_seed(1234))

    return make


def _tokens(vocab: int, *shape: int) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(1234))

    return make


CASES: list[Case] = [
    Case("mlp", MLP, _floats(8, 32)),
    Case("transformer_sdpa", lambda: TinyTransformer("sdpa"), _tokens(50, 2, 12)),
    Case("transformer_manual", lambda: TinyTransformer("manual"), _tokens(50, 2, 12)),
    Case("views", ViewsModel, _floats(2, 10, 24)),
    Case("inplace", InplaceModel, _floats(8, 32)),
    Case("tied", TiedLM, _tokens(40, 3, 10)),
    Case("dropout", DropoutModel, _floats(8, 32)),
    Case("checkpoint", CheckpointModel, _floats(8, 32)),
    Case("custom_function", CustomFunctionModel, _floats(8, 32)),
]


def build(case: Case) -> nn.Module:
    """The case's model with weights fixed by a seed, so every build is identical."""
    torch.manual_seed(0)
    return case.build()


# ---------------------------------------------------------------------------------------------- step helpers


def top_hooks() -> object:
    """The innermost default saved-tensor hooks of this thread, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def make_engine(**kwargs: Any) -> OffloadEngine:
    """A CPU test engine that offloads everything eligible unless ``kwargs`` say otherwise."""
    options: dict[str, Any] = {
        "compute_device": "cpu",
        "min_tensor_bytes": 0,
        "resident_tail_bytes": 0,
        "mode": "sync",
    }
    options.update(kwargs)
    return offload_activations(**options)


def train_step(
    model: nn.Module, batch: torch.Tensor, engine: OffloadEngine | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """One forward (inside ``engine`` when given) and backward; returns copies of the parameters' grads."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    if engine is None:
        loss = model(batch)
    else:
        with engine:
            loss = model(batch)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Bit-for-bit equality of two grad dicts (same names, same dtypes, same values)."""
    assert actual.keys() == expected.keys()
    assert expected, "no gradients to compare"
    for name, want in expected.items():
        got = actual[name]
        assert got.dtype == want.dtype, name
        assert torch.equal(got, want), f"{name}: max abs diff {(got - want).abs().max().item()}"


class Probe(torch.autograd.Function):
    """Saves ``tensors`` for backward; backward appends what autograd hands back to ``log``.

    ``anchor`` (a leaf that requires grad) makes backward run even when no saved tensor requires grad.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, log: list[torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        ctx.log = log
        return anchor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        ctx.log.extend(saved)
        return (grad, None, *([None] * len(saved)))


def probe(tensors: list[torch.Tensor], engine: OffloadEngine) -> list[torch.Tensor]:
    """Save ``tensors`` through ``engine`` and return them as backward sees them."""
    anchor = torch.zeros((), requires_grad=True)
    log: list[torch.Tensor] = []
    with engine:
        out = Probe.apply(anchor, log, *tensors)
    out.backward()
    assert len(log) == len(tensors)
    return log


def tanh_chain(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` nested tanh: each saves its own output, so the saved tensors are exactly the returned ones."""
    outs = []
    h = x
    for _ in range(n):
        h = torch.tanh(h)
        outs.append(h)
    return outs


def assert_inplace_error_or_exact_grad(loss: torch.Tensor, leaf: torch.Tensor, expected: torch.Tensor) -> None:
    """Backward through a graph whose saved tensor was changed in place: autograd's in-place error, or exactly the
    gradient of the unchanged values in ``leaf.grad``; never a silently wrong gradient."""
    try:
        loss.backward()
    except RuntimeError as err:
        assert "modified by an inplace operation" in str(err)
    else:
        assert torch.equal(leaf.grad, expected), "backward silently used an in-place-modified saved tensor"


def tiny_llama_config(**changes: Any) -> Any:
    """A random-init-sized Hugging Face ``LlamaConfig`` (hidden 64, 3 layers, 4 heads of which 2 for keys and values,
    vocabulary 128); ``changes`` override its fields. Needs ``transformers``."""
    import transformers

    values: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "max_position_embeddings": 256,
    }
    return transformers.LlamaConfig(**{**values, **changes})
