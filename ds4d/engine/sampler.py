"""Token sampling from logits rows.

Greedy rows are one batched argmax.  Sampled rows apply temperature, top-k and
top-p, then draw with the request's own generator, so a seeded request gives
the same tokens whatever else shares the batch.  Logprobs are taken from the
model's distribution (before temperature), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4d.engine.request import SamplingParams, TokenLogprob


class Sampler:
    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}

    def generator_for(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed(seed)
            self._generators[request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One token per row of ``logits`` ([R, V] float32)."""
        return self.collect(self.draw(logits, rows), logits, rows)

    def draw(self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]) -> torch.Tensor:
        """The tokens ``[R]`` on the logits' device, nothing read back to the host: a step can be
        queued behind this one before its tokens are known (constrained rows read their masks
        from host state, which is up to date only once the previous tokens were collected)."""
        constrained = [i for i, (_, p) in enumerate(rows) if p.constraint is not None]
        if constrained:
            logits = logits.clone()
            for i in constrained:
                mask = rows[i][1].constraint.allowed_mask(logits.shape[-1])
                if mask is not None:
                    logits[i].masked_fill_(~mask.to(logits.device), float("-inf"))
        tokens = greedy_tokens(logits)
        for i, (request_id, params) in enumerate(rows):
            if params.greedy:
                continue
            row = logits[i] / params.temperature
            if params.top_k > 0 and params.top_k < row.shape[-1]:
                kth = torch.topk(row, params.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if params.top_p < 1.0:
                sorted_probs, order = torch.sort(probs, descending=True)
                cumulative = torch.cumsum(sorted_probs, dim=-1)
                drop = cumulative - sorted_probs > params.top_p
                sorted_probs = sorted_probs.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
            gen = self.generator_for(request_id, params.seed)
            tokens[i] = torch.multinomial(probs, 1, generator=gen)[0]
        return tokens

    def collect(
        self, tokens: torch.Tensor, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Read the drawn ``tokens`` back (waits for the device); advance constraints; logprobs
        from the model's ``logits`` (before any mask or temperature)."""
        token_list = tokens.tolist()
        for i, (_, params) in enumerate(rows):
            if params.constraint is not None:
                params.constraint.accept(token_list[i])
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        want = [i for i, (_, p) in enumerate(rows) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], dim=-1)
            for j, i in enumerate(want):
                logprobs[i] = make_logprob(lp[j], token_list[i], rows[i][1].logprobs or 0)
        return token_list, logprobs


ARGMAX_SEGMENT = 256


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``argmax(logits, -1)``; on CUDA through :func:`two_pass_argmax`, because one pass reduces a
    129K-wide row inside one thread block (27 us on an H200)."""
    if logits.is_cuda and logits.shape[-1] >= 4 * ARGMAX_SEGMENT:
        return two_pass_argmax(logits)
    return torch.argmax(logits, dim=-1)


def two_pass_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, as ``argmax``: the maximum of every segment of
    ``ARGMAX_SEGMENT`` values (first index within it), then the first segment holding the largest."""
    rows, width = logits.shape
    if width % ARGMAX_SEGMENT:
        logits = torch.nn.functional.pad(logits, (0, ARGMAX_SEGMENT - width % ARGMAX_SEGMENT), value=float("-inf"))
    best, where = logits.reshape(rows, -1, ARGMAX_SEGMENT).max(dim=-1)
    segment = best.argmax(dim=-1, keepdim=True)
    return (segment * ARGMAX_SEGMENT + where.gather(1, segment)).squeeze(1)


def make_logprob(logprob_row: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        values, ids = torch.topk(logprob_row, min(top_n, logprob_row.shape[-1]))
        top = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id, float(logprob_row[token_id]), top)
