"""The ``ram`` cache tier: blocks in host memory under a byte budget, LRU.

With CUDA present each block lives in pinned (page-locked) memory, so a
promotion is one asynchronous host-to-device copy; torch's caching host
allocator recycles the pinned buffers of evicted blocks.  On the CPU it is
plain memory.  What the tier evicts is handed to the next tier (disk) through
:meth:`RamTier.take_evicted`; when host MemAvailable falls below the
watermark, the tier manager sheds it (``evict``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds4d.cache.tiers import option, payload_nbytes, payload_view
from ds4d.config import GIB
from ds4d.contracts import CacheEntry


class RamTier:
    name = "ram"

    def __init__(self, ctx: Any, options: Mapping[str, Any]) -> None:
        if "budget_bytes" in options:
            self.budget_bytes = int(options["budget_bytes"])
        else:
            self.budget_bytes = int(float(option(ctx, options, "budget_gib", "cache_ram_gib", 0.0)) * GIB)
        device = str(option(ctx, options, "device", "device", "cpu"))
        self.pin_memory = bool(options.get("pin_memory", device.startswith("cuda") and torch.cuda.is_available()))
        self._entries: OrderedDict[bytes, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self._evicted: list[CacheEntry] = []
        self.bytes = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.evictions = 0

    def put(self, key: bytes, token_ids: Sequence[int], payload: Any) -> bool:
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        size = payload_nbytes(payload)
        if size > self.budget_bytes:
            return False
        if self.bytes + size > self.budget_bytes:
            self.evict(self.bytes + size - self.budget_bytes)
        copy = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        if isinstance(payload, torch.Tensor):
            copy.copy_(payload.reshape(-1).view(torch.uint8))
        else:
            copy.copy_(torch.frombuffer(bytearray(payload_view(payload)), dtype=torch.uint8))
        self._entries[key] = (tuple(token_ids), copy)
        self.bytes += size
        self.bytes_in += size
        return True

    def get(self, key: bytes, token_ids: Sequence[int]) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None or entry[0] != tuple(token_ids):
            return None
        self._entries.move_to_end(key)
        self.bytes_out += entry[1].numel()
        return entry[1]

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def evict(self, nbytes: int) -> int:
        freed = 0
        while freed < nbytes and self._entries:
            key, (tokens, data) = self._entries.popitem(last=False)
            freed += data.numel()
            self.bytes -= data.numel()
            self.evictions += 1
            self._evicted.append(CacheEntry(key, tokens, data))
        return freed

    def take_evicted(self) -> list[CacheEntry]:
        out, self._evicted = self._evicted, []
        return out

    def entries(self) -> list[CacheEntry]:
        return [CacheEntry(k, t, d) for k, (t, d) in self._entries.items()]

    def close(self) -> None:
        self._entries.clear()
        self._evicted.clear()
        self.bytes = 0

    def stats(self) -> Mapping[str, Any]:
        return {"bytes": self.bytes, "blocks": len(self._entries), "budget_bytes": self.budget_bytes,
                "evictions": self.evictions, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "pinned": self.pin_memory, "persistent": False}
