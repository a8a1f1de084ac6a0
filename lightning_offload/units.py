"""Byte units shared by every module (a module of its own, so none imports another only for them)."""

from __future__ import annotations

MiB = 1 << 20
GiB = 1 << 30
