"""One rank's share of a sharded DeepSeek-V4 forward, and the step every rank runs in lock-step.

A rank is ``(stage, ep_rank)`` in a grid of ``stages x ep_size`` (see
``ds4d.parallel``).  Its share:

* **layers**: stage ``s`` owns a contiguous range of the layers (an even split);
  stage 0 also holds the embedding, the last stage the output head;
* **routed experts**: ep-rank ``e`` holds a contiguous range of each of its
  layers' experts (an even split); everything else of a layer (attention, the
  hyper-connections, the router, the shared expert) is replicated over the
  ranks of a stage;
* **cache**: the window rings, compressor tails and compressed-KV pool of its
  own layers only.  Attention is replicated, so the ranks of a stage hold
  identical copies of the stage's cache and state.

:meth:`ShardRunner.step` is the SPMD step: every rank is given the same
:class:`~ds4d.contracts.ForwardBatch` and builds the same step inputs from it.
Stage 0 embeds; other stages receive the hyper-connection streams ``[T, m, D]``
from the rank with the same ep-rank in the previous stage.  In each MoE layer
every rank routes all tokens with the unchanged router (``moe.route``), runs
the tokens that picked its own experts through them, and an ``all_reduce``
over the stage sums the partial outputs; the shared expert is computed while
that reduction is in flight.  The last stage's ep-rank 0 computes the logits of
the rows that need them and sends them to rank 0.

On CUDA a decode step (one token per sequence) is padded to a batch bucket and
a block-table bucket, as in the single-process model, and every rank replays
its own CUDA graph of the whole step, NCCL sends, receives and all-reduces
included: all ranks see the same batch, so they capture and replay the same
buckets in the same order.

With ``weight_format = native`` a rank keeps its FP8 linears and MXFP4 experts
as stored (the single-process kernels).  With expert offload a rank keeps its
own experts in host RAM and the hot ones on its device
(:class:`~ds4d.models.deepseek_v4.offload.ExpertOffload` over the rank's local
experts; the pairs routed to other ranks reach it with weight 0).

Arithmetic per expert is unchanged, so the only differences from the
single-process forward are the order in which the per-expert contributions are
summed (float rounding; greedy choices agree), plus, with the grouped path in
bf16, one more rounding of each rank's partial sum.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ds4d.contracts import ForwardBatch
from ds4d.models.deepseek_v4.attention import ChunkRows, StepInputs, attention_forward
from ds4d.models.deepseek_v4.cache import DeepseekV4Cache
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.decode import DecodeInputs, decode_attention
from ds4d.models.deepseek_v4.hyper import hc_boundary, hc_head, hc_post
from ds4d.models.deepseek_v4.loader import SafetensorsCheckpoint, WeightReader
from ds4d.models.deepseek_v4.model import (
    _bucket,
    _holds_bf16_values,
    pack_decode_rows,
    unpack_decode_rows,
)
from ds4d.models.deepseek_v4.moe import _routed_grouped, _swiglu, route
from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions, counted_rows
from ds4d.models.deepseek_v4.ops import Rope, linear_bf16_weight_f32_out, rms_norm
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v4.stored import Fp8Weight
from ds4d.models.deepseek_v4.weights import (
    F32,
    HyperWeights,
    LayerWeights,
    ModelWeights,
    MoEWeights,
    _attention,
    _experts,
    _hyper,
    _linear,
)
from ds4d.parallel.launch import ParallelGroups


@dataclass
class _Flow:
    """The transfers of a pipelined step: sends issued without waiting for them, and rank 0's receives of
    the logits, posted once every send of the step is (NCCL runs a group's transfers in the order they
    were issued, so a receive posted earlier would hold the later sends back)."""

    sends: list = field(default_factory=list)
    receives: list[tuple[torch.Tensor, int]] = field(default_factory=list)

    def finish(self) -> None:
        works = self.sends + [dist.irecv(tensor, src=src) for tensor, src in self.receives]
        for work in works:
            work.wait()


def _send(tensor: torch.Tensor, dst: int, flow: _Flow | None) -> None:
    """Send ``tensor`` to rank ``dst``: at once, or in ``flow`` without waiting."""
    if flow is None:
        dist.send(tensor, dst=dst)
    else:
        flow.sends.append(dist.isend(tensor, dst=dst))


def split_evenly(count: int, parts: int) -> list[range]:
    """``range(count)`` cut into ``parts`` contiguous pieces, the first ones one longer where uneven."""
    if parts < 1 or parts > count:
        raise ValueError(f"cannot split {count} items into {parts} non-empty parts")
    base, extra = divmod(count, parts)
    pieces, start = [], 0
    for index in range(parts):
        size = base + (index < extra)
        pieces.append(range(start, start + size))
        start += size
    return pieces


@dataclass(frozen=True)
class ShardLayout:
    """What one rank owns."""

    layers: range
    experts: range
    first_stage: bool
    last_stage: bool


def shard_layout(cfg: DeepseekV4Config, stage: int, stages: int, ep_rank: int, ep_size: int) -> ShardLayout:
    return ShardLayout(
        layers=split_evenly(cfg.num_hidden_layers, stages)[stage],
        experts=split_evenly(cfg.n_routed_experts, ep_size)[ep_rank],
        first_stage=stage == 0,
        last_stage=stage == stages - 1,
    )


def stage_config(cfg: DeepseekV4Config, layers: range) -> DeepseekV4Config:
    """``cfg`` cut to ``layers`` (what the stage's cache is shaped by)."""
    staged = replace(cfg, compress_ratios=tuple(cfg.compress_ratios[i] for i in layers), num_hidden_layers=len(layers))
    if staged.block_size_tokens != cfg.block_size_tokens:
        raise ValueError("a stage's layers would use another KV block size than the model")
    return staged


# --------------------------------------------------------------------------- loading


def _layer(
    reader: WeightReader, cfg: DeepseekV4Config, layer: int, experts: range, expert_device: torch.device | None
) -> LayerWeights:
    p = f"layers.{layer}."
    f = p + "ffn."
    hashed = cfg.is_hash_layer(layer)
    return LayerWeights(
        attn_norm=reader.tensor(p + "attn_norm.weight", F32),
        ffn_norm=reader.tensor(p + "ffn_norm.weight", F32),
        attn_hc=_hyper(reader, p + "hc_attn_"),
        ffn_hc=_hyper(reader, p + "hc_ffn_"),
        attn=_attention(reader, cfg, layer),
        ffn=MoEWeights(
            gate=reader.tensor(f + "gate.weight", F32),
            bias=None if hashed else reader.tensor(f + "gate.bias", F32),
            tid2eid=reader.index(f + "gate.tid2eid") if hashed else None,
            experts=_experts(reader, cfg, layer, expert_device, experts),
            shared_w1=_linear(reader, f + "shared_experts.w1.weight"),
            shared_w2=_linear(reader, f + "shared_experts.w2.weight"),
            shared_w3=_linear(reader, f + "shared_experts.w3.weight"),
        ),
    )


def read_shard(
    path, cfg: DeepseekV4Config, layout: ShardLayout, dtype: torch.dtype, device, *, native: bool = False,
    expert_device: torch.device | None = None,
) -> ModelWeights:
    """Only this rank's tensors of the checkpoint at ``path`` (see :func:`shard_weights`): decoded, or
    with ``native`` FP8 linears and MXFP4 experts as stored (``weight_format = native``)."""
    checkpoint = SafetensorsCheckpoint(path)
    try:
        reader = WeightReader(checkpoint, cfg, dtype=dtype, device=device, native=native)
        reader.check_complete()
        return shard_weights(reader, cfg, layout, expert_device)
    finally:
        checkpoint.close()


def shard_weights(
    reader, cfg: DeepseekV4Config, layout: ShardLayout, expert_device: torch.device | None = None
) -> ModelWeights:
    """This rank's tensors from ``reader`` (its layers, its experts, embedding/head where its stage needs them).

    ``reader``: a checkpoint's :class:`WeightReader` or a
    :class:`~ds4d.models.deepseek_v4.random_init.RandomReader`.
    ``ModelWeights.layers`` holds the stage's layers in order; tensors the stage
    does not use are empty placeholders.  ``expert_device``: where the routed experts go (the host,
    for expert offload)."""
    nothing = torch.empty(0, device=reader.device)
    last = layout.last_stage
    return ModelWeights(
        embed=reader.tensor("embed.weight") if layout.first_stage else nothing,
        norm=reader.tensor("norm.weight", F32) if last else nothing,
        head=reader.tensor("head.weight", F32) if last else nothing,
        head_hc=_hyper(reader, "hc_head_") if last else HyperWeights(nothing, nothing, nothing),
        layers=[_layer(reader, cfg, layer, layout.experts, expert_device) for layer in layout.layers],
    )


# --------------------------------------------------------------------------- the step


class ShardRunner:
    """One rank's weights, cache and step; every rank calls :meth:`step` with the same batch."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        layout: ShardLayout,
        weights: ModelWeights,
        groups: ParallelGroups,
        dtype: torch.dtype,
        *,
        fast_path: bool | None = None,
        use_graphs: bool = True,
        offload: OffloadOptions | None = None,
        padded_decode: bool = False,
    ) -> None:
        self.cfg, self.layout, self.weights, self.groups, self.dtype = cfg, layout, weights, groups, dtype
        self.device = groups.device
        on_cuda = self.device.type == "cuda"
        fast = on_cuda if fast_path is None else fast_path
        if self.device.type == "cuda" and dtype == torch.bfloat16 and _holds_bf16_values(weights.head):
            weights.head = weights.head.to(torch.bfloat16)
        hc = "torch"
        if fast and on_cuda:
            from ds4d.cuda.hc_kernels import available

            hc = "numba" if available() else "torch"
        graphs = "cuda" if fast and on_cuda and use_graphs else "padded" if fast and padded_decode else "off"
        self.paths = ForwardPaths(fast_path=fast, hc_kernels=hc, decode_graphs=graphs)
        """The shard's forward paths: grouped experts, the Numba hyper-connection kernel, decode buckets."""
        self.native_weights = any(
            isinstance(layer.attn.wq_b, Fp8Weight) or layer.ffn.experts.native is not None for layer in weights.layers
        )
        self.stage_cfg = stage_config(cfg, layout.layers)
        self.rope_main, self.rope_compress = Rope.for_layers(cfg, self.device)
        self.cache: DeepseekV4Cache | None = None
        self.offload: ExpertOffload | None = None
        """This rank's routed experts in host RAM, the hot ones on its device (``expert_vram_gib`` per GPU)."""
        if offload is not None:
            local_cfg = replace(self.stage_cfg, n_routed_experts=len(layout.experts))
            self.offload = ExpertOffload(weights, local_cfg, device=self.device, dtype=dtype, options=offload)
        self.pipelined_steps = 0
        """Prompt steps run cut into micro-batches (:meth:`step_pipelined`)."""
        self.graphs = None
        if graphs == "cuda":
            from ds4d.cuda.graphs import GraphCache

            self.graphs = GraphCache(self._decode_step)
        elif graphs == "padded":  # the same padded steps, run eagerly (CPU tests)
            from ds4d.cuda.graphs import EagerBuckets

            self.graphs = EagerBuckets(self._decode_step)

    def release(self) -> None:
        """Destroy the captured decode graphs (before the process group goes: they hold NCCL work);
        stop the expert offload's threads and unpin its host memory."""
        if self.graphs is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.graphs.clear()
        if self.offload is not None:
            self.offload.close()
            self.offload = None

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        if self.graphs is not None:
            self.graphs.clear()  # they hold the old cache's addresses
        self.cache = None
        self.cache = DeepseekV4Cache(self.stage_cfg, num_blocks, max_seqs, self.dtype, self.device)

    def cache_bytes_per_block(self) -> int:
        return DeepseekV4Cache.bytes_per_block(self.stage_cfg, self.dtype)

    def state_bytes_per_seq(self) -> int:
        return DeepseekV4Cache.state_bytes_per_seq(self.stage_cfg, self.dtype)

    @torch.inference_mode()
    def step(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits ``[rows, vocab]`` on rank 0 (the :meth:`Model.forward` answer); None on other ranks."""
        chunks = [c for c in batch.chunks if c.token_ids]
        if self.offload is not None:
            self.offload.begin_step()
        decode = bool(chunks) and all(len(c.token_ids) == c.logits_tokens == 1 for c in chunks)
        if self.graphs is not None and decode and (self.offload is None or self.offload.capturable(_bucket(len(chunks)))):
            try:
                return self._decode_graphed(chunks)
            except RuntimeError as exc:  # every rank fails the same capture; all go on eagerly
                logging.getLogger("ds4d.models").warning("decode graph capture failed, running eagerly: %s", exc)
                self.graphs.clear()
                self.graphs = None
        token_ids, step, keep = self._inputs(batch)
        if token_ids is None:
            return self._no_rows()
        return self._run(token_ids, step, keep)

    @torch.inference_mode()
    def step_pipelined(self, parts: list[ForwardBatch]) -> torch.Tensor | None:
        """One prompt step cut into micro-batches (``microbatch.split_prompt``), run in order: each stage
        sends a micro-batch's streams on without waiting for the next stage to take them, and goes on
        with the next micro-batch.  Logits of every part's rows, in order, on rank 0; None elsewhere."""
        if self.offload is not None:
            self.offload.begin_step()
        self.pipelined_steps += 1
        flow = _Flow()
        logits = []
        for part in parts:
            token_ids, step, keep = self._inputs(part)
            if token_ids is not None:
                logits.append(self._run(token_ids, step, keep, flow))
        flow.finish()
        if self.groups.rank != 0:
            return None
        return torch.cat(logits) if logits else self._no_rows()

    def _no_rows(self) -> torch.Tensor | None:
        if self.groups.rank != 0:
            return None
        return torch.zeros(0, self.cfg.vocab_size, dtype=torch.float32, device=self.device)

    def _run(self, token_ids: torch.Tensor, step, keep: torch.Tensor | None,
             flow: _Flow | None = None) -> torch.Tensor | None:
        """Embed or receive, this rank's layers, send on; logits of rows ``keep`` (None: all) on rank 0.
        ``flow`` (a pipelined step): the sends go out without waiting, and rank 0's receive of the logits
        is left to it (the logits are there once :meth:`_Flow.finish` returns)."""
        cfg, device, groups = self.cfg, self.device, self.groups
        if self.layout.first_stage:
            embedded = self.weights.embed[token_ids].to(self.dtype)
            streams = embedded.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        else:
            streams = torch.empty(len(token_ids), cfg.hc_mult, cfg.hidden_size, dtype=self.dtype, device=device)
            dist.recv(streams, src=groups.rank_of(groups.stage - 1, groups.ep_rank))
        streams = self._layers(streams, token_ids, step)
        if not self.layout.last_stage:
            _send(streams, groups.rank_of(groups.stage + 1, groups.ep_rank), flow)
        rows = len(token_ids) if keep is None else len(keep)
        if not rows:
            return self._no_rows()
        head_rank = groups.rank_of(groups.stages - 1, 0)
        logits = None
        if groups.rank == head_rank:
            logits = self._logits(streams if keep is None else streams[keep])
            if head_rank != 0:
                _send(logits, 0, flow)
        if groups.rank != 0:
            return None
        if head_rank != 0:
            logits = torch.empty(rows, cfg.vocab_size, dtype=torch.float32, device=device)
            if flow is None:
                dist.recv(logits, src=head_rank)
            else:
                flow.receives.append((logits, head_rank))
        return logits

    def _decode_graphed(self, chunks) -> torch.Tensor | None:
        """Pad the decode rows to buckets (scratch slot, trash block) and replay the bucket's graph."""
        count = len(chunks)
        rows, width = _bucket(count), max(8, _bucket(max(len(c.block_ids) for c in chunks)))
        packed = pack_decode_rows(chunks, self.cache, rows, width).to(self.device)
        logits = self.graphs.run((rows, width), packed)
        return None if logits is None else logits[:count].clone()

    def _decode_step(self, packed: torch.Tensor) -> torch.Tensor | None:
        """The captured decode step: packed ``[token, position, slot, block table...]`` rows."""
        step = unpack_decode_rows(packed, self.cache, self.rope_main, self.rope_compress)
        with counted_rows(self.offload, packed[:, 2] != self.cache.scratch_slot):
            return self._run(packed[:, 0], step, None)

    def _inputs(self, batch: ForwardBatch):
        """(token ids, per-step attention inputs, rows needing logits) as in the single-process forward."""
        device = self.device
        chunks = [c for c in batch.chunks if c.token_ids]
        if not chunks:
            return None, None, None
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=device)
        if self.paths.fast_path and all(len(c.token_ids) == c.logits_tokens == 1 for c in chunks):
            trash = self.cache.trash_block
            width = max(len(c.block_ids) for c in chunks)
            table = [[*c.block_ids] + [trash] * (width - len(c.block_ids)) for c in chunks]
            positions = torch.tensor([c.start_pos for c in chunks], dtype=torch.long, device=device)
            step = DecodeInputs(
                positions=positions,
                slots=torch.tensor([c.state_slot for c in chunks], dtype=torch.long, device=device),
                block_table=torch.tensor(table, dtype=torch.long, device=device),
                trash_block=trash,
                rope_main=self.rope_main.cos_sin(positions),
                rope_compress=self.rope_compress.cos_sin(positions),
            )
            return ids, step, torch.arange(len(chunks), device=device)
        rows, positions, keep, row = [], [], [], 0
        for chunk in chunks:
            count = len(chunk.token_ids)
            block_ids = torch.tensor(chunk.block_ids, dtype=torch.long, device=device)
            rows.append(ChunkRows(row, row + count, chunk.start_pos, chunk.state_slot, block_ids))
            positions.extend(range(chunk.start_pos, chunk.start_pos + count))
            keep.extend(range(row + count - chunk.logits_tokens, row + count))
            row += count
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        step = StepInputs(rows, pos, self.rope_main.cos_sin(pos), self.rope_compress.cos_sin(pos))
        return ids, step, torch.tensor(keep, dtype=torch.long, device=device)

    def _layers(self, streams: torch.Tensor, token_ids: torch.Tensor, step) -> torch.Tensor:
        cfg, eps, fused = self.cfg, self.cfg.rms_norm_eps, self.paths.fused_hc
        if isinstance(step, DecodeInputs):
            attend = partial(decode_attention, kernel=self.paths.fast_path and self.paths.decode_kernel)
        else:
            attend = partial(attention_forward, local_window=self.paths.fast_path)
        decode = isinstance(step, DecodeInputs)
        boundary = partial(hc_boundary, iterations=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=eps, fused=fused)
        output = post = comb = None
        for index, (layer, layer_cache) in enumerate(zip(self.weights.layers, self.cache.layers)):
            x, streams, post, comb = boundary(output, streams, post, comb, layer.attn_hc, layer.attn_norm)
            output = attend(x, step, layer.attn, layer_cache, cfg, self.rope_compress)
            x, streams, post, comb = boundary(output, streams, post, comb, layer.ffn_hc, layer.ffn_norm)
            output = self._moe(x, token_ids, layer.ffn, index, decode)
        return hc_post(output, streams, post, comb)

    def _moe(
        self, x: torch.Tensor, token_ids: torch.Tensor, weights: MoEWeights, index: int, decode: bool
    ) -> torch.Tensor:
        """Routed experts of this rank, summed over the stage, plus the (replicated) shared expert."""
        cfg, limit = self.cfg, self.cfg.swiglu_limit
        expert_weights, indices = route(x, token_ids, weights, cfg)
        first, end = self.layout.experts.start, self.layout.experts.stop
        if self.paths.fast_path or self.offload is not None:
            # fixed shapes (capturable): pairs routed elsewhere go to local expert 0 with weight 0
            mine = (indices >= first) & (indices < end)
            local = torch.where(mine, indices - first, torch.zeros_like(indices))
            if self.offload is not None:
                routed = self.offload.routed(index, x, expert_weights * mine, local, limit=limit, decode=decode)
            else:
                routed = _routed_grouped(x, expert_weights * mine, local, weights, limit)
        else:
            routed = torch.zeros_like(x)
            bank = weights.experts
            for expert in torch.unique(indices).tolist():
                if not first <= expert < end:
                    continue
                token_idx, slot = torch.where(indices == expert)
                at = expert - first
                out = _swiglu(x[token_idx], bank.weight("w1", at), bank.weight("w3", at), bank.weight("w2", at), limit)
                routed.index_add_(0, token_idx, out * expert_weights[token_idx, slot, None].to(out.dtype))
        pending = None
        if self.groups.ep_group is not None:
            pending = dist.all_reduce(routed, group=self.groups.ep_group, async_op=True)
        shared = _swiglu(x, weights.shared_w1, weights.shared_w3, weights.shared_w2, limit)
        if pending is not None:
            pending.wait()
        return routed + shared

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        cfg, weights = self.cfg, self.weights
        final = rms_norm(hc_head(hidden, weights.head_hc, cfg.hc_eps, cfg.rms_norm_eps), weights.norm, cfg.rms_norm_eps)
        if weights.head.dtype == torch.float32:
            return F.linear(final.float(), weights.head)
        return linear_bf16_weight_f32_out(final.float(), weights.head)

    # ------------------------------------------------------------------ per-sequence state

    def export_slot(self, slot: int) -> list[torch.Tensor]:
        return [view.to("cpu", copy=True) for view in self.cache.slot_views(slot)]

    # ------------------------------------------------------------------ KV blocks (prefix cache tiers)

    def payload_bytes(self) -> int:
        return self.cache.payload_bytes()

    def export_rows(self, block_ids: list[int]) -> torch.Tensor:
        return self.cache.export_rows(block_ids)

    def import_blocks(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        self.cache.import_blocks(block_ids, payloads)

    def import_slot(self, slot: int, snapshot: list[torch.Tensor]) -> None:
        self.cache.import_slot(slot, [saved.to(self.device) for saved in snapshot])
