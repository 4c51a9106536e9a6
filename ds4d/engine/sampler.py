"""Token sampling from logits rows.

Greedy rows are one batched argmax.  Sampled rows are handled together:
temperature, top-k and top-p as batched tensor operations with per-row
parameters, then one draw per row by the exponential race (the token with the
largest ``p / E``, ``E`` exponential noise, is distributed as ``p``; without top-p
it is the largest scaled logit less ``log E``, no softmax needed): one noise
draw for all rows, then a seeded request's row redrawn by its own generator, so
it gives the same tokens whatever else shares the batch.  Nothing is read back to the
host until the tokens are collected.  Logprobs are taken from the model's
distribution (before temperature), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4d.cuda.devices import to_device_async
from ds4d.engine.request import SamplingParams, TokenLogprob


class Sampler:
    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        self._shared: torch.Generator | None = None

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

    def _unseeded(self) -> torch.Generator:
        """The generator of requests without a seed (randomly seeded once)."""
        if self._shared is None:
            self._shared = torch.Generator(device=self.device)
            self._shared.seed()
        return self._shared

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
        sampled = [i for i, (_, params) in enumerate(rows) if not params.greedy]
        if len(sampled) == len(rows):  # no greedy row: no argmax over the whole vocabulary
            return self._draw_sampled(logits, rows)
        tokens = greedy_tokens(logits)
        if sampled:
            index = small_tensor(logits.device, sampled, torch.long)
            tokens[index] = self._draw_sampled(logits[index], [rows[i] for i in sampled])
        return tokens

    def _draw_sampled(self, logits: torch.Tensor, rows: Sequence[tuple[str, SamplingParams]]) -> torch.Tensor:
        """``[S]`` tokens of rows that sample (temperature > 0), all rows at once."""
        width = logits.shape[-1]
        device = logits.device
        temperatures = [p.temperature for _, p in rows]
        scaled = logits
        if any(t != 1.0 for t in temperatures):  # (1.0, what OpenCode's requests leave it at: no division)
            scaled = logits / small_tensor(device, temperatures, torch.float32)[:, None]
        top_k = [p.top_k if 0 < p.top_k < width else 0 for _, p in rows]
        if any(top_k):  # keep each row's k largest (ties at the k-th value kept); k = 0: every token
            kth = torch.topk(scaled, max(top_k), dim=-1).values
            floor = kth.gather(1, small_tensor(device, [max(k - 1, 0) for k in top_k], torch.long)[:, None])
            floor = floor.masked_fill(small_tensor(device, [k == 0 for k in top_k], torch.bool)[:, None], float("-inf"))
            scaled = scaled.masked_fill(scaled < floor, float("-inf"))
        top_p = [p.top_p for _, p in rows]
        nucleus = any(p < 1.0 for p in top_p)
        if nucleus:  # the smallest set of likeliest tokens reaching top_p
            sorted_probs, order = torch.sort(torch.softmax(scaled, dim=-1), dim=-1, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            limit = small_tensor(device, [p if p < 1.0 else float("inf") for p in top_p], torch.float32)[:, None]
            probs = torch.zeros_like(scaled).scatter_(1, order, sorted_probs.masked_fill(before > limit, 0.0))
        noise = torch.empty_like(scaled).exponential_(generator=self._unseeded())  # one draw for every row
        for i, (request_id, params) in enumerate(rows):
            if params.seed is not None:  # a seeded request: its own generator, whatever shares the batch
                noise[i].exponential_(generator=self.generator_for(request_id, params.seed))
        # a draw of exactly 0 would make 0 / 0 or -inf - log 0 (a cut token) a NaN, which argmax takes for the largest
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        if nucleus:
            return greedy_tokens(probs / noise)
        # the largest p / E without the softmax: log p is the scaled logit less one per-row constant
        return greedy_tokens(scaled - noise.log_())

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


def small_tensor(device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A small per-row tensor on ``device``, copied without waiting for the device."""
    return to_device_async(torch.tensor(values, dtype=dtype), device)


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
