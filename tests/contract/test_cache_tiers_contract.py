"""Contract tests every registered cache tier plugin must pass (built-in table and entry points).

A tier is constructed as ``Factory(ctx, options)`` with a budget, a directory
and a compatibility hash in its options (tiers ignore what they do not use).
A tier may refuse a block (``put`` -> False, as the ``gpu`` tier always does,
its blocks live in the KV pool); whatever it accepts it must hand back
byte-exact for the same key and tokens, and never for other tokens.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from ds4d.contracts import CacheEntry, DemotingCacheTier, PluginContext, ReadAheadCacheTier
from ds4d.registry import available

CTX = PluginContext(config=types.SimpleNamespace(device="cpu"), log=logging.getLogger("t"))
STATS_KEYS = {"bytes", "blocks", "budget_bytes", "evictions", "bytes_in", "bytes_out"}


def tiers(tmp_path):
    for name, spec in sorted(available("cache_tier").items()):
        yield name, spec.load()(CTX, {"budget_bytes": 4096, "directory": str(tmp_path / name),
                                      "compat_hash": b"contract"})


def as_bytes(payload) -> bytes:
    if isinstance(payload, torch.Tensor):
        return bytes(payload.reshape(-1).view(torch.uint8).numpy())
    return bytes(payload)


@pytest.mark.parametrize("payload_kind", ["bytes", "tensor"])
def test_put_get_exact_and_verified(tmp_path, payload_kind):
    data = bytes(range(256)) * 2
    payload = data if payload_kind == "bytes" else torch.frombuffer(bytearray(data), dtype=torch.uint8)
    for name, tier in tiers(tmp_path):
        assert tier.name == name
        key = bytes([7]) * 32
        if not tier.put(key, [1, 2, 3], payload):
            assert tier.get(key, [1, 2, 3]) is None
            continue
        assert tier.contains(key), name
        assert as_bytes(tier.get(key, [1, 2, 3])) == data, name
        assert tier.get(key, [1, 2, 4]) is None, name
        assert tier.get(bytes(32), [1, 2, 3]) is None, name
        s = tier.stats()
        assert STATS_KEYS <= set(s), name
        assert s["blocks"] == 1 and s["bytes"] >= len(data) and s["bytes_in"] >= len(data), name


def test_budget_and_evict(tmp_path):
    for name, tier in tiers(tmp_path):
        stored = [bytes([i]) * 32 for i in range(20) if tier.put(bytes([i]) * 32, [i], bytes([i]) * 1000)]
        s = tier.stats()
        assert STATS_KEYS <= set(s), name
        assert s["bytes"] <= s["budget_bytes"], name
        if not stored:
            continue
        assert tier.contains(stored[-1]), name   # the newest block is kept
        freed = tier.evict(10**9)
        assert freed == s["bytes"] and tier.stats()["blocks"] == 0, name
        assert tier.stats()["evictions"] >= len(stored), name
        if isinstance(tier, DemotingCacheTier):
            evicted = tier.take_evicted()
            assert all(isinstance(e, CacheEntry) for e in evicted)
            assert evicted[-1].key == stored[-1] and tier.take_evicted() == [], name
            tier.close()


def test_read_ahead_then_get_is_exact(tmp_path):
    data = bytes(range(256)) * 2
    for name, tier in tiers(tmp_path):
        if not isinstance(tier, ReadAheadCacheTier):
            continue
        key, other = bytes([7]) * 32, bytes([8]) * 32
        assert tier.read_ahead(key) is None, name            # unknown block: nothing to read
        if not (tier.put(key, [1, 2, 3], data) and tier.put(other, [4], data)):
            continue
        future = tier.read_ahead(key)
        if future is not None:
            future.result(30)
        assert as_bytes(tier.get(key, [1, 2, 3])) == data, name
        tier.read_ahead(other)
        tier.cancel_read(other)                              # dropped: get still answers, exactly
        assert as_bytes(tier.get(other, [4])) == data, name
        if isinstance(tier, DemotingCacheTier):
            tier.close()
