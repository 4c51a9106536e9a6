"""The ``llama`` family: Llama-architecture GGUF checkpoints (SmolLM2, Llama 2/3, ...).

This is the embedded demo model: small enough to run on the CPU in CI, and a second
implementation of the ``Model`` contract next to DeepSeek-V4.

Weight formats (config ``weight_format``)
-----------------------------------------
* ``dense``: every matrix is dequantised once at load into the activation dtype
  (``float32`` or ``bfloat16``) and multiplied by MKL / oneDNN.
* ``int4``: matrices stored as Q4_0, Q4_1 or Q8_0 keep the file's own 4-bit values and
  per-block scales and run through torch's CPU int4 kernel (``cpu_linear``); any other
  type (F16, K-quants, ...) falls back to dense for that matrix.  The kernel reads
  bfloat16 inputs, so each matmul input is rounded to bfloat16; the residual stream,
  norms, attention and KV cache stay in the activation dtype.
* ``auto``: int4 on the CPU when most layer matrices are Q4_0/Q4_1, else dense.

Batch-1 decode streams every weight once per token, so it is memory-bound: SmolLM2's
Q4_1 layers are ~66 MB as 4-bit planes against ~425 MB as float32, and int4 decodes
about 2-3x faster.  Prefill is compute-bound and the int4 kernel (one FMA chain per
output, weights re-expanded for every 4 rows) is slower than MKL's float32 GEMM on
dense weights: about 0.7x prefill throughput.  Keeping both representations and
using dense weights for long chunks would not help: the two kernels round
differently, so a decoded token would no longer equal its recomputation (see
Invariance).  ``auto`` takes int4's decode and memory over dense's prefill.

Layout and numerics
-------------------
* GGUF stores the Q and K projections with each head's rows interleaved for
  llama.cpp's pairwise rotary embedding.  Loading undoes that permutation so rotary
  embedding is the rotate-half form; the attention scale ``1/sqrt(head_dim)`` is
  folded into the Q rows (exact for power-of-two head sizes).
* Q/K/V and gate/up are fused into one weight each; float32 weights are kept as
  ``[in, out]`` row-major matrices and applied as ``x @ W``.
* The KV pool holds, per layer, K and V tensors ``[num_blocks, 16, n_kv_heads,
  head_dim]``; a chunk's attention gathers the blocks of its table into
  ``[n_kv_heads, head_dim, keys]`` and ``[n_kv_heads, keys, head_dim]`` operands.

Invariance
----------
A sequence must get the same logits however its prompt is chunked and whatever
shares the batch (contracts: ``Model.forward``).  On the CPU, MKL's float32 GEMM
gives a row the same bits whatever the row count M only on its regular blocked path:
small M takes special kernels that sum in other orders (measured with torch 2.13 /
MKL 2024.2 on AVX-512 Xeons: M = 2, 3, 5-7 and 9-11 differ from M = 280; M = 4, 8
and every M >= 12 agree; on another Xeon every M >= 2 agreed), and reductions longer
than 768 switch blocking with M.  Which kernel runs is the library's choice, so the
model fixes the shapes it hands over instead of trusting one machine's measurement:

* every dense GEMM's rows are padded to a multiple of 8 with copies of the last row
  (``cpu_linear.DenseLinear``; a lone decode token computes 8 rows, its own the
  first), and so are the attention GEMMs;
* reductions longer than 768 are split into fixed pieces summed in order
  (the FFN down projection);
* attention runs per sequence chunk, over whole blocks, in key tiles of 256
  positions counted from position 0, the keys zero-padded (and masked) to whole
  tiles: the weighted sum over values is one GEMM of K = 256 per tile, accumulated
  tile after tile, and the softmax always runs over whole tiles.  A query's scores,
  softmax and weighted sum thus see the same operands in the same shapes whether its
  chunk is 1 or 500 tokens long and wherever that chunk ends; keys past the query
  are masked to -inf and add exact zeros.

The int4 kernel computes each output row on its own (one float32 FMA chain over the
reduction in order) for any M, K and thread count, so int4 linears need no padding.
Elementwise ops (RoPE, SiLU, residual adds) and row-wise reductions (RMSNorm,
softmax) are row-independent.  bfloat16 linears run
one oneDNN matmul on weights pre-packed at load (``cpu_linear.DenseLinear``); oneDNN
picks its bf16 kernel per shape and CPU (AVX512-BF16, AMX tiles, split reductions),
so in bfloat16 chunkings agree to within bf16 rounding, not bitwise (the float32
path is the exact one).  tests/unit/test_llama.py checks float32 bitwise (chunkings
1/37/whole, mixed batches, decode vs recompute, prefix reuse) and bfloat16 against
the bound bfloat16 itself sets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ds4d.contracts import ForwardBatch, ModelInfo, PluginContext
from ds4d.models.gguf_file import GGUFFile, is_gguf_file, peek_string, torch_dtype
from ds4d.models.gguf_tokenizer import GGUFTokenizer
from ds4d.models.llama_weights import (
    BLOCK_SIZE_TOKENS,
    LayerWeights,
    Linear,
    LlamaHParams,
    read_weights,
    resolve_weight_format,
)

KEY_TILE_TOKENS = 256
"""Attention reduction tile (a multiple of the block size, below MKL's K-blocking switch)."""
ATTENTION_ROW_MULTIPLE = 8
"""The attention GEMMs' row counts are padded to this multiple (see Invariance)."""
SCORES_BUDGET = 1 << 24
"""Most attention scores held at once; a long chunk attends in slices of queries."""


@dataclass(frozen=True)
class _ChunkPlan:
    rows: slice
    blocks: torch.Tensor
    """The block ids covering positions 0 .. end-1."""
    mask: torch.Tensor
    """[chunk tokens, 16 * blocks] True where a key must not be seen."""
    n_keys: int




class LlamaModel:
    """A loaded Llama-architecture model with its paged KV pool (``contracts.Model``)."""

    def __init__(
        self,
        info: ModelInfo,
        tokenizer: GGUFTokenizer,
        hparams: LlamaHParams,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        output_norm: torch.Tensor,
        head: Linear,
        rope_freq_factors: torch.Tensor | None = None,
    ) -> None:
        self.info = info
        self.tokenizer = tokenizer
        self.hp = hparams
        self.dtype = embed.dtype
        self.device = embed.device
        self._embed = embed
        self._layers = layers
        self._output_norm = output_norm
        self._head = head
        self._group = hparams.n_heads // hparams.n_kv_heads
        self._qk_cols = (hparams.n_heads + hparams.n_kv_heads) * hparams.head_dim
        self._k_cache: list[torch.Tensor] = []
        self._v_cache: list[torch.Tensor] = []
        self._build_rope_tables(rope_freq_factors)

    def _build_rope_tables(self, freq_factors: torch.Tensor | None) -> None:
        """cos and [-sin, sin] for every position, so RoPE is ``x * cos + roll(x) * sin``."""
        hp = self.hp
        half = hp.head_dim // 2
        inv_freq = hp.rope_base ** (-torch.arange(0, half, dtype=torch.float64) * 2 / hp.head_dim)
        if freq_factors is not None:  # Llama 3.1-style long-context scaling, stored per frequency
            inv_freq = inv_freq / freq_factors.to(torch.float64)
        positions = torch.arange(hp.context_length, dtype=torch.float64) / hp.rope_scale
        angles = positions[:, None] * inv_freq[None, :]
        cos, sin = angles.cos(), angles.sin()
        self._rope_cos = torch.cat([cos, cos], dim=1).to(self.dtype).to(self.device)
        self._rope_sin = torch.cat([-sin, sin], dim=1).to(self.dtype).to(self.device)

    # ------------------------------------------------------------------ cache

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        hp = self.hp
        shape = (num_blocks, BLOCK_SIZE_TOKENS, hp.n_kv_heads, hp.head_dim)
        self._k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(hp.n_layers)]
        self._v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(hp.n_layers)]

    @property
    def kv_cache(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V pools ``[num_blocks, block_size_tokens, n_kv_heads, head_dim]``."""
        return self._k_cache, self._v_cache

    def export_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """``BlockCopyModel``: each block's K and V of every layer as one uint8 CPU tensor."""
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        parts = []
        for k_pool, v_pool in zip(self._k_cache, self._v_cache):
            parts += [k_pool.index_select(0, index), v_pool.index_select(0, index)]
        blocks = torch.stack(parts, dim=1).cpu()  # [blocks, 2 * layers, 16, n_kv_heads, head_dim]
        return [block.reshape(-1).view(torch.uint8).clone() for block in blocks]

    def import_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        """``BlockCopyModel``: write payloads made by :meth:`export_blocks` back into the pool.

        With CUDA the payloads are gathered into one pinned buffer and copied without a host
        sync (``non_blocking``) on the current stream, so the pool writes and the next forward
        are ordered after the copy while this thread goes on; the caching host allocator keeps
        the buffer until the copy is done."""
        if len(block_ids) != len(payloads):
            raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
        if not block_ids:
            return
        hp = self.hp
        rows = []
        for payload in payloads:
            raw = (
                payload
                if isinstance(payload, torch.Tensor)
                else torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            )
            if raw.numel() != self.info.cache_bytes_per_block:
                raise ValueError(f"payload of {raw.numel()} bytes, expected {self.info.cache_bytes_per_block}")
            rows.append(raw.view(self.dtype).view(2 * hp.n_layers, BLOCK_SIZE_TOKENS, hp.n_kv_heads, hp.head_dim))
        pinned = self.device.type == "cuda"
        staged = torch.stack(rows, out=torch.empty((len(rows), *rows[0].shape), dtype=self.dtype, pin_memory=pinned))
        index = torch.tensor(list(block_ids), dtype=torch.long, pin_memory=pinned)
        blocks = staged.to(self.device, non_blocking=True)
        index = index.to(self.device, non_blocking=True)
        for layer, (k_pool, v_pool) in enumerate(zip(self._k_cache, self._v_cache)):
            k_pool.index_copy_(0, index, blocks[:, 2 * layer])
            v_pool.index_copy_(0, index, blocks[:, 2 * layer + 1])

    # ------------------------------------------------------------------ forward

    def _plan(self, batch: ForwardBatch) -> tuple[list[int], list[int], list[int], list[_ChunkPlan], list[int]]:
        if not self._k_cache:
            raise RuntimeError("allocate_cache() must run before forward()")
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks: list[_ChunkPlan] = []
        logit_rows: list[int] = []
        for chunk in batch.chunks:
            length = len(chunk.token_ids)
            start, end = chunk.start_pos, chunk.start_pos + length
            if length == 0:
                continue
            if end > self.hp.context_length:
                raise ValueError(f"position {end - 1} is past the context length {self.hp.context_length}")
            n_blocks = -(-end // BLOCK_SIZE_TOKENS)
            if len(chunk.block_ids) < n_blocks:
                raise ValueError(f"chunk ending at {end} needs {n_blocks} blocks, got {len(chunk.block_ids)}")
            row0 = len(tokens)
            tokens.extend(chunk.token_ids)
            positions.extend(range(start, end))
            table = chunk.block_ids
            slots.extend(
                table[p // BLOCK_SIZE_TOKENS] * BLOCK_SIZE_TOKENS + p % BLOCK_SIZE_TOKENS for p in range(start, end)
            )
            n_keys = n_blocks * BLOCK_SIZE_TOKENS
            mask = torch.arange(n_keys)[None, :] > torch.arange(start, end)[:, None]
            chunks.append(
                _ChunkPlan(
                    rows=slice(row0, row0 + length),
                    blocks=torch.tensor(table[:n_blocks], dtype=torch.long, device=self.device),
                    mask=mask.to(self.device),
                    n_keys=n_keys,
                )
            )
            n_logits = min(chunk.logits_tokens, length)
            logit_rows.extend(range(row0 + length - n_logits, row0 + length))
        return tokens, positions, slots, chunks, logit_rows

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        tokens, positions, slots, chunks, logit_rows = self._plan(batch)
        if not tokens:
            return torch.zeros(0, self.info.vocab_size, dtype=torch.float32, device=self.device)
        hp = self.hp
        n_rows, n_real = len(tokens), len(slots)
        dev = self.device
        token_ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        slot_ids = torch.tensor(slots, dtype=torch.long, device=dev)
        cos = self._rope_cos.index_select(0, pos)[:, None, :]
        sin = self._rope_sin.index_select(0, pos)[:, None, :]
        n_qk_heads = hp.n_heads + hp.n_kv_heads
        half = hp.head_dim // 2
        hidden, eps, ffn = hp.hidden, hp.norm_eps, hp.ffn

        x = self._embed.index_select(0, token_ids)
        attn = torch.zeros(n_rows, hp.n_heads * hp.head_dim, dtype=self.dtype, device=dev)
        for layer, k_pool, v_pool in zip(self._layers, self._k_cache, self._v_cache):
            h = F.rms_norm(x, (hidden,), layer.attn_norm, eps)
            qkv = layer.qkv(h)
            qk = qkv[:, : self._qk_cols].view(n_rows, n_qk_heads, hp.head_dim)
            qk = qk * cos + torch.roll(qk, half, dims=-1) * sin
            k_new = qk[:n_real, hp.n_heads :]
            v_new = qkv[:n_real, self._qk_cols :].view(n_real, hp.n_kv_heads, hp.head_dim)
            k_pool.view(-1, hp.n_kv_heads, hp.head_dim).index_copy_(0, slot_ids, k_new)
            v_pool.view(-1, hp.n_kv_heads, hp.head_dim).index_copy_(0, slot_ids, v_new)
            q = qk[:, : hp.n_heads]
            for plan in chunks:
                self._attend(q[plan.rows], k_pool, v_pool, plan, attn[plan.rows])
            x = layer.out(attn, residual=x)
            h = F.rms_norm(x, (hidden,), layer.ffn_norm, eps)
            gate_up = layer.gate_up(h)
            act = F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
            x = layer.down(act, residual=x)

        n_logits = len(logit_rows)
        if n_logits == 0:
            return torch.zeros(0, self.info.vocab_size, dtype=torch.float32, device=dev)
        h = F.rms_norm(x[logit_rows], (hidden,), self._output_norm, eps)
        return self._head(h).float()

    def _attend(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: _ChunkPlan, out: torch.Tensor
    ) -> None:
        hp = self.hp
        n_kv, head_dim, group = hp.n_kv_heads, hp.head_dim, self._group
        # keys padded with zeros (masked) to whole tiles: every reduction has the same length whatever
        # the chunk sees, so a query's sums run over the same operands in the same shapes
        padded = -(-plan.n_keys // KEY_TILE_TOKENS) * KEY_TILE_TOKENS
        keys_t = q.new_zeros(n_kv, head_dim, padded)
        values = q.new_zeros(n_kv, padded, head_dim)
        keys_t[:, :, : plan.n_keys] = k_pool.index_select(0, plan.blocks).permute(2, 3, 0, 1).reshape(n_kv, head_dim, -1)
        values[:, : plan.n_keys] = v_pool.index_select(0, plan.blocks).permute(2, 0, 1, 3).reshape(n_kv, -1, head_dim)
        mask = F.pad(plan.mask, (0, padded - plan.n_keys), value=True)
        length = q.shape[0]
        step = max(1, SCORES_BUDGET // (n_kv * group * padded))
        for t0 in range(0, length, step):
            t1 = min(length, t0 + step)
            self._attend_rows(q[t0:t1], keys_t, values, mask[t0:t1], out[t0:t1])

    def _attend_rows(
        self, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Causal attention of ``n`` query tokens: GEMM rows are (group member, token) per KV head."""
        n_kv, head_dim, group = self.hp.n_kv_heads, self.hp.head_dim, self._group
        n, n_keys = q.shape[0], keys_t.shape[-1]
        rows = group * n
        queries = q.reshape(n, n_kv, group, head_dim).permute(1, 2, 0, 3).reshape(n_kv, rows, head_dim)
        if rows % ATTENTION_ROW_MULTIPLE:  # padded with copies of the last row (see module docstring)
            pad = queries[:, -1:].expand(n_kv, -rows % ATTENTION_ROW_MULTIPLE, head_dim)
            queries = torch.cat([queries, pad], dim=1)
        scores = torch.bmm(queries, keys_t)
        scores[:, :rows].view(n_kv, group, n, n_keys).masked_fill_(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.bmm(probs[:, :, :KEY_TILE_TOKENS], values[:, :KEY_TILE_TOKENS])
        for tile_start in range(KEY_TILE_TOKENS, n_keys, KEY_TILE_TOKENS):
            keys = slice(tile_start, tile_start + KEY_TILE_TOKENS)
            ctx = torch.baddbmm(ctx, probs[:, :, keys], values[:, keys])
        ctx = ctx[:, :rows].view(n_kv, group, n, head_dim).permute(2, 0, 1, 3)
        out.view(n, n_kv, group, head_dim).copy_(ctx)


class LlamaFamily:
    """``ModelFamily`` named ``llama``: GGUF files whose architecture is ``llama``."""

    name = "llama"

    def __init__(self, ctx: PluginContext, options: Mapping[str, Any]) -> None:
        self._ctx = ctx
        self._log = ctx.log

    def can_load(self, path: Path) -> bool:
        path = Path(path)
        return path.is_file() and is_gguf_file(path) and peek_string(path, "general.architecture") == "llama"

    def load(self, path: Path) -> LlamaModel:
        config = self._ctx.config
        dtype = torch_dtype(getattr(config, "dtype", "float32"))
        device = torch.device(getattr(config, "device", "cpu"))
        threads = getattr(config, "threads", None)
        if threads and device.type == "cpu" and torch.get_num_threads() != int(threads):
            self._log.info("torch CPU threads: %d (config threads)", int(threads))
            torch.set_num_threads(int(threads))
        gguf_file = GGUFFile(path)
        if gguf_file.architecture != "llama":
            raise ValueError(f"{path}: architecture {gguf_file.architecture!r} is not llama")
        weight_format = resolve_weight_format(str(getattr(config, "weight_format", "auto")), gguf_file, device)
        w = read_weights(gguf_file, dtype, device, weight_format, self._log)
        return LlamaModel(w.info, w.tokenizer, w.hp, w.embed, w.layers, w.output_norm, w.head, w.freq_factors)


