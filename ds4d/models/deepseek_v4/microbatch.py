"""Prompt steps of a model split into layer stages, cut into micro-batches that flow through the stages.

With one batch per step, the stages of a layer split run one after another:
while stage ``s`` computes, every other stage waits.  Cut into ``n``
micro-batches, stage ``s + 1`` runs micro-batch ``j`` while stage ``s`` runs
``j + 1``, so a prompt step over ``S`` stages takes about ``(n + S - 1) / n`` of
one stage's time for the whole step per stage instead of ``S`` times it.

A micro-batch is a run of the step's tokens in order.  A chunk may be cut
between two micro-batches: each piece is a chunk of its own, exactly as two
consecutive engine steps would feed the sequence, and every stage runs its
micro-batches in order, so the second piece finds the first's KV and state.
The pieces' logits come back in the step's row order.  The model's result per
row does not depend on how the rows were batched, so the cut changes no logit
beyond the summation order of float rounding.

Decode steps (one token per sequence) are not cut: a decode step reads every
weight of a stage once whatever its batch, so two micro-batches would read
them twice; pipelining decode needs several steps in flight, which the engine
does not queue on a split model.
"""

from __future__ import annotations

from ds4d.contracts import ForwardBatch, SeqChunk

MIN_TOKENS = 64
"""Fewest tokens a micro-batch is cut to: below this, a stage's launches and its sends outweigh the overlap."""


def is_decode(batch: ForwardBatch) -> bool:
    """Every sequence feeds one token and wants its logits."""
    chunks = [c for c in batch.chunks if c.token_ids]
    return bool(chunks) and all(len(c.token_ids) == c.logits_tokens == 1 for c in chunks)


def split_prompt(batch: ForwardBatch, parts: int, block_size: int, min_tokens: int = MIN_TOKENS,
                 ) -> list[ForwardBatch]:
    """``batch`` as up to ``parts`` micro-batches of about equal tokens (none under ``min_tokens``), each a
    run of its tokens in order; ``[batch]`` when it is not cut (decode steps, small steps, ``parts`` <= 1)."""
    chunks = [c for c in batch.chunks if c.token_ids]
    total = sum(len(c.token_ids) for c in chunks)
    parts = min(parts, total // max(1, min_tokens))
    if parts <= 1 or is_decode(batch) or batch.input_tokens is not None:
        return [batch]
    size = -(-total // parts)
    out: list[ForwardBatch] = []
    current: list[SeqChunk] = []
    room = size
    for chunk in chunks:
        tokens, at = chunk.token_ids, 0
        while at < len(tokens):
            end = at + min(room, len(tokens) - at)
            start = chunk.start_pos + at
            logits = max(0, min(end - at, chunk.logits_tokens - (len(tokens) - end)))
            blocks = chunk.block_ids[: -(-(start + end - at) // block_size)]  # what the piece's end needs
            current.append(SeqChunk(chunk.state_slot, tokens[at:end], start, blocks, logits))
            room -= end - at
            at = end
            if room == 0:
                out.append(ForwardBatch(tuple(current)))
                current, room = [], size
    if current:
        out.append(ForwardBatch(tuple(current)))
    return out
