"""How a prompt step is cut into micro-batches for a model split into layer stages (``microbatch.split_prompt``).

The split model's logits with the cut are checked against the single process in
tests/parity/test_dsv4_sharded.py (layouts pp and 2x2, over gloo); here, that the pieces are the
step's tokens in order, each a valid chunk of its own.
"""

from __future__ import annotations

import torch

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v4.microbatch import is_decode, split_prompt

BLOCK = 64


def _chunk(slot: int, length: int, start: int, logits: int) -> SeqChunk:
    return SeqChunk(slot, tuple(range(1000 * slot, 1000 * slot + length)), start,
                    tuple(range(100 * slot, 100 * slot + -(-(start + length) // BLOCK))), logits)


def _rows(batch: ForwardBatch) -> list[tuple[int, int, bool]]:
    """(slot, position, wants logits) of every token of the step, in order."""
    rows = []
    for chunk in batch.chunks:
        for i, _ in enumerate(chunk.token_ids):
            rows.append((chunk.state_slot, chunk.start_pos + i, i >= len(chunk.token_ids) - chunk.logits_tokens))
    return rows


def test_the_pieces_are_the_steps_tokens_in_order_each_a_chunk_of_its_own():
    batch = ForwardBatch((_chunk(0, 150, 0, 1), _chunk(1, 1, 70, 1), _chunk(2, 90, 300, 90), _chunk(3, 20, 0, 0)))
    for parts in (2, 3, 4):
        pieces = split_prompt(batch, parts, BLOCK)
        assert len(pieces) == parts
        sizes = [piece.num_tokens for piece in pieces]
        assert max(sizes) - min(sizes) <= max(sizes) // 2 and sum(sizes) == batch.num_tokens
        assert [row for piece in pieces for row in _rows(piece)] == _rows(batch)
        for piece in pieces:
            assert len({c.state_slot for c in piece.chunks}) == len(piece.chunks)  # a sequence once per piece
            for chunk in piece.chunks:
                original = next(c for c in batch.chunks if c.state_slot == chunk.state_slot)
                offset = chunk.start_pos - original.start_pos
                assert chunk.token_ids == original.token_ids[offset:offset + len(chunk.token_ids)]
                end = chunk.start_pos + len(chunk.token_ids)
                assert chunk.block_ids == original.block_ids[: -(-end // BLOCK)]  # what its end needs, no more


def test_small_decode_and_queued_steps_are_not_cut():
    prompt = ForwardBatch((_chunk(0, 127, 0, 1),))
    assert split_prompt(prompt, 2, BLOCK) == [prompt]  # two pieces would be under 64 tokens
    assert len(split_prompt(ForwardBatch((_chunk(0, 128, 0, 1),)), 2, BLOCK)) == 2
    assert split_prompt(prompt, 1, BLOCK) == [prompt]
    decode = ForwardBatch(tuple(_chunk(slot, 1, 500, 1) for slot in range(200)))
    assert is_decode(decode) and split_prompt(decode, 4, BLOCK, min_tokens=1) == [decode]
    queued = ForwardBatch((_chunk(0, 128, 0, 1),), input_tokens=torch.zeros(1))
    assert split_prompt(queued, 2, BLOCK) == [queued]
