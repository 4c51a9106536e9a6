"""A tiny deterministic Model for engine tests: its 'KV' is the token ids themselves.

forward() writes every fed token into its block slot and computes each
position's logits from the tokens it reads back through the block table, so a
wrong block table, a bad prefix-cache hit or a lost preemption shows up as a
different token.
"""

from __future__ import annotations

import dataclasses

import torch

from ds4d.contracts import ForwardBatch, ModelInfo


class ToyTokenizer:
    vocab_size = 64
    bos_token_id = None
    eos_token_ids = frozenset({0})

    def encode(self, text, *, add_special_tokens=False):
        return [1 + (ord(c) % 63) for c in text]

    def decode(self, ids, *, skip_special_tokens=False):
        return "".join(chr(ord("a") + (i % 26)) for i in ids)

    def token_to_id(self, token):
        return None

    def id_to_token(self, token_id):
        return None


class ToyModel:
    accepts_input_tokens = True
    """Decode chunks may get their token from ``ForwardBatch.input_tokens`` (the engine looking ahead)."""

    def __init__(self, block_size: int = 4, eos_after: int | None = None) -> None:
        self.tokenizer = ToyTokenizer()
        self.info = ModelInfo(family="toy", name="toy", vocab_size=64, max_context_tokens=4096,
                              block_size_tokens=block_size, cache_bytes_per_block=block_size * 8)
        self.pool = None
        self.forward_calls = []

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        self.pool = torch.full((num_blocks, self.info.block_size_tokens), -1, dtype=torch.long)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        bs = self.info.block_size_tokens
        self.forward_calls.append(batch)
        rows = []
        for index, chunk in enumerate(batch.chunks):
            if batch.input_tokens is not None:
                assert len(chunk.token_ids) == 1 and chunk.token_ids[0] < 0, "fed tokens replace placeholders"
                chunk = dataclasses.replace(chunk, token_ids=(int(batch.input_tokens[index]),))
            for i, tok in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                self.pool[chunk.block_ids[pos // bs], pos % bs] = tok
            end = chunk.start_pos + len(chunk.token_ids)
            for pos in range(end - chunk.logits_tokens, end):
                seen = [int(self.pool[chunk.block_ids[p // bs], p % bs]) for p in range(pos + 1)]
                assert min(seen) >= 0, "read a slot that was never written"
                nxt = 1 + sum((p + 1) * t for p, t in enumerate(seen)) % 63
                row = torch.zeros(64)
                row[nxt] = 5.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, 64)


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        nxt = 1 + sum((p + 1) * t for p, t in enumerate(seq)) % 63
        out.append(nxt)
        seq.append(nxt)
    return out
