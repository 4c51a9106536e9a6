"""Where a prompt is checkpointed for a model with per-sequence state, and how a checkpoint
travels as one tier payload."""

from __future__ import annotations

import torch

from ds4d.cache.checkpoints import Checkpoint, CheckpointRef, CheckpointStore, pack, tier_key, unpack
from ds4d.engine.checkpoint_plan import checkpoint_positions
from ds4d.engine.request import EngineRequest, SamplingParams


def request(n: int, **kw) -> EngineRequest:
    return EngineRequest("r", tuple(range(n)), SamplingParams(), **kw)


def test_periodic_positions_are_absolute_and_inside_the_prompt():
    assert checkpoint_positions(request(1000), every_tokens=256, block_size=128) == (256, 512, 768)
    assert checkpoint_positions(request(768), every_tokens=256, block_size=128) == (256, 512)  # 768 is the end
    assert checkpoint_positions(request(1000), every_tokens=0, block_size=128) == ()


def test_stable_prefix_volatile_tail_and_thinned_message_starts():
    r = request(2000, stable_prefix=300, volatile_tail=1, message_starts=(300, 420, 500, 900, 1000, 1010, 1700, 1900))
    # gap = max(1024 // 4, 128) = 256: 420 and 500 lie within it of 300, 900, 1000 and 1010 of 1024
    got = checkpoint_positions(r, every_tokens=1024, block_size=128)
    assert got == (300, 1024, 1700, 1999)  # 1900 lies within it of the volatile tail at 1999
    # an agent's next turn resumes a token before its new message: no second checkpoint there,
    # and none at or before where it resumed
    turn = request(3000, message_starts=(300, 2100, 2102, 2900))
    assert checkpoint_positions(turn, every_tokens=1024, block_size=128, resumed_at=2099) == (2900,)
    assert checkpoint_positions(turn, every_tokens=1024, block_size=128, resumed_at=1500) == (2048, 2900)
    # positions at 0 or at the prompt's end are never marks (the end is checkpointed anyway)
    assert checkpoint_positions(request(50, stable_prefix=50, message_starts=(0, 50)), every_tokens=0,
                                block_size=4) == ()


def test_a_checkpoint_packs_into_one_payload_and_back():
    state = [torch.randn(3, 5).to(torch.bfloat16), [torch.arange(7), torch.zeros(0)], torch.tensor(4.5)]
    partial = torch.arange(40, dtype=torch.uint8)
    ckpt = Checkpoint(b"a" * 32, (5, 6, 7), 135, state, partial, 1)
    ref = CheckpointRef(ckpt.anchor, ckpt.tail, 135, 1, tier_key(ckpt.anchor, ckpt.tail))
    payload = pack(ckpt)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    back = unpack(bytes(payload.numpy()), ref)
    assert back is not None and back.num_tokens == 135 and torch.equal(back.partial, partial)
    assert torch.equal(back.state[0], state[0]) and back.state[0].dtype == torch.bfloat16
    assert torch.equal(back.state[1][0], state[1][0]) and back.state[1][1].numel() == 0
    assert torch.equal(back.state[2], state[2])
    assert unpack(payload, CheckpointRef(ckpt.anchor, (5, 6, 8), 135, 1, ref.key)) is None  # another tail
    assert unpack(payload[:-1], ref) is None  # truncated
    assert pack(Checkpoint(b"a" * 32, (), 128, (1, 2), None, 1)) is None  # not tensors: stays hot only


def test_hot_set_pushes_the_least_recent_out_and_cooling_follows_the_anchor():
    store = CheckpointStore(2, 4)
    first, second, third = (Checkpoint(bytes([i]) * 32, (), 4, torch.zeros(1), None, 1) for i in range(3))
    assert store.add(first) == [] and store.add(second) == []
    assert store.add(third) == [first]  # out of the hot set, still indexed (the caller demotes it)
    assert len(store) == 3 and store.num_hot == 2
    assert store.cool({second.anchor}) == [second] and store.num_hot == 1
    store.forget_key(third.anchor)  # its anchor block was dropped: the checkpoint goes with it
    assert len(store) == 2 and store.num_hot == 0
