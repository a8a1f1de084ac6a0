"""The rows of ``tests/gpu/multi_gpu.py``: ratios, bit-exactness, one table and the JSON file."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GiB = 1 << 30


@dataclass
class Row:
    """One model x strategy x variant; the lists hold one value per rank."""

    model: str
    strategy: str
    variant: str
    peak_bytes: list[int] = field(default_factory=list)  # torch.cuda.max_memory_allocated (0 on the CPU)
    step_ms: list[float] = field(default_factory=list)  # median after the warm-up steps
    pinned_bytes: list[int] = field(default_factory=list)  # the callback's host pool (0 without the callback)
    offloaded_bytes: list[int] = field(default_factory=list)  # in the last step
    losses: list[float] = field(default_factory=list)  # rank zero's
    digests: list[str] = field(default_factory=list)
    exact: bool | None = None  # parameters bit-equal to ``none`` on every rank (fp32 rows: deterministic kernels)
    vs_none: float | None = None
    vs_ac: float | None = None
    error: str | None = None
    skipped: str | None = None


def finish(rows: list[Row]) -> None:
    """Ratios against ``none`` and ``ac`` (slowest rank) and bit-exactness against ``none``, per model and strategy."""
    by_key = {(r.model, r.strategy, r.variant): r for r in rows if r.step_ms}
    for row in rows:
        if not row.step_ms:
            continue
        for attr, base in (("vs_none", "none"), ("vs_ac", "ac")):
            ref = by_key.get((row.model, row.strategy, base))
            if ref is not None and ref is not row:
                setattr(row, attr, round(max(row.step_ms) / max(ref.step_ms), 3))
        ref = by_key.get((row.model, row.strategy, "none"))
        if ref is not None and ref is not row:
            row.exact = row.digests == ref.digests


def table(rows: list[Row]) -> str:
    """One line per row: per-rank values joined by ``/``; a failed or skipped row says why instead."""

    def gib(values: list[int]) -> str:
        return "/".join(f"{v / GiB:.2f}" for v in values) or "-"

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    head = ("model", "strategy", "variant", "peak GiB/rank", "step ms", "x none", "x ac", "pinned GiB/rank",
            "offl GiB/rank", "exact")  # fmt: skip
    lines = [head]
    for r in rows:
        if not r.step_ms:
            lines.append(
                (r.model, r.strategy, r.variant, f"SKIPPED: {r.skipped}" if r.skipped else f"ERROR: {r.error}")
            )
            continue
        exact = "-" if r.exact is None else ("yes" if r.exact else "NO")
        lines.append((r.model, r.strategy, r.variant, gib(r.peak_bytes), f"{max(r.step_ms):.1f}", num(r.vs_none),
                      num(r.vs_ac), gib(r.pinned_bytes), gib(r.offloaded_bytes), exact))  # fmt: skip
    widths = [max(len(line[i]) for line in lines if len(line) > i and len(line) == len(head)) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)) for line in lines)


def write(rows: list[Row], out: Path, meta: dict[str, Any]) -> str:
    """Fill in the ratios and ``exact``, write ``{**meta, "rows": [...]}`` to ``out``, print and return the table."""
    finish(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))
    text = table(rows)
    print(text, flush=True)
    return text


def dry_rows(models: Iterable[str], strategies: Iterable[str], variants: Iterable[str]) -> list[Row]:
    """Made-up rows in the shape of a real run (two ranks; every fifth row failed), for the formatting alone."""
    rows = []
    for i, (model, strategy, variant) in enumerate((m, s, v) for m in models for s in strategies for v in variants):
        row = Row(model, strategy, variant)
        if i % 5 == 4:
            row.error = "RuntimeError: made-up failure"
        else:
            row.peak_bytes, row.step_ms = [(8 + i % 5) * GiB, (9 + i % 5) * GiB], [100.0 + i, 101.0 + i]
            row.pinned_bytes = row.offloaded_bytes = [GiB * ("offload" in variant)] * 2
            row.losses, row.digests = [1.0], ["same", "same"]
        rows.append(row)
    return rows
