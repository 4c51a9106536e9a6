"""The DeepSeek-V4 forward pass behind the engine's :class:`~ds4d.contracts.Model` contract.

One step takes any mix of sequence chunks (prefill pieces of any length,
single decode tokens).  Token-wise work (embedding, hyper-connections, norms,
projections, MoE, head) runs over the whole step at once; attention runs per
chunk against that sequence's state slot and compressed-KV blocks (see
``cache.py``).  A chunk starting at position 0 starts the sequence afresh.

Only the hidden states of rows whose logits are asked for are finished: the
last layer's feed-forward runs on those rows alone (the others' KV and state
are complete after its attention), unless the paths' ``last_layer_rows_only`` is
off or the model counts every row's routing (a ``RoutingTally``, ``calibrate.py``).

Each step's result for a sequence is the same whatever else shares the step
and however its prompt was split into chunks, up to float rounding: the state
carried between chunks is exactly what a whole-sequence pass would have
computed at that point.

How each piece runs is fixed when the model is built (``paths.ForwardPaths``:
grouped experts and batched decode attention, hyper-connection, attention and
token-wise kernels, CUDA graphs per decode bucket; all on by default on CUDA,
off on the CPU, where the reference path is kept exact).  :meth:`DeepseekV4Model.with_paths`
builds another model over the same weights with other paths.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ds4d.contracts import ForwardBatch, ModelInfo, SeqChunk, Tokenizer
from ds4d.cuda import gguf_matmul
from ds4d.cuda.devices import to_device_async
from ds4d.cuda.graphs import bucket as _bucket
from ds4d.cuda.graphs import decode_buckets
from ds4d.cuda.rows import row_classes
from ds4d.models.deepseek_v4.attention import ChunkRows, StepInputs, attention_forward
from ds4d.models.deepseek_v4.cache import DeepseekV4Cache
from ds4d.models.deepseek_v4.config import DeepseekV4Config
from ds4d.models.deepseek_v4.decode import DecodeInputs, decode_attention, pack_rows
from ds4d.models.deepseek_v4.hyper import hc_boundary, hc_head, hc_post
from ds4d.models.deepseek_v4.moe import RoutingTally, moe_forward, predicted_experts
from ds4d.models.deepseek_v4.offload import counted_rows
from ds4d.models.deepseek_v4.ops import Rope, linear_bf16_weight_f32_out, rms_norm
from ds4d.models.deepseek_v4.paths import ForwardPaths
from ds4d.models.deepseek_v4.stored import Fp8Weight, GgufWeight
from ds4d.models.deepseek_v4.weights import ModelWeights, add_split_weights

log = logging.getLogger("ds4d.models")


class DeepseekV4Model:
    """A loaded V4 checkpoint with its own block pool and state slots.

    ``paths``: how each piece of the forward runs (default: every path the device can run,
    ``ForwardPaths.for_device``).  ``expert_offload``: an ``ExpertOffload`` (offload.py) when the
    routed experts are split over device and host.  ``routing_tally``: a ``RoutingTally`` that every
    routed (token, expert) pair adds to (calibration), or None."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        weights: ModelWeights,
        tokenizer: Tokenizer,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        expert_offload=None,
        paths: ForwardPaths | None = None,
        routing_tally: RoutingTally | None = None,
    ) -> None:
        self.cfg = cfg
        self.weights = weights
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.device = torch.device(device)
        self.paths = paths if paths is not None else ForwardPaths.for_device(self.device)
        if self.paths.decode_graphs == "cuda" and self.device.type != "cuda":
            raise ValueError(f"decode_graphs = cuda needs a CUDA device, not {self.device}")
        if (self.device.type == "cuda" and dtype == torch.bfloat16 and isinstance(weights.head, torch.Tensor)
                and _holds_bf16_values(weights.head)):
            weights.head = weights.head.to(torch.bfloat16)  # same values, half the bytes read per token
        self.rope_main, self.rope_compress = Rope.for_layers(cfg, self.device)
        self.cache: DeepseekV4Cache | None = None
        self.native_weights = any(isinstance(layer.attn.wq_b, (Fp8Weight, GgufWeight))
                                  or layer.ffn.experts.native is not None for layer in weights.layers)
        """FP8 linears / MXFP4 experts / GGUF blocks are multiplied as stored (``ds4d.cuda.quant_matmul``,
        ``gguf_matmul``)."""
        self.expert_offload = expert_offload
        self.routing_tally = routing_tally
        if self.paths.fused_prefill and dtype == torch.bfloat16:
            add_split_weights(weights)
        self._graphs = self._decode_buckets()
        self._graph_failure: str | None = None
        """Why a decode graph capture failed (then, with ``paths.graph_fallback``, decode runs eagerly)."""
        self.info = ModelInfo(
            family="deepseek_v4",
            name=cfg.name,
            vocab_size=cfg.vocab_size,
            max_context_tokens=cfg.max_position_embeddings,
            block_size_tokens=cfg.block_size_tokens,
            cache_bytes_per_block=DeepseekV4Cache.bytes_per_block(cfg, dtype),
            state_bytes_per_seq=DeepseekV4Cache.state_bytes_per_seq(cfg, dtype),
            default_chat_encoder="deepseek_v4",
            default_reasoning_parser="deepseek_v4",
            default_tool_parser="dsml",
            dtype=str(dtype).removeprefix("torch."),
            device=str(self.device),
            parameter_bytes=weights.parameter_bytes() + (expert_offload.stored_bytes if expert_offload else 0),
            extra={
                "compress_ratios": list(cfg.compress_ratios),
                "sliding_window": cfg.sliding_window,
                "num_hash_layers": cfg.num_hash_layers,
                "weights": "native" if self.native_weights else "decoded",
                "forward_paths": self.paths.as_dict(),
            },
        )

    def with_paths(self, paths: ForwardPaths | None = None, *, routing_tally: RoutingTally | None = None,
                   ) -> DeepseekV4Model:
        """A model over these weights, tokenizer and expert offload (its own cache and graphs), running
        ``paths`` (default: this model's) and counting routing into ``routing_tally`` (default: not).
        Cheap next to reading the weights again; the two models must not run steps at the same time
        (they share the offload's placement)."""
        return DeepseekV4Model(self.cfg, self.weights, self.tokenizer, dtype=self.dtype, device=self.device,
                               expert_offload=self.expert_offload, paths=self.paths if paths is None else paths,
                               routing_tally=routing_tally)

    def _decode_buckets(self):
        """What runs bucket-padded decode steps: CUDA graphs, the same steps eagerly, or nothing."""
        paths = self.paths
        if not paths.fast_path or paths.decode_graphs == "off":
            return None
        from ds4d.cuda.graphs import EagerBuckets, GraphCache, compiled

        if paths.decode_graphs == "padded":
            return EagerBuckets(self._decode_step)
        return GraphCache(compiled(self._decode_step) if paths.compile_decode else self._decode_step)

    @property
    def graph_failure(self) -> str | None:
        """Why a decode graph capture failed, if one did (decode has run eagerly since)."""
        return self._graph_failure

    @property
    def accepts_input_tokens(self) -> bool:
        """Decode steps may be fed their tokens on the device (``ForwardBatch.input_tokens``); not
        with expert offload, whose placement moves between steps would race a step queued ahead."""
        return self.expert_offload is None

    def activation_probe_contexts(self, max_context: int) -> list[int]:
        """Prompt lengths at whose end a prefill step holds the most activations (the memory plan
        profiles each): the longest context, and for layers with the lightning indexer the last
        length at which their compressed entries still go through a dense ``[queries, entries]``
        score block (past ``attention.SPARSE_FROM`` entries each query gathers only its picks)."""
        from ds4d.models.deepseek_v4.attention import SPARSE_FROM

        dense = {SPARSE_FROM * layer.attn.ratio for layer in self.weights.layers if layer.attn.indexer is not None}
        return sorted({min(c, max_context) for c in dense} | {max_context})

    # ------------------------------------------------------------------ contract

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        if self._graphs is not None:
            self._graphs.clear()  # they hold the old cache's addresses
        self.cache = None
        self.cache = DeepseekV4Cache(self.cfg, num_blocks, max_seqs, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("allocate_cache() must run before forward()")
        if self.expert_offload is not None:
            self.expert_offload.begin_step()
        return self._run(batch, self.cache)

    def expert_stats(self) -> dict:
        """Routed-expert placement and traffic (``ExpertOffload.expert_stats``); empty when all sit on the device."""
        return self.expert_offload.expert_stats() if self.expert_offload is not None else {}

    def export_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """``BlockCopyModel``: each block's compressed KV of every layer as one uint8 host tensor."""
        if self.cache is None:
            raise RuntimeError("allocate_cache() must run first")
        return self.cache.export_blocks(block_ids)

    def start_export(self, block_ids: Sequence[int]) -> tuple[list[torch.Tensor], Any]:
        """``AsyncBlockCopyModel``: :meth:`export_blocks` without a host sync (the payloads are
        complete once the returned event is; None: already)."""
        if self.cache is None:
            raise RuntimeError("allocate_cache() must run first")
        rows, copied = self.cache.start_export_rows(block_ids)
        return list(rows.unbind(0)), copied

    def import_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        """``BlockCopyModel``: write payloads made by :meth:`export_blocks` back into the pool."""
        if self.cache is None:
            raise RuntimeError("allocate_cache() must run first")
        self.cache.import_blocks(block_ids, payloads)

    def save_state(self, slot: int) -> list[torch.Tensor]:
        """A copy of ``slot``'s state (window ring and compressor tails).

        Together with the sequence's blocks it is everything needed to continue
        the sequence from where it stands, in any slot: :meth:`load_state` it
        into a slot, then forward a chunk with ``start_pos`` at that point.
        This is what prefix reuse at a request boundary needs beyond the blocks.
        """
        if self.cache is None:
            raise RuntimeError("allocate_cache() must run first")
        return self.cache.export_slot(slot)

    def load_state(self, slot: int, snapshot: list[torch.Tensor]) -> None:
        if self.cache is None:
            raise RuntimeError("allocate_cache() must run first")
        self.cache.import_slot(slot, snapshot)

    # ------------------------------------------------------------------ helpers

    @torch.inference_mode()
    def logits_for(self, token_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """Whole-sequence logits ``[n, vocab]`` on a private scratch cache."""
        block = self.cfg.block_size_tokens
        blocks = max(1, -(-len(token_ids) // block))
        scratch = DeepseekV4Cache(self.cfg, blocks, 1, self.dtype, self.device)
        chunk = SeqChunk(
            state_slot=0,
            token_ids=tuple(token_ids),
            start_pos=0,
            block_ids=tuple(range(blocks)),
            logits_tokens=len(token_ids),
        )
        return self._run(ForwardBatch(chunks=(chunk,)), scratch)

    def _check(self, batch: ForwardBatch, cache: DeepseekV4Cache) -> None:
        check_batch(batch, self.cfg, cache.max_seqs)

    def _run(self, batch: ForwardBatch, cache: DeepseekV4Cache) -> torch.Tensor:
        cfg, device = self.cfg, self.device
        self._check(batch, cache)
        if batch.input_tokens is not None and any(len(c.token_ids) != 1 for c in batch.chunks):
            raise ValueError("input_tokens feeds one token per chunk")
        one_token_each = batch.chunks and all(len(c.token_ids) == c.logits_tokens == 1 for c in batch.chunks)
        if self.paths.fast_path and one_token_each:
            return self._decode(batch, cache)
        chunks, ids, positions, keep = [], [], [], []
        row = 0
        for chunk in batch.chunks:
            count = len(chunk.token_ids)
            if count == 0:
                continue
            chunks.append(
                ChunkRows(
                    begin=row,
                    end=row + count,
                    start_pos=chunk.start_pos,
                    slot=chunk.state_slot,
                    block_ids=torch.tensor(chunk.block_ids, dtype=torch.long, device=device),
                )
            )
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.start_pos + count))
            keep.extend(range(row + count - chunk.logits_tokens, row + count))
            row += count
        if not ids:
            return torch.zeros(0, cfg.vocab_size, dtype=torch.float32, device=device)

        token_ids = torch.tensor(ids, dtype=torch.long, device=device)
        if batch.input_tokens is not None:
            token_ids = batch.input_tokens.to(device=device, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        step = StepInputs(
            chunks=chunks,
            positions=pos,
            rope_main=self.rope_main.cos_sin(pos),
            rope_compress=self.rope_compress.cos_sin(pos),
        )
        with row_classes():  # the step's matmuls meet one of a few row counts (``ds4d.cuda.rows``)
            return self._prompt_step(token_ids, step, cache, keep)

    def _prompt_step(self, token_ids: torch.Tensor, step: StepInputs, cache: DeepseekV4Cache,
                     keep: list[int]) -> torch.Tensor:
        cfg, device = self.cfg, self.device
        rows = torch.tensor(keep, dtype=torch.long, device=device)
        # always run the layers: they write the chunks' KV and state; every row through all of them where
        # calibration counts routing, where asked to, or where every row is wanted anyway
        block = self.paths.prefill_block
        if block and len(token_ids) > block:  # layer by layer over blocks of rows (see ``_blocks``)
            hidden = self._blocks(token_ids, step, cache, keep, block)
        elif self.routing_tally is not None or not self.paths.last_layer_rows_only or len(keep) == len(token_ids):
            hidden = self._layers(token_ids, step, cache)[rows]
        else:
            hidden = self._layers(token_ids, step, cache, keep=rows)
        if not keep:
            return torch.zeros(0, cfg.vocab_size, dtype=torch.float32, device=device)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        cfg, weights = self.cfg, self.weights
        fused = self.paths.fused_hc
        final = rms_norm(
            hc_head(hidden, weights.head_hc, cfg.hc_eps, cfg.rms_norm_eps, fused=fused), weights.norm, cfg.rms_norm_eps
        )
        if isinstance(weights.head, GgufWeight):  # a GGUF file's head in its blocks
            rows = HEAD_GEMV_ROWS if weights.head.qtype in gguf_matmul.BLOCKWISE else gguf_matmul.GEMV_ROWS
            return weights.head.matmul(final.float(), gemv_rows=rows, decoded_rows=HEAD_DECODED_ROWS)
        if weights.head.dtype == torch.float32:
            return F.linear(final.float(), weights.head)
        return linear_bf16_weight_f32_out(final.float(), weights.head)

    def _decode(self, batch: ForwardBatch, cache: DeepseekV4Cache) -> torch.Tensor:
        """One token per sequence: pack (token, position, slot, block table) rows and run the decode step."""
        count = len(batch.chunks)
        width = max(len(c.block_ids) for c in batch.chunks)
        offload = self.expert_offload
        graphs = self._graphs if self._graph_failure is None and cache is self.cache and (
            offload is None or offload.capturable(_bucket(count))) else None
        rows = count
        if graphs is not None:
            rows, width = _bucket(count), max(8, _bucket(width))
        # not waited for: a step queued ahead does not stall here
        packed = to_device_async(pack_decode_rows(batch.chunks, cache, rows, width), self.device)
        if batch.input_tokens is not None:
            packed[:count, 0] = batch.input_tokens
        if graphs is not None:
            logits = self._replay(graphs, rows, width, packed)
            if logits is not None:
                return logits[:count].clone()
        return self._decode_step(packed, cache)[:count].clone()

    def _replay(self, graphs, rows: int, width: int, packed: torch.Tensor, *,
                out_of_memory: bool = False) -> torch.Tensor | None:
        """The bucket's graph replayed (captured first if new); None when its capture failed, after
        which every decode step runs eagerly (``paths.graph_fallback``; else the failure is raised).
        ``out_of_memory``: a capture that ran out of device memory is raised, not a reason to stop capturing."""
        try:
            return graphs.run((rows, width), packed)
        except RuntimeError as exc:
            if not self.paths.graph_fallback or (out_of_memory and isinstance(exc, torch.OutOfMemoryError)):
                raise
            log.warning("decode graph capture failed; decode steps run eagerly from now on: %s", exc)
            self._graph_failure = f"{type(exc).__name__}: {exc}"
            graphs.clear()
            return None

    @torch.inference_mode()
    def warm_decode(self, max_rows: int, max_blocks: int) -> int:
        """Capture now the decode graph of every bucket a step of at most ``max_rows`` sequences of at most
        ``max_blocks`` blocks can meet (``ds4d.engine.warmup``), each run on padding rows only (the scratch
        slot and the trash block); how many buckets were run.  Buckets the decode path would not capture
        (expert offload that cannot) are left out."""
        graphs, offload, done = self._graphs, self.expert_offload, 0
        if graphs is None or self._graph_failure is not None or self.cache is None:
            return 0
        for rows, width in decode_buckets(max_rows, max_blocks):
            if offload is not None and not offload.capturable(rows):
                continue
            packed = to_device_async(pack_decode_rows([], self.cache, rows, width), self.device)
            try:
                if self._replay(graphs, rows, width, packed, out_of_memory=True) is None:
                    break
            except torch.OutOfMemoryError as exc:
                log.warning("warm-up: the decode graph of %d rows x %d blocks does not fit now (%s); it and the "
                            "larger ones are captured when first needed", rows, width, str(exc).splitlines()[0])
                break
            done += 1
        return done

    def _decode_step(self, packed: torch.Tensor, cache: DeepseekV4Cache | None = None) -> torch.Tensor:
        """Logits ``[B, V]`` for packed decode rows (capturable: no host reads, fixed shapes)."""
        cache = cache if cache is not None else self.cache
        dec = unpack_decode_rows(packed, cache, self.rope_main, self.rope_compress)
        with counted_rows(self.expert_offload, packed[:, 2] != cache.scratch_slot):
            return self._logits(self._layers(packed[:, 0], dec, cache))

    def _layers(self, token_ids: torch.Tensor, step: StepInputs | DecodeInputs, cache: DeepseekV4Cache,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """The streams after the last layer ``[T, m, D]``; with ``keep`` (row indices), only those
        rows': the last layer's feed-forward then runs on them alone (no other row's hidden state
        is read; attention still runs on every row, since it writes their KV and state)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        embedded = self.weights.embed[token_ids].to(self.dtype)
        streams = embedded.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        decode = isinstance(step, DecodeInputs)
        paths = self.paths
        kernels = not decode and paths.fast_path and paths.fused_prefill
        route_kernel = decode and paths.fast_path and paths.route_kernel
        if decode:
            attend = partial(decode_attention, kernel=paths.fast_path and paths.decode_kernel)
        else:
            attend = partial(attention_forward, local_window=paths.fast_path,
                             fused=paths.fast_path and paths.fused_attention, kernels=kernels)
        boundary = partial(hc_boundary, iterations=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=eps,
                           fused=paths.fused_hc, kernels=kernels)
        offload, tally = self.expert_offload, self.routing_tally
        ahead = offload is not None and decode  # cold experts fetched a layer ahead (``ExpertOffload.fetch_ahead``)
        output = post = comb = None
        layers = self.weights.layers
        last = len(layers) - 1
        for index, (layer, layer_cache) in enumerate(zip(layers, cache.layers)):
            x, streams, post, comb = boundary(output, streams, post, comb, layer.attn_hc, layer.attn_norm)
            if ahead and index == 0:
                offload.fetch_ahead(0, x, partial(predicted_experts, x, token_ids, layer.ffn, cfg))
            output = attend(x, step, layer.attn, layer_cache, cfg, self.rope_compress)
            if index == last and keep is not None:
                if keep.numel() == 0:  # no row wanted: the last feed-forward has nothing to do
                    return streams[:0]
                output, streams, post, comb, token_ids = (t[keep] for t in (output, streams, post, comb, token_ids))
            x, streams, post, comb = boundary(output, streams, post, comb, layer.ffn_hc, layer.ffn_norm)
            if ahead and index < last:
                offload.fetch_ahead(index + 1, x, partial(predicted_experts, x, token_ids, layers[index + 1].ffn, cfg))
            if offload is not None:
                output = offload.moe_forward(index, x, token_ids, layer.ffn, cfg, decode=decode,
                                             tally=None if tally is None else tally.layer(index),
                                             route_kernel=route_kernel)
            else:
                output = moe_forward(x, token_ids, layer.ffn, cfg, grouped=paths.fast_path, kernels=kernels,
                                     tally=None if tally is None else tally.layer(index),
                                     beside=decode and paths.shared_beside, route_kernel=route_kernel,
                                     decode_kernels=decode and paths.fast_path and paths.decode_kernel)
        return hc_post(output, streams, post, comb)


    def _blocks(self, token_ids: torch.Tensor, step: StepInputs, cache: DeepseekV4Cache, keep: list[int],
                block: int) -> torch.Tensor:
        """The streams of the ``keep`` rows after the last layer, computed layer by layer: each layer
        takes the step's rows ``block`` at a time, in order, before the next layer starts.

        A block's attention at a layer reads that layer's KV and state as the blocks before it left
        them, as a later engine step would, so the result is the one a step per block computes.  With
        routed experts offloaded, a cold expert the step uses is copied once per layer (it stays on
        the device while the layer's blocks run: ``ExpertOffload.layer_pass``), not once per block.
        Every block's streams stay on the device between layers (``hc_mult x hidden`` values a row)."""
        cfg, eps, paths = self.cfg, self.cfg.rms_norm_eps, self.paths
        kernels = paths.fast_path and paths.fused_prefill
        attend = partial(attention_forward, local_window=paths.fast_path,
                         fused=paths.fast_path and paths.fused_attention, kernels=kernels)
        boundary = partial(hc_boundary, iterations=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=eps,
                           fused=paths.fused_hc, kernels=kernels)
        offload, tally = self.expert_offload, self.routing_tally
        all_rows = tally is not None or not paths.last_layer_rows_only
        parts = []
        for begin in range(0, len(token_ids), block):
            ids = token_ids[begin : begin + block]
            wanted = [r - begin for r in keep if begin <= r < begin + len(ids)]
            streams = self.weights.embed[ids].to(self.dtype).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
            parts.append({"ids": ids, "step": step_rows(step, begin, begin + len(ids)), "streams": streams,
                          "output": None, "post": None, "comb": None,
                          "keep": torch.tensor(wanted, dtype=torch.long, device=self.device)})
        last = len(self.weights.layers) - 1
        for index, (layer, layer_cache) in enumerate(zip(self.weights.layers, cache.layers)):
            with offload.layer_pass(index) if offload is not None else nullcontext():
                for part in parts:
                    x, part["streams"], part["post"], part["comb"] = boundary(
                        part["output"], part["streams"], part["post"], part["comb"], layer.attn_hc, layer.attn_norm)
                    part["output"] = attend(x, part["step"], layer.attn, layer_cache, cfg, self.rope_compress)
                    if index == last and not all_rows:  # the last feed-forward on the wanted rows only
                        wanted = part["keep"]
                        part["keep"] = torch.arange(len(wanted), device=self.device)
                        for name in ("output", "streams", "post", "comb", "ids"):
                            part[name] = part[name][wanted]
                        if not len(wanted):
                            continue
                    x, part["streams"], part["post"], part["comb"] = boundary(
                        part["output"], part["streams"], part["post"], part["comb"], layer.ffn_hc, layer.ffn_norm)
                    if offload is not None:
                        part["output"] = offload.moe_forward(index, x, part["ids"], layer.ffn, cfg,
                                                             tally=None if tally is None else tally.layer(index))
                    else:
                        layer_tally = None if tally is None else tally.layer(index)
                        part["output"] = moe_forward(x, part["ids"], layer.ffn, cfg, grouped=paths.fast_path,
                                                     kernels=kernels, tally=layer_tally)
        pieces = [hc_post(p["output"], p["streams"], p["post"], p["comb"])[p["keep"]] for p in parts if len(p["keep"])]
        if not pieces:
            return parts[0]["streams"][:0]
        return torch.cat(pieces)


def step_rows(step: StepInputs, begin: int, end: int) -> StepInputs:
    """The rows ``[begin, end)`` of a prefill step as a step of their own: each chunk cut to its rows
    there (a chunk's later rows start where its earlier ones end)."""
    chunks = [ChunkRows(begin=max(c.begin, begin) - begin, end=min(c.end, end) - begin,
                        start_pos=c.start_pos + max(begin - c.begin, 0), slot=c.slot, block_ids=c.block_ids)
              for c in step.chunks if c.begin < end and c.end > begin]
    return StepInputs(chunks=chunks, positions=step.positions[begin:end],
                      rope_main=tuple(t[begin:end] for t in step.rope_main),
                      rope_compress=tuple(t[begin:end] for t in step.rope_compress))


HEAD_GEMV_ROWS = 64
"""Rows whose logits a GGUF head of a block-wise type gives by GEMV (each program decodes a weight tile once
for 8 rows; other types: ``gguf_matmul.GEMV_ROWS``): up to here that reads the blocks fewer times than
decoding the head to float32 writes and reads it."""
HEAD_DECODED_ROWS = 16384
"""Past :data:`HEAD_GEMV_ROWS`, a GGUF head is decoded to float32 this many vocabulary rows at a time
(256 MiB at V4's 4096 inputs), never whole."""


def _holds_bf16_values(tensor: torch.Tensor) -> bool:
    return tensor.dtype == torch.float32 and torch.equal(tensor, tensor.to(torch.bfloat16).float())


def pack_decode_rows(chunks: Sequence[SeqChunk], cache: DeepseekV4Cache, rows: int, width: int) -> torch.Tensor:
    """One-token chunks as ``[rows, 3 + width]`` int64 host rows (:func:`~ds4d.models.deepseek_v4.decode.pack_rows`)."""
    return pack_rows([(c.token_ids[0], c.start_pos, c.state_slot, c.block_ids) for c in chunks], rows, width,
                     cache.scratch_slot, cache.trash_block)


def unpack_decode_rows(packed: torch.Tensor, cache: DeepseekV4Cache, rope_main: Rope, rope_compress: Rope) -> DecodeInputs:
    """The decode step's inputs from :func:`pack_decode_rows` rows on the device (capturable)."""
    positions = packed[:, 1]
    return DecodeInputs(
        positions=positions,
        slots=packed[:, 2],
        block_table=packed[:, 3:],
        trash_block=cache.trash_block,
        rope_main=rope_main.cos_sin(positions),
        rope_compress=rope_compress.cos_sin(positions),
    )


def check_batch(batch: ForwardBatch, cfg, max_seqs: int, num_blocks: int | None = None) -> None:
    """Refuse a batch the engine contract rules out, before any state is touched."""
    block = cfg.block_size_tokens
    slots = [c.state_slot for c in batch.chunks]
    if len(set(slots)) != len(slots):
        raise ValueError("two chunks in one step share a state slot")
    for chunk in batch.chunks:
        end = chunk.start_pos + len(chunk.token_ids)
        if not 0 <= chunk.state_slot < max_seqs:
            raise ValueError(f"state slot {chunk.state_slot} outside 0..{max_seqs - 1}")
        if len(chunk.block_ids) < -(-end // block):
            raise ValueError(f"{len(chunk.block_ids)} blocks cannot hold positions up to {end}")
        if num_blocks is not None and any(not 0 <= b < num_blocks for b in chunk.block_ids):
            raise ValueError(f"block id outside 0..{num_blocks - 1}")
        if not 0 <= chunk.logits_tokens <= len(chunk.token_ids):
            raise ValueError("logits_tokens exceeds the chunk length")
        if end > cfg.max_position_embeddings:
            raise ValueError(f"position {end} beyond max_position_embeddings")
