"""The GPU memory plan: its arithmetic, and the daemon's build sizing the KV pool to fit it.

The device is a stand-in (:class:`FakeMemory`) that answers as ``torch.cuda``
would: bytes allocated, a peak that the profiling step raises, the device's
total.  The model is the toy model on the CPU, so the profiling step is a real
forward through the same contract a GPU model serves.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from ds4d.config import load_config
from ds4d.engine.memory_plan import (
    GRAPH_RESERVE_BYTES,
    GpuMemoryPlan,
    MemoryPlanError,
    profile_activations,
    step_chunks,
)
from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.kernel import Kernel, LoadedModel
from tests.toy_model import ToyModel

GIB = 1 << 30


class FakeMemory:
    """Weights take ``weights`` bytes; a forward raises the peak by ``step`` bytes over what is allocated."""

    def __init__(self, total: int, weights: int, step: int, model: ToyModel) -> None:
        self.total_bytes, self.weights, self.step, self.model = total, weights, step, model
        self.forwards_seen = 0
        self.peak_bytes = 0

    def total(self) -> int:
        return self.total_bytes

    def allocated(self) -> int:
        cache = self.model.pool.numel() * 8 if getattr(self.model, "pool", None) is not None else 0
        return self.weights + cache

    def reset_peak(self) -> None:
        self.forwards_seen = self.model.forwards
        self.peak_bytes = self.allocated()

    def peak(self) -> int:
        return self.peak_bytes + self.step * (self.model.forwards - self.forwards_seen)


class QuietMemory:
    """A device with no allocator peak to read (the CPU): the profiling step runs, its peak is 0."""

    def total(self) -> int:
        return GIB

    def allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return 0


class CountingToy(ToyModel):
    """Counts its forwards; its cache reads unwritten slots as token 0, as a GPU pool reads whatever
    it holds (the profiling step attends over a context nobody wrote)."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0
        self.fed: list[int] = []
        self.batches = []

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        super().allocate_cache(num_blocks, max_seqs)
        self.pool.zero_()

    def forward(self, batch):
        self.forwards += 1
        self.fed.append(sum(len(chunk.token_ids) for chunk in batch.chunks))
        self.batches.append(batch)
        return super().forward(batch)


def test_plan_arithmetic_and_refusals():
    plan = GpuMemoryPlan("cuda:0", total=100 * GIB, utilization=0.9, weights=60 * GIB, activations=5 * GIB,
                         profiled=(4096, 4096))
    assert plan.kv_budget == 90 * GIB - 65 * GIB - GRAPH_RESERVE_BYTES
    block = 1 << 20  # 1 MiB per 256-token block
    fits = (plan.kv_budget - GIB) // block * 256
    assert plan.pool_tokens(1000, block_bytes=block, block_tokens=256, state_bytes=GIB, explicit=True) == 1000
    assert plan.pool_tokens(10**9, block_bytes=block, block_tokens=256, state_bytes=GIB, explicit=False) == fits
    with pytest.raises(MemoryPlanError, match="lower kv_cache_tokens"):
        plan.pool_tokens(10**9, block_bytes=block, block_tokens=256, state_bytes=GIB, explicit=True)
    full = GpuMemoryPlan("cuda:0", total=100 * GIB, utilization=0.5, weights=60 * GIB, activations=0,
                         profiled=(1,))
    assert full.kv_budget == 0
    with pytest.raises(MemoryPlanError, match="raise gpu_memory_utilization"):
        full.pool_tokens(256, block_bytes=block, block_tokens=256, state_bytes=0, explicit=False)
    lines = plan.lines()
    assert lines[0].startswith("GPU memory plan on cuda:0: 100.0 GiB, 90% planned")
    assert any("activations (peak of a step of 2 x 4096 tokens)" in line and "5.00 GiB" in line for line in lines)


def test_profiling_step_feeds_the_largest_step_and_measures_its_peak():
    assert step_chunks(8192, 4096, 16, 10**6) == [4096, 4096]
    assert step_chunks(8192, 4096, 16, 1000) == [1000] * 8 + [192]  # no chunk longer than the context
    assert step_chunks(100, 30, 2, 10**6) == [30, 30]  # at most max_num_seqs sequences
    model = CountingToy()
    memory = FakeMemory(total=GIB, weights=1000, step=777, model=model)
    assert profile_activations(model, model.info, [50, 7], memory, [50]) == 777
    assert model.fed == [57] and model.pool.shape[0] == 1 + 13 + 3  # the shared block, positions 0..49, positions 43..49
    # each chunk is the end of a context-token prompt: the blocks before its own are the shared block 0
    assert profile_activations(model, model.info, [50, 7], memory, [1001]) == 777
    long, short = model.batches[-1].chunks
    assert (long.start_pos, short.start_pos) == (951, 994)
    assert long.block_ids == (0,) * 237 + tuple(range(1, 15))  # positions 951..1000: blocks 237..250
    assert short.block_ids == (0,) * 248 + (15, 16, 17)  # positions 994..1000: blocks 248..250
    assert model.pool.shape[0] == 18
    # several probe contexts: one step at the end of each, the largest peak counts
    model = CountingToy()
    memory = FakeMemory(total=GIB, weights=1000, step=777, model=model)
    assert profile_activations(model, model.info, [50], memory, [60, 900]) == 777
    assert [b.chunks[0].start_pos for b in model.batches] == [10, 850]


def _build(tmp_path, model, memory_for, **knobs):
    loaded = load_config({"max_context": 512, "max_num_seqs": 2, "step_tokens": 64, "prefill_chunk": 48,
                          "served_model_name": "toy",
                          **knobs}, environ={"DS4D_CONFIG": str(tmp_path / "none.toml")})
    kernel = Kernel(loaded)
    kernel.device_memory = memory_for
    loop = asyncio.new_event_loop()
    try:
        state = kernel.build(LoadedModel(model, "toy", tmp_path), loop)
        kernel.engine.stop(2)
    finally:
        loop.close()
    return kernel, state


def test_build_sizes_the_pool_to_the_plan_and_logs_it(tmp_path, caplog, monkeypatch):
    model = CountingToy()
    block_bytes = model.info.cache_bytes_per_block
    # a device whose plan leaves room for 40 blocks of KV next to weights, activations and graphs
    weights, step = 5 * GIB, 3000
    total = int((weights + step + GRAPH_RESERVE_BYTES + 40.5 * block_bytes) / 0.92) + 1
    memory = FakeMemory(total=total, weights=weights, step=step, model=model)
    with caplog.at_level(logging.INFO, logger="ds4d"):
        kernel, state = _build(tmp_path, model, lambda device: memory)
    plan = kernel.memory_plan
    assert plan is not None and plan.weights == weights and plan.activations == step
    assert plan.profiled == (48, 16) and model.fed[0] == 64  # step_tokens in prefill_chunk pieces
    blocks = state.client.capabilities.num_blocks
    assert blocks * block_bytes <= plan.kv_budget < (blocks + 1) * block_bytes  # as many whole blocks as fit
    assert blocks == 40 < 2 * 512 // 4  # fewer than the 2 full contexts asked for
    assert plan.kv_bytes == blocks * block_bytes and plan.headroom == total - weights - step - GRAPH_RESERVE_BYTES \
        - plan.kv_bytes
    assert state.max_context_tokens == min(512, blocks * 4)
    assert any("GPU memory plan on cpu" in r.getMessage() for r in caplog.records)
    from ds4d.server.admin import metrics_text, snapshot

    shown = snapshot(state)["memory_plan"]  # /v1/ds4d/stats and /metrics carry the plan
    assert shown == plan.as_dict() and shown["kv_bytes"] == blocks * block_bytes
    # the console's GPU bar: what the planned device holds (the CPU stands in for GPU 0 here)
    from ds4d.server import admin

    monkeypatch.setattr(admin, "gpu_memory",
                        lambda: [{"index": 0, "name": "stand-in", "used_bytes": weights, "total_bytes": total}])
    breakdown = snapshot(state)["gpus"][0]["breakdown"]
    assert breakdown == {"weights": weights, "experts": 0, "kv": blocks * block_bytes, "prefix_cache": 0}
    text = metrics_text(state)
    assert f'ds4d_gpu_memory_planned_bytes{{part="weights"}} {weights}' in text
    assert f'ds4d_gpu_memory_planned_bytes{{part="kv"}} {blocks * block_bytes}' in text
    assert any("KV/state pool" in r.getMessage() for r in caplog.records)


def test_explicit_pool_that_does_not_fit_is_refused(tmp_path):
    model = CountingToy()
    memory = FakeMemory(total=2 * GIB, weights=GIB, step=0, model=model)
    with pytest.raises(MemoryPlanError, match="KV pool of 8000000 tokens"):
        _build(tmp_path, model, lambda device: memory, kv_cache_tokens=8_000_000)


def test_no_plan_on_the_cpu(tmp_path):
    kernel, state = _build(tmp_path, CountingToy(), Kernel.device_memory)
    assert kernel.memory_plan is None and state.client.capabilities.num_blocks == 2 * (512 // 4)


def test_profiling_step_runs_on_a_v4_model_at_the_end_of_its_context(tmp_path):
    """The V4 model attends over the shared-block prefix (window ring, compressed entries, indexer) at the
    longest context it accepts; the step's logits are finite and the real cache comes afterwards."""
    import torch

    from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
    from ds4d.models.deepseek_v4.attention import SPARSE_FROM

    write_tiny_checkpoint(tmp_path / "ckpt", seed=1, layers=[0, 4, 128])
    model = load_model(tmp_path / "ckpt")
    logits = []
    forward = model.forward
    model.forward = lambda batch: logits.append(forward(batch)) or logits[-1]

    context = model.info.max_context_tokens
    # the longest context, and the last one whose CSA entries (ratio 4) go through the dense score block
    assert model.activation_probe_contexts(context) == [4 * SPARSE_FROM, context]
    assert model.activation_probe_contexts(1000) == [1000]
    assert profile_activations(model, model.info, [48, 16], QuietMemory(), [context]) == 0
    assert logits[0].shape == (2, model.info.vocab_size) and torch.isfinite(logits[0]).all()
    assert model.info.block_size_tokens == 128 and context % 128 == 0
    assert model.cache.max_seqs == 2 and model.cache.num_blocks == 3  # the shared block, one block per chunk


def test_profiling_step_runs_on_a_v41_model_at_the_end_of_its_context(tmp_path):
    """A V4.1 chunk must continue a state standing exactly at its start: the profiling step asks the
    model for one (``place_probe_state``) and attends over a full window, a context's worth of
    compressed entries and index keys, and the Engram rows of the chunk."""
    import torch

    from ds4d.models.deepseek_v41.family import load_model

    source = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41" / "tiny_b"
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / file).symlink_to(source / file)
    model = load_model(tmp_path, block_tokens=16)
    logits = []
    forward = model.forward
    model.forward = lambda batch: logits.append(forward(batch)) or logits[-1]

    context = model.info.max_context_tokens
    assert profile_activations(model, model.info, [48, 17], QuietMemory(), [context]) == 0
    assert logits[0].shape == (2, model.info.vocab_size) and torch.isfinite(logits[0]).all()
    for slot, chunk in enumerate((48, 17)):
        state = model.slots[slot]
        assert state.position == context
        for plan in model.model.plans:
            if plan.is_kv_source:
                assert state.groups[plan.layer].entries.count == context // plan.ratio
    # a state that does not stand at the chunk's start is still refused outside the profiling step
    with pytest.raises(ValueError, match="starts at"):
        model.forward(ForwardBatch((SeqChunk(0, (5,), 3, (1,), 1),)))
