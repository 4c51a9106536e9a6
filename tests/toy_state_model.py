"""Toy models for prefix-cache tests: block copies, and per-sequence state.

``ToyBlockModel`` adds :class:`~ds4d.contracts.BlockCopyModel` to the toy model
(a block's payload is its token ids as int64 bytes), so RAM/disk tiers can hold
and restore blocks.  ``ToyStateModel`` also carries a per-slot running hash of
every token fed (a stand-in for DeepSeek-V4's sliding window and compressor
tails) that enters every logit: a reuse without the right state checkpoint, or
a chunk that starts where the slot's state is not, gives a different token or
fails an assertion.
"""

from __future__ import annotations

import torch

from tests.toy_model import ToyModel

STATE_MOD = 1_000_003


def _as_tensor(payload) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return payload.reshape(-1).view(torch.uint8)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


class ToyBlockModel(ToyModel):
    def __init__(self, block_size: int = 4) -> None:
        super().__init__(block_size)
        self.exported: list[int] = []
        self.imported: list[int] = []

    def export_blocks(self, block_ids):
        self.exported += list(block_ids)
        return [self.pool[b].clone().view(torch.uint8) for b in block_ids]

    def import_blocks(self, block_ids, payloads) -> None:
        self.imported += list(block_ids)
        for b, p in zip(block_ids, payloads):
            self.pool[b] = _as_tensor(p).view(torch.int64)


class LateCopy:
    """A done handle whose copy lands only when asked ``query`` for the ``lag``-th time, or at
    ``synchronize``: until then the payloads hold zeros, as a device copy still under way would."""

    def __init__(self, payloads: list[torch.Tensor], sources: list[torch.Tensor], lag: int) -> None:
        self.payloads, self.sources, self.lag, self.landed = payloads, sources, lag, False

    def query(self) -> bool:
        self.lag -= 1
        if self.lag <= 0:
            self.synchronize()
        return self.landed

    def synchronize(self) -> None:
        if not self.landed:
            for payload, source in zip(self.payloads, self.sources):
                payload.copy_(source)
            self.landed = True


class ToyAsyncBlockModel(ToyBlockModel):
    """``AsyncBlockCopyModel``: ``start_export`` hands out payloads that fill in late (:class:`LateCopy`)."""

    def __init__(self, block_size: int = 4, lag: int = 2) -> None:
        super().__init__(block_size)
        self.lag = lag
        self.handles: list[LateCopy] = []

    def start_export(self, block_ids):
        self.exported += list(block_ids)
        sources = [self.pool[b].clone().view(torch.uint8) for b in block_ids]
        payloads = [torch.zeros_like(s) for s in sources]
        self.handles.append(LateCopy(payloads, sources, self.lag))
        return payloads, self.handles[-1]


def step_state(state: int, token: int) -> int:
    return (state * 31 + token) % STATE_MOD


class ToyStateModel(ToyBlockModel):
    def __init__(self, block_size: int = 4) -> None:
        super().__init__(block_size)
        self.state: list[int] = []
        self.state_pos: list[int] = []
        self.loads = 0

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        super().allocate_cache(num_blocks, max_seqs)
        self.state = [0] * max_seqs
        self.state_pos = [0] * max_seqs

    def save_state(self, slot: int):
        return (self.state[slot], self.state_pos[slot])

    def load_state(self, slot: int, snapshot) -> None:
        self.loads += 1
        self.state[slot], self.state_pos[slot] = snapshot

    def forward(self, batch):
        bs = self.info.block_size_tokens
        self.forward_calls.append(batch)
        rows = []
        for chunk in batch.chunks:
            slot = chunk.state_slot
            if chunk.start_pos == 0:
                self.state[slot], self.state_pos[slot] = 0, 0
            assert self.state_pos[slot] == chunk.start_pos, "chunk starts where the slot's state is not"
            end = chunk.start_pos + len(chunk.token_ids)
            for i, tok in enumerate(chunk.token_ids):
                pos = chunk.start_pos + i
                self.pool[chunk.block_ids[pos // bs], pos % bs] = tok
                self.state[slot] = step_state(self.state[slot], tok)
                self.state_pos[slot] += 1
                if pos >= end - chunk.logits_tokens:
                    seen = [int(self.pool[chunk.block_ids[p // bs], p % bs]) for p in range(pos + 1)]
                    assert min(seen) >= 0, "read a slot that was never written"
                    nxt = 1 + (sum((p + 1) * t for p, t in enumerate(seen)) + self.state[slot]) % 63
                    row = torch.zeros(64)
                    row[nxt] = 5.0
                    rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, 64)


def reference_state_tokens(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    out = []
    for _ in range(n):
        state = 0
        for t in seq:
            state = step_state(state, t)
        nxt = 1 + (sum((p + 1) * t for p, t in enumerate(seq)) + state) % 63
        out.append(nxt)
        seq.append(nxt)
    return out
