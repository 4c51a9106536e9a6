"""Turns a StepPlan into one model forward and the sampled tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ds4d.contracts import ForwardBatch, Model, SeqChunk
from ds4d.engine.request import TokenLogprob
from ds4d.engine.sampler import Sampler, make_logprob, small_tensor
from ds4d.engine.scheduler import StepPlan


@dataclass(frozen=True)
class ChunkResult:
    token_id: int | None
    """The sampled next token, when the chunk reached the end of the sequence."""
    logprob: TokenLogprob | None
    prompt_logprobs: tuple[TokenLogprob | None, ...]


class LaunchedStep:
    """A step whose forward and sampling are queued on the device; :meth:`results` waits for them.

    ``tokens``: the sampled tokens ``[S]`` on the model's device, one per sampling chunk in chunk
    order, before the host has read them (what a step queued right behind this one is fed).  Their
    copy to the host is queued at launch, right behind the draw: reading them waits for this step
    only, not for a step queued behind it on the same stream."""

    def __init__(self, sampler: Sampler, plan: StepPlan, logits: torch.Tensor, tokens: torch.Tensor | None,
                 sample_meta: list, prompt_lp: list) -> None:
        self.plan = plan
        self.tokens = tokens
        self._sampler, self._logits, self._meta, self._prompt_lp = sampler, logits, sample_meta, prompt_lp
        self._host_tokens, self._copied = _start_read_back(tokens) if tokens is not None else (None, None)

    def tokens_of(self, chunks: list[int]) -> torch.Tensor:
        """The sampled tokens of the given chunks (indices into a plan whose every chunk samples)."""
        if len(chunks) == len(self.plan.chunks):
            return self.tokens
        return self.tokens[small_tensor(self.tokens.device, chunks, torch.long)]

    def results(self) -> list[ChunkResult]:
        sampled: list[int] = []
        sampled_lp: list[TokenLogprob | None] = []
        if self._host_tokens is not None:
            if self._copied is not None:
                self._copied.synchronize()
            sampled, sampled_lp = self._sampler.collect(self._host_tokens, self._logits, self._meta)
        out, k = [], 0
        for c, plp in zip(self.plan.chunks, self._prompt_lp):
            if c.sample:
                out.append(ChunkResult(sampled[k], sampled_lp[k], plp))
                k += 1
            else:
                out.append(ChunkResult(None, None, plp))
        return out


def _start_read_back(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue the copy of CUDA ``tokens`` into page-locked host memory and an event after it.
    (``tokens.tolist()`` later would wait for everything queued on the stream by then.)"""
    if not tokens.is_cuda:
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)  # queued on the tokens' device's stream (a split model's last GPU)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tokens.device))
    return host, copied


class ModelRunner:
    def __init__(self, model: Model, sampler: Sampler) -> None:
        self.model = model
        self.sampler = sampler

    @torch.inference_mode()
    def launch(self, plan: StepPlan, input_tokens: torch.Tensor | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling; nothing is read back until ``results()``.

        ``input_tokens``: a device tensor that feeds each chunk its one token (the previous step's
        samples, not yet read); see ``ForwardBatch.input_tokens``."""
        chunks = []
        for c in plan.chunks:
            seq = c.seq
            tokens = seq.tokens_between(c.start_pos, c.start_pos + c.num_tokens)
            chunks.append(SeqChunk(seq.state_slot, tuple(tokens), c.start_pos, tuple(seq.block_ids), c.logits_tokens))
        logits = self.model.forward(ForwardBatch(tuple(chunks), input_tokens=input_tokens))

        sample_rows, sample_meta, row = [], [], 0
        prompt_lp: list[tuple[TokenLogprob | None, ...]] = []
        for c in plan.chunks:
            rows = logits[row:row + c.logits_tokens]
            row += c.logits_tokens
            wants_prompt = c.seq.request.params.prompt_logprobs is not None and c.start_pos < c.seq.num_prompt_tokens
            prompt_lp.append(self._prompt_logprobs(c, rows) if wants_prompt else ())
            if c.sample:
                sample_rows.append(rows[-1])
                sample_meta.append((c.seq.request_id, c.seq.request.params))
        tokens = None
        if sample_rows:
            every_row = len(sample_rows) == logits.shape[0] and logits.dtype == torch.float32
            sample_logits = logits if every_row else torch.stack(sample_rows).float()
            tokens = self.sampler.draw(sample_logits, sample_meta)
            logits = sample_logits
        return LaunchedStep(self.sampler, plan, logits, tokens, sample_meta, prompt_lp)

    @staticmethod
    def _prompt_logprobs(c, rows: torch.Tensor) -> tuple[TokenLogprob | None, ...]:
        """Entries for prompt tokens start_pos .. end-1 (logits at p-1 score token p)."""
        seq = c.seq
        prompt = seq.request.prompt_ids
        top_n = seq.request.params.prompt_logprobs or 0
        lp = torch.log_softmax(rows.float(), dim=-1)
        entries: list[TokenLogprob | None] = []
        if c.start_pos == 0:
            entries.append(None)
        # row j holds logits at position start_pos + j, which score token start_pos + j + 1
        for j in range(rows.shape[0]):
            pos = c.start_pos + j + 1
            if pos >= len(prompt):
                break
            entries.append(make_logprob(lp[j], prompt[pos], top_n))
        return tuple(entries)
