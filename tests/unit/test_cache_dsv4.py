"""Prefix reuse on a tiny DeepSeek-V4 through the engine: state checkpoints plus block copies.

``V4BlockCopy`` adds :class:`~ds4d.contracts.BlockCopyModel` around the V4 model
by copying each layer's compressed-KV (and lightning-indexer) pool rows of a
block; it is the reference for the model's own ``export_blocks`` /
``import_blocks``.  Greedy output of an agent's second turn must be the same
with reuse (checkpoint at the end of turn 1, blocks from the pool or RAM) as
computed from scratch.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from ds4d.cache.blocks import BlockPool
from ds4d.cache.manager import PrefixCache
from ds4d.cache.ram import RamTier
from ds4d.contracts import BlockCopyModel, PluginContext, StatefulModel
from ds4d.engine.core import EngineCore
from ds4d.engine.runner import ModelRunner
from ds4d.engine.sampler import Sampler
from ds4d.engine.scheduler import Scheduler
from ds4d.plugins.scheduler_fcfs import FcfsPolicy
from tests.unit.test_dsv4_model import _one_thread, _tokens, checkpoint, model  # noqa: F401 - fixtures
from tests.unit.test_engine import req, run


class V4BlockCopy:
    def __init__(self, v4) -> None:
        self.model = v4
        self.info = v4.info
        self.tokenizer = v4.tokenizer

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        self.model.allocate_cache(num_blocks, max_seqs)

    def forward(self, batch):
        return self.model.forward(batch)

    def save_state(self, slot):
        return self.model.save_state(slot)

    def load_state(self, slot, snapshot) -> None:
        self.model.load_state(slot, snapshot)

    def _pools(self) -> list[torch.Tensor]:
        out = []
        for layer in self.model.cache.layers:
            out += [s.pool for s in (layer.compressor, layer.indexer) if s is not None]
        return out

    def export_blocks(self, block_ids):
        index = torch.tensor(list(block_ids), dtype=torch.long)
        parts = [pool.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8) for pool in self._pools()]
        return [row.clone() for row in torch.cat(parts, dim=1)]

    def import_blocks(self, block_ids, payloads) -> None:
        index = torch.tensor(list(block_ids), dtype=torch.long)
        rows = torch.stack([p if isinstance(p, torch.Tensor) else torch.frombuffer(bytearray(p), dtype=torch.uint8)
                            for p in payloads])
        offset = 0
        for pool in self._pools():
            width = pool[0].numel() * pool.element_size()
            values = rows[:, offset:offset + width].contiguous().view(pool.dtype).view(len(block_ids), *pool.shape[1:])
            pool.index_copy_(0, index, values)
            offset += width


def engine(v4, *, num_blocks=12, ram_blocks=0, prefix=True):
    wrapped = V4BlockCopy(v4)
    assert isinstance(wrapped, StatefulModel) and isinstance(wrapped, BlockCopyModel)
    wrapped.allocate_cache(num_blocks, 2)
    info = v4.info
    pool = BlockPool(num_blocks, info.block_size_tokens, prefix_caching=prefix)
    tiers = [RamTier(None, {"budget_bytes": ram_blocks * info.cache_bytes_per_block})] if ram_blocks else []
    cache = PrefixCache(pool, tiers=tiers, model=wrapped, block_bytes=info.cache_bytes_per_block)
    policy = FcfsPolicy(PluginContext(types.SimpleNamespace(), logging.getLogger("t")), {})
    sched = Scheduler(pool, policy, max_num_seqs=2, step_tokens=512, prefill_chunk=512, namespace=b"v4",
                      cache=cache)
    outputs = []
    return EngineCore(sched, ModelRunner(wrapped, Sampler()), frozenset(), publish=outputs.extend), outputs


def serve(core, outputs, rid, prompt, n):
    outputs.clear()
    tokens, _, _ = run(core, outputs, [req(rid, prompt, n)])
    final = [o for o in outputs if o.request_id == rid][-1]
    return tokens[rid], final.cached_tokens, dict(final.cached_by_tier)


@pytest.mark.parametrize("ram_blocks", [0, 8])
def test_agent_second_turn_on_v4_equals_recompute(model, ram_blocks):  # noqa: F811
    turn1 = _tokens(model, 200, 60)
    core, outputs = engine(model, num_blocks=5 if ram_blocks else 12, ram_blocks=ram_blocks)
    gen1, cached1, _ = serve(core, outputs, "t1", turn1, 6)
    assert cached1 == 0
    if ram_blocks:
        serve(core, outputs, "other", _tokens(model, 580, 61), 2)   # 5 blocks: pushes turn 1's block to RAM
    turn2 = turn1 + gen1 + _tokens(model, 40, 62)
    gen2, cached2, by_tier = serve(core, outputs, "t2", turn2, 6)
    assert cached2 == len(turn1) + len(gen1) - 1
    if ram_blocks:
        assert by_tier.get("ram") == 128, by_tier

    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", turn2, 6)[0] == gen2
