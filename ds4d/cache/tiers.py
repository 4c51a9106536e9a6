"""Shared helpers of the cache tiers, and the ``gpu`` tier (the KV pool's own LRU).

The ``gpu`` tier stores nothing itself: unreferenced, hashed blocks stay in the
KV pool (:class:`~ds4d.cache.blocks.BlockPool`) until a new allocation evicts
them, least recently used first.  Naming it as a tier lets the config list the
chain (``cache_tiers = ["gpu", "ram", "disk"]``) and the stats report it like
the others.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ds4d.cache.blocks import BlockPool


def payload_nbytes(payload: Any) -> int:
    if isinstance(payload, torch.Tensor):
        return payload.numel() * payload.element_size()
    return len(payload)


def payload_view(payload: Any) -> memoryview:
    """The payload's bytes without a copy (CPU tensors and bytes-likes)."""
    if isinstance(payload, torch.Tensor):
        return memoryview(payload.contiguous().view(torch.uint8).numpy())
    return memoryview(payload).cast("B")


def replace_file(path: Path, write: Callable[[Path], None], what: str, log: logging.Logger) -> bool:
    """``write`` a temporary file next to ``path``, then rename it over ``path``: readers see the old
    file or the new one, never part of one.  On an OS error: logged, the temporary file removed, False."""
    tmp = path.with_suffix(".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cannot write %s to %s: %s", what, path, exc)
        tmp.unlink(missing_ok=True)
        return False
    return True


def option(ctx: Any, options: Mapping[str, Any], name: str, knob: str, default: Any) -> Any:
    """A tier option: the plugin table first, then the config knob, then ``default``."""
    if name in options:
        return options[name]
    return getattr(getattr(ctx, "config", None), knob, default)


class GpuTier:
    """The KV pool's unreferenced blocks, evicted least recently used first."""

    name = "gpu"

    def __init__(self, ctx: Any, options: Mapping[str, Any]) -> None:
        self.pool: BlockPool | None = None
        self.block_bytes = 0

    def bind(self, pool: BlockPool, block_bytes: int) -> None:
        self.pool = pool
        self.block_bytes = block_bytes

    def put(self, key: bytes, token_ids: Sequence[int], payload: Any) -> bool:
        return False  # blocks enter this tier by being computed in the pool

    def get(self, key: bytes, token_ids: Sequence[int]) -> Any | None:
        return None  # hits are shared in place (BlockPool.match)

    def contains(self, key: bytes) -> bool:
        return self.pool is not None and self.pool.has_key(key)

    def evict(self, nbytes: int) -> int:
        if self.pool is None or self.block_bytes <= 0:
            return 0
        return self.pool.evict_cached(-(-nbytes // self.block_bytes)) * self.block_bytes

    def stats(self) -> Mapping[str, Any]:
        cached = self.pool.num_cached if self.pool is not None else 0
        return {"bytes": cached * self.block_bytes, "blocks": cached,
                "budget_bytes": (self.pool.num_blocks if self.pool else 0) * self.block_bytes,
                "evictions": self.pool.evictions if self.pool else 0, "bytes_in": 0, "bytes_out": 0}
