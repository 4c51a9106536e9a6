"""Warm-up before a daemon reports ready: what the first requests would otherwise pay for.

On a GPU the first use of a shape costs far more than its later uses: Triton compiles each kernel
variant (or loads it from its disk cache), a decode bucket's CUDA graph is captured, cuBLAS picks its
algorithms, the caching allocators grow.  A fresh daemon would charge that to its first requests
(seconds for an agent's first reuse of a long prompt).  :func:`warm_up` pays it before ``/ready``:

* waves of requests of random token ids through a throwaway engine over the same model: its own block
  pool and prefix cache with no lower tiers, so nothing it computes is ever reused by a real request or
  reaches the RAM or disk tier, and its state slots and pool blocks are simply free again afterwards;
  the waves meet every path of a step once: prompts of one token to past twice ``prefill_chunk`` (chunks
  at offsets, beside a decoding row), steps of every row class up to ``step_tokens`` (``ds4d.cuda.rows``),
  prompts resumed from a prefix hit with 1 to a thousand new tokens, greedy, sampled (temperature, top-k,
  top-p, seeded), logprobs and prompt logprobs, a constrained row, decode batches of every bucket size up
  to ``max_num_seqs``;
* then the model's decode graphs for every (batch, block-table) bucket up to ``max_context``
  (:class:`~ds4d.contracts.DecodeWarmableModel`), run on padding rows.

For the Triton kernels lengths and offsets need no more cover than that: they do not specialise on the
arguments that change per prompt (``do_not_specialize``), so one compiled variant serves every prompt
length and offset of a path.  cuBLAS picks a kernel per matmul shape on first use; a model that rounds
its prompt steps' rows to a few classes (DeepSeek-V4 on CUDA: ``ds4d.cuda.rows``) meets all of them here.
Other torch kernels are met by size class only (docs/BENCHMARKS.md, the first-request table).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass

import torch

from ds4d.cache.blocks import BlockPool
from ds4d.cache.manager import PrefixCache
from ds4d.contracts import DecodeWarmableModel, Model, SchedulerPolicy
from ds4d.cuda.rows import row_classes_up_to
from ds4d.engine.request import EngineRequest, SamplingParams

log = logging.getLogger("ds4d.engine")

SALT = "ds4d-warmup"
RESUMED_NEW_TOKENS = (1, 7, 17, 100, 300, 1000)
"""New tokens of the prompts resumed from the first wave's prompt: a one-token step, then one in each row
regime of the FP8 kernels (tiles of 16, 32 and 64 rows, the dense path from 257 rows) and a longer one."""


def fresh_lengths(prefill_chunk: int) -> list[int]:
    """Prompts from position 0 besides the first wave's: one token, then one of each row class up to
    ``prefill_chunk`` (``ds4d.cuda.rows``): a model whose prompt steps round their matmul rows to those
    classes (DeepSeek-V4 on CUDA) meets in them every shape cuBLAS would otherwise pick a kernel for on
    a first prompt of a new length (about half a millisecond per shape, tens per step)."""
    return [1] + [rows for rows in row_classes_up_to(prefill_chunk) if rows <= prefill_chunk]


@dataclass(frozen=True)
class WarmupReport:
    requests: int
    prompt_tokens: int
    reused_tokens: int
    """Prompt tokens the resumed requests took from the throwaway cache (0: the reuse path was not met)."""
    decode_buckets: int
    """Decode buckets the model prepared (captured graphs) after the requests."""
    seconds: float

    def line(self) -> str:
        return (f"warm-up: {self.requests} requests ({self.prompt_tokens} prompt tokens, {self.reused_tokens} "
                f"reused), {self.decode_buckets} decode buckets, {self.seconds:.1f} s")

    def as_dict(self) -> dict:
        return {**asdict(self), "seconds": round(self.seconds, 3)}


class _AnyToken:
    """A constraint that allows every token (the masked sampling path, nothing excluded)."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        return torch.ones(vocab_size, dtype=torch.bool)

    def accept(self, token_id: int) -> None:
        pass


def warmup_waves(vocab_size: int, *, prefill_chunk: int, max_context: int, max_num_seqs: int, pool_tokens: int,
                 step_tokens: int = 0, seed: int = 0) -> list[list[EngineRequest]]:
    """The requests, in waves: each wave is submitted at once and runs to its end before the next.

    Every prompt and output fits ``max_context`` and each wave fits ``pool_tokens`` (the first wave's
    long prompt is cut to what they leave).  With ``step_tokens``, the row classes above
    ``prefill_chunk`` up to it come as waves of prompts whose first chunks fill one step of that many rows."""
    rng = random.Random(seed)
    names = iter(range(1_000_000))

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    def request(prompt: list[int], max_tokens: int = 2, **params) -> EngineRequest:
        return EngineRequest(f"warmup-{next(names)}", tuple(prompt), SamplingParams(
            temperature=params.pop("temperature", 0.0), max_tokens=max_tokens, ignore_eos=True, **params),
            cache_salt=SALT)

    budget = min(max_context, pool_tokens // 2)
    long = tokens(max(min(2 * prefill_chunk + 809, budget // 2), 1))  # three chunks, two of them at offsets
    short = max(min(24, budget // 8), 1)
    waves = [[request(long), request(tokens(short), max_tokens=4)][:max_num_seqs]]  # beside a decoding row
    waves += [[request(long + tokens(n))] for n in RESUMED_NEW_TOKENS if len(long) + n + 2 <= budget]
    waves += [[request(tokens(n))] for n in fresh_lengths(prefill_chunk) if n + 2 <= budget]
    for rows in row_classes_up_to(step_tokens) if step_tokens > prefill_chunk else []:
        pieces = [prefill_chunk] * (rows // prefill_chunk) + [rows % prefill_chunk] * bool(rows % prefill_chunk)
        if prefill_chunk < rows <= step_tokens and len(pieces) <= max_num_seqs and rows + 2 * len(pieces) <= budget:
            waves.append([request(tokens(n)) for n in pieces])
    mixed = [request(tokens(short), max_tokens=3, temperature=0.7, top_k=40, top_p=0.9, seed=1),
             request(tokens(short), max_tokens=3, temperature=1.0),
             request(tokens(short), max_tokens=3, logprobs=5, prompt_logprobs=5),
             request(tokens(short), max_tokens=3, constraint=_AnyToken())]  # beside greedy rows where they fit
    mixed += [request(tokens(short), max_tokens=3) for _ in range(max_num_seqs - len(mixed))]
    waves += [mixed[n:n + max_num_seqs] for n in range(0, len(mixed), max_num_seqs)]
    batch = 2
    while batch <= max_num_seqs and batch * (short + 8) <= pool_tokens:
        waves.append([request(tokens(short), max_tokens=6) for _ in range(batch)])
        if batch == max_num_seqs:
            break
        batch = min(batch * 2, max_num_seqs)
    return waves


def warm_up(model: Model, policy: SchedulerPolicy, *, num_blocks: int, max_num_seqs: int, step_tokens: int,
            prefill_chunk: int, max_context: int, lookahead: bool, checkpoints: int = 64,
            checkpoint_every_tokens: int = 0) -> WarmupReport:
    """Run :func:`warmup_waves` through a throwaway engine over ``model`` (whose cache is allocated for
    ``num_blocks`` blocks and ``max_num_seqs`` slots), then the model's decode buckets."""
    from ds4d.engine.offline import build_core

    began = time.perf_counter()
    info = model.info
    pool = BlockPool(num_blocks, info.block_size_tokens)
    cache = PrefixCache(pool, model=model, block_bytes=info.cache_bytes_per_block, checkpoints=checkpoints,
                        checkpoint_every_tokens=checkpoint_every_tokens)
    outputs: list = []
    core = build_core(model, cache, policy, max_num_seqs=max_num_seqs, step_tokens=step_tokens,
                      prefill_chunk=prefill_chunk, namespace=b"ds4d-warmup", publish=outputs.extend,
                      lookahead=lookahead)
    waves = warmup_waves(info.vocab_size, prefill_chunk=prefill_chunk, max_context=max_context,
                         max_num_seqs=max_num_seqs, pool_tokens=num_blocks * info.block_size_tokens,
                         step_tokens=step_tokens)
    requests = prompt_tokens = 0
    for wave in waves:
        for request in wave:
            core.add_request(request)
        requests += len(wave)
        prompt_tokens += sum(len(r.prompt_ids) for r in wave)
        steps = 0
        while core.scheduler.has_work or core.step_queued_ahead:
            core.step()
            steps += 1
            if steps > 100_000:
                raise RuntimeError("warm-up requests made no progress")
    failed = [o for o in outputs if o.error]
    if failed:
        raise RuntimeError(f"a warm-up request failed: {failed[0].error}")
    max_blocks = -(-max_context // info.block_size_tokens)
    buckets = model.warm_decode(max_num_seqs, max_blocks) if isinstance(model, DecodeWarmableModel) else 0
    if torch.cuda.is_available() and str(info.device).startswith("cuda"):
        torch.cuda.synchronize(info.device)
    return WarmupReport(requests, prompt_tokens, cache.cached_tokens_total, buckets, time.perf_counter() - began)
