"""The engine's ``Model`` for DeepSeek-V4.1: state slots plus a paged pool of compressed KV.

What a V4.1 sequence leaves behind splits as V4's does (``deepseek_v4/cache.py``):

* **Block pool** (shared, paged, in the engine's block accounting): per KV source layer
  the compressed KV entries, ``block_size_tokens / ratio`` per block, and at a KV source
  that is also an index source the index keys beside them.  An entry is written once, when
  its last token arrives, and never changes, so a full block can be shared between
  sequences and copied to the prefix cache's lower tiers (``export_blocks`` /
  ``import_blocks``: every pool's rows of the block, source by source, as bytes).
* **State slot** (one per running sequence): the forward's
  :class:`~ds4d.models.deepseek_v41.state.SequenceState` minus the entries: the window
  ring of every layer, the ratio-2 compressor tails, the last Engram token ids, the
  position, and how many entries each source holds (``position // ratio``).  The rings and
  tails live in :class:`~ds4d.models.deepseek_v41.decode.SlotArrays` (the state's rings
  are views into it).  ``save_state`` copies a slot (a list of tensors), ``load_state``
  restores it into any slot; with the sequence's blocks that is everything needed to go on
  (prefix reuse at a state checkpoint).

The one-token chunks of a step go, by the model's ``decode_graphs`` path, through the
fixed-shape step of ``decode.py`` together (CUDA graphs per bucket on CUDA), or through
:meth:`DeepseekV41Model.decode_many` (``batched_decode``), or one by one; every other chunk
runs :meth:`DeepseekV41Model.forward`, its entry counts and compressor tail read from the
slot first (``_enter``) and the tail written back after (``_leave``).  A prefill chunk that
wants at most its last logits runs on the triangle of rows they and the state depend on
(``model.row_plan``).  A chunk at position 0 starts a fresh state, any other continues its
slot's state, which must stand exactly at the chunk's ``start_pos``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from ds4d.contracts import ForwardBatch, ModelInfo, Tokenizer
from ds4d.cuda import moe_gemv
from ds4d.cuda.devices import to_device_async
from ds4d.cuda.graphs import EagerBuckets, GraphCache, bucket, compiled, decode_buckets
from ds4d.models.deepseek_v4.cache import payload_rows
from ds4d.models.deepseek_v4.decode import pack_rows
from ds4d.models.deepseek_v41.decode import FixedDecode, SlotArrays
from ds4d.models.deepseek_v41.model import DeepseekV41Model
from ds4d.models.deepseek_v41.state import GroupState, GrowingRows, SequenceState

DEFAULT_BLOCK_TOKENS = 128
log = logging.getLogger("ds4d")


class PagedRows:
    """A sequence's rows of one pool ``[num_blocks, rows_per_block, width]``, through its block table.

    The same interface as :class:`~ds4d.models.deepseek_v41.state.GrowingRows` (``count``,
    ``append``, ``view``), so the attention code cannot tell them apart."""

    def __init__(self, pool: torch.Tensor, count: int = 0) -> None:
        self.pool = pool
        self.count = count
        self.blocks = torch.empty(0, dtype=torch.long, device=pool.device)

    def append(self, rows: torch.Tensor) -> None:
        per_block = self.pool.shape[1]
        last = self.count + rows.shape[0] - 1
        if rows.shape[0] and last // per_block >= self.blocks.numel():
            raise ValueError(f"entry {last} lies past the sequence's {self.blocks.numel()} blocks")
        index = torch.arange(self.count, last + 1, device=self.pool.device)
        self.pool[self.blocks[index // per_block], index % per_block] = rows.to(self.pool.dtype)
        self.count += rows.shape[0]

    def view(self) -> torch.Tensor:
        per_block = self.pool.shape[1]
        used = self.blocks[: -(-self.count // per_block)]
        return self.pool[used].reshape(-1, self.pool.shape[2])[: self.count]

    def clone(self) -> GrowingRows:
        copy = GrowingRows(self.pool.shape[2], self.pool.dtype, self.pool.device)
        copy.append(self.view())
        return copy


class DeepseekV41Pool:
    """The tensors of ``num_blocks`` blocks: per KV source its entry pool and (index sources) key pool,
    each with one more block at the end (:attr:`trash_block`: the fixed-shape decode's writes of
    steps that complete no entry, and its padding rows' block tables)."""

    def __init__(self, model: DeepseekV41Model, num_blocks: int, block_tokens: int) -> None:
        cfg = model.cfg
        self.num_blocks = num_blocks
        self.trash_block = num_blocks
        self.entries: dict[int, torch.Tensor] = {}
        self.index_keys: dict[int, torch.Tensor] = {}
        for plan in model.plans:
            if not plan.is_kv_source:
                continue
            per_block = block_tokens // plan.ratio
            self.entries[plan.layer] = torch.zeros(num_blocks + 1, per_block, cfg.head_dim, dtype=model.dtype,
                                                   device=model.device)
            if plan.is_index_source:
                self.index_keys[plan.layer] = torch.zeros(num_blocks + 1, per_block, cfg.index_head_dim,
                                                          dtype=model.dtype, device=model.device)

    def pools(self) -> list[torch.Tensor]:
        """The paged tensors in payload order: per source (layer order) its entries, then its index keys."""
        out = []
        for source, entries in sorted(self.entries.items()):
            out.append(entries)
            if source in self.index_keys:
                out.append(self.index_keys[source])
        return out

    def payload_bytes(self) -> int:
        return sum(pool[0].numel() * pool.element_size() for pool in self.pools())


def bytes_per_block(model: DeepseekV41Model, block_tokens: int) -> int:
    size = torch.empty((), dtype=model.dtype).element_size()
    total = 0
    for plan in model.plans:
        if plan.is_kv_source:
            width = model.cfg.head_dim + (model.cfg.index_head_dim if plan.is_index_source else 0)
            total += block_tokens // plan.ratio * width * size
    return total


def state_bytes_per_seq(model: DeepseekV41Model) -> int:
    """Window rings plus at most one tail row (kv and gate, float32) per ratio-2 source and the Engram ids."""
    cfg = model.cfg
    size = torch.empty((), dtype=model.dtype).element_size()
    rings = cfg.num_hidden_layers * cfg.sliding_window * cfg.head_dim * size
    tails = sum(2 * (plan.ratio - 1) * cfg.head_dim * 4 for plan in model.plans if plan.is_kv_source)
    return rings + tails + 8 * (model.hasher.history if model.hasher is not None else 0)


class DeepseekV41Serving:
    """A loaded V4.1 model with its block pool and state slots (``Model``, ``StatefulModel``,
    ``BlockCopyModel``)."""

    def __init__(self, model: DeepseekV41Model, tokenizer: Tokenizer, *, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 parameter_bytes: int = 0, extra: dict[str, Any] | None = None) -> None:
        ratios = {plan.ratio for plan in model.plans if plan.ratio}
        if any(block_tokens % ratio for ratio in ratios):
            raise ValueError(f"block_tokens {block_tokens} must be a multiple of every compress ratio {sorted(ratios)}")
        cfg = model.cfg
        self.model = model
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.block_tokens = block_tokens
        self.pool: DeepseekV41Pool | None = None
        self.arrays: SlotArrays | None = None
        """The slots' window rings and compressor tails: each slot's state reads and writes them there."""
        self.fixed: FixedDecode | None = None
        self.graphs: GraphCache | EagerBuckets | None = None
        """What runs the fixed-shape decode step per bucket (``paths.decode_graphs``; None: off)."""
        self._graph_failure: str | None = None
        self.slots: list[SequenceState | None] = []
        self.triangular_prefill = True
        """A prefill chunk that wants at most its last logits runs the layers after the last KV source
        on the rows those logits and the state depend on only (``model.row_plan``)."""
        self.info = ModelInfo(
            family="deepseek_v41",
            name=cfg.name,
            vocab_size=cfg.vocab_size,
            max_context_tokens=cfg.max_position_embeddings,
            block_size_tokens=block_tokens,
            cache_bytes_per_block=bytes_per_block(model, block_tokens),
            state_bytes_per_seq=state_bytes_per_seq(model),
            **chat_plugins(),
            dtype=str(model.dtype).removeprefix("torch."),
            device=str(model.device),
            parameter_bytes=parameter_bytes,
            extra={"compress_ratios": [plan.ratio for plan in model.plans],
                   "kv_source_layers": list(cfg.kv_source_layer_ids),
                   "sliding_window": cfg.sliding_window, "forward_paths": model.paths.as_dict(), **(extra or {})},
        )

    # ------------------------------------------------------------------ Model

    def allocate_cache(self, num_blocks: int, max_seqs: int) -> None:
        if self.graphs is not None:
            self.graphs.clear()  # they hold the old tensors' addresses
        self.pool = self.arrays = self.fixed = self.graphs = None
        self.pool = DeepseekV41Pool(self.model, num_blocks, self.block_tokens)
        self.arrays = SlotArrays(self.model, max_seqs)
        self.slots = [None] * max_seqs
        mode = self.model.paths.decode_graphs
        if mode != "off":
            self.fixed = FixedDecode(self.model, self.arrays, self.pool.entries, self.pool.index_keys,
                                     self.pool.trash_block)
            if mode == "cuda":
                step = compiled(self.fixed.step) if self.model.paths.compile_decode else self.fixed.step
                self.graphs = GraphCache(step)
            else:
                self.graphs = EagerBuckets(self.fixed.step)

    @property
    def graph_failure(self) -> str | None:
        """Why a decode graph capture failed, if one did (decode has run the same step eagerly since)."""
        return self._graph_failure

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.pool is None:
            raise RuntimeError("allocate_cache() must run before forward()")
        self._check(batch)
        if self.model.expert_offload is not None:  # between steps: placement may move
            self.model.expert_offload.begin_step()
        tokens = batch.input_tokens.tolist() if batch.input_tokens is not None else None
        steps = []
        for n, chunk in enumerate(batch.chunks):
            ids = [int(tokens[n])] if tokens is not None else list(chunk.token_ids)
            if not ids:
                continue
            state = self._state_for(chunk.state_slot, chunk.start_pos)
            self._bind(state, chunk.block_ids)
            steps.append((n, state, ids))
        results: dict[int, torch.Tensor] = {}
        singles = [step for step in steps if len(step[2]) == 1]
        if self.graphs is not None and singles:  # one-token chunks: the fixed-shape step of all of them
            logits = self._decode_fixed(singles, batch)
            results = {n: logits[i: i + 1] for i, (n, _, _) in enumerate(singles)}
        elif self.model.paths.batched_decode and len(singles) > 1:  # through the layers together
            for n, state, _ in singles:
                self._enter(batch.chunks[n].state_slot, state)
            logits = self.model.decode_many([state for _, state, _ in singles], [ids[0] for *_, ids in singles])
            results = {n: logits[i: i + 1] for i, (n, _, _) in enumerate(singles)}
            for n, state, _ in singles:
                self._leave(batch.chunks[n].state_slot, state)
        for n, state, ids in steps:
            if n not in results:
                last_only = self.triangular_prefill and batch.chunks[n].logits_tokens <= 1 and len(ids) > 1
                slot = batch.chunks[n].state_slot
                self._enter(slot, state)
                results[n] = self.model.forward(state, ids, last_only=last_only)
                self._leave(slot, state)
        out = []
        for n, _, _ in steps:
            wanted, logits = batch.chunks[n].logits_tokens, results[n]
            if wanted:
                out.append(logits[logits.shape[0] - wanted:])
        if not out:
            return torch.zeros(0, self.cfg.vocab_size, dtype=torch.float32, device=self.model.device)
        return torch.cat(out).float()

    def _check(self, batch: ForwardBatch) -> None:
        slots = [c.state_slot for c in batch.chunks]
        if len(set(slots)) != len(slots):
            raise ValueError("two chunks in one step share a state slot")
        for chunk in batch.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            if not 0 <= chunk.state_slot < len(self.slots):
                raise ValueError(f"state slot {chunk.state_slot} outside 0..{len(self.slots) - 1}")
            if len(chunk.block_ids) < -(-end // self.block_tokens):
                raise ValueError(f"{len(chunk.block_ids)} blocks cannot hold positions up to {end}")
            if any(not 0 <= b < self.pool.num_blocks for b in chunk.block_ids):
                raise ValueError(f"block id outside 0..{self.pool.num_blocks - 1}")
            if not 0 <= chunk.logits_tokens <= len(chunk.token_ids):
                raise ValueError("logits_tokens exceeds the chunk length")
            if end > self.cfg.max_position_embeddings:
                raise ValueError(f"position {end} beyond max_position_embeddings")
        if batch.input_tokens is not None and any(len(c.token_ids) != 1 for c in batch.chunks):
            raise ValueError("input_tokens feeds one token per chunk")

    def _decode_fixed(self, singles: list[tuple[int, SequenceState, list[int]]], batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[len(singles), vocab]`` of one-token chunks through the fixed-shape step, at the
        bucket of their count and block-table width; advances their states."""
        count = len(singles)
        rows = bucket(count)
        width = max(8, bucket(max(len(batch.chunks[n].block_ids) for n, _, _ in singles)))
        packed = pack_rows([(ids[0], state.position, batch.chunks[n].state_slot, batch.chunks[n].block_ids)
                            for n, state, ids in singles], rows, width, self.arrays.scratch, self.pool.trash_block)
        packed = to_device_async(packed, self.model.device)
        engram = self._engram_rows(singles, rows)
        logits = self._step_bucket(rows, width, packed, engram)[:count].clone()
        for _, state, ids in singles:
            self.model._advance(state, ids)
        return logits

    def _step_bucket(self, rows: int, width: int, packed: torch.Tensor, engram: tuple[torch.Tensor, ...], *,
                     out_of_memory: bool = False) -> torch.Tensor:
        """The fixed-shape step of one bucket: its graph replayed (captured first if new), or run eagerly
        where it cannot be captured or a capture failed (from then on).  ``out_of_memory``: a capture that ran
        out of device memory is raised, not a reason to stop capturing."""
        mode = self.model.paths.decode_graphs
        if mode == "cuda" and (self._graph_failure is not None or not self._capturable(rows)):
            return self.fixed.step(packed, *engram)
        try:
            return self.graphs.run((rows, width), packed, *engram)
        except RuntimeError as exc:
            if mode != "cuda" or (out_of_memory and isinstance(exc, torch.OutOfMemoryError)):
                raise
            # the step writes each row's state where its position says: running it again is exact
            log.warning("decode graph capture failed; decode steps run eagerly from now on: %s", exc)
            self._graph_failure = f"{type(exc).__name__}: {exc}"
            self.graphs.clear()
            return self.fixed.step(packed, *engram)

    @torch.inference_mode()
    def warm_decode(self, max_rows: int, max_blocks: int) -> int:
        """Capture now the decode graph of every bucket a step of at most ``max_rows`` sequences of at most
        ``max_blocks`` blocks can meet (``ds4d.engine.warmup``), each run on padding rows only (the scratch
        slot, the trash block); how many buckets were run.  Buckets a CUDA device runs eagerly (``_capturable``)
        are left out."""
        if self.graphs is None:
            return 0
        hasher, done = self.model.hasher, 0
        for rows, width in decode_buckets(max_rows, max_blocks):
            if self._graph_failure is not None:
                break
            if self.model.paths.decode_graphs == "cuda" and not self._capturable(rows):
                continue
            packed = to_device_async(pack_rows([], rows, width, self.arrays.scratch, self.pool.trash_block),
                                     self.model.device)
            engram = ()
            if hasher is not None:
                gathered = self.model._gather_engram(hasher.row_ids(torch.zeros(0, dtype=torch.long),
                                                                    torch.zeros(rows, dtype=torch.long)))
                engram = tuple(gathered[layer] for layer in sorted(gathered))
            try:
                self._step_bucket(rows, width, packed, engram, out_of_memory=True)
            except torch.OutOfMemoryError as exc:
                log.warning("warm-up: the decode graph of %d rows x %d blocks does not fit now (%s); it and the "
                            "larger ones are captured when first needed", rows, width, str(exc).splitlines()[0])
                break
            done += self._graph_failure is None
        return done

    def _capturable(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows can be captured: its routed experts take the row kernel (the
        grouped matmuls count each expert's rows on the host), and with expert offload each is read
        where it sits (``ExpertOffload.capturable``: no routing read back, no copy)."""
        offload = self.model.expert_offload
        if offload is not None:
            return offload.capturable(rows)
        return self.model.paths.expert_rows and rows * self.cfg.num_experts_per_tok <= moe_gemv.MAX_ROWS

    def expert_stats(self) -> dict:
        """Routed-expert placement and traffic (``ExpertOffload.expert_stats``); empty when all sit on the device."""
        offload = self.model.expert_offload
        return offload.expert_stats() if offload is not None else {}

    def _engram_rows(self, singles, rows: int) -> tuple[torch.Tensor, ...]:
        """Each Engram layer's gathered rows ``[rows, columns, head_dim]`` for the chunks' tokens, in layer
        order (padding rows look up row 0)."""
        hasher = self.model.hasher
        if hasher is None:
            return ()
        row_ids = torch.cat([hasher.row_ids(state.engram_ids, torch.tensor(ids, dtype=torch.long))
                             for _, state, ids in singles])
        row_ids = torch.cat([row_ids, row_ids.new_zeros(rows - row_ids.shape[0], *row_ids.shape[1:])])
        gathered = self.model._gather_engram(row_ids)
        return tuple(gathered[layer] for layer in sorted(gathered))

    def _state_for(self, slot: int, start_pos: int) -> SequenceState:
        if start_pos == 0:
            self.slots[slot] = self._fresh_state(slot)
        state = self.slots[slot]
        if state is None or state.position != start_pos:
            where = "empty" if state is None else f"at position {state.position}"
            raise ValueError(f"state slot {slot} is {where}, the chunk starts at {start_pos}")
        return state

    def _fresh_state(self, slot: int, position: int = 0) -> SequenceState:
        """A state at ``position`` whose rings are the slot's (zeroed) and whose entries are in the pool."""
        rings = self.arrays.ring_views(slot)
        for ring in rings:
            ring.zero_()
        groups = {}
        for plan in self.model.plans:
            if plan.is_kv_source:
                empty = torch.empty(0, self.cfg.head_dim, dtype=torch.float32, device=self.model.device)
                keys = self.pool.index_keys.get(plan.layer)
                groups[plan.layer] = GroupState(
                    tail_kv=empty, tail_gate=empty, entries=PagedRows(self.pool.entries[plan.layer]),
                    index_keys=PagedRows(keys) if keys is not None else GrowingRows(
                        self.cfg.index_head_dim, self.model.dtype, self.model.device))
        return SequenceState(position=position, windows=rings, groups=groups)

    def _enter(self, slot: int, state: SequenceState) -> None:
        """Before the per-sequence forward runs ``state``: its entry counts and compressor tails from
        where the slot keeps them (all the fixed-shape step updates)."""
        for plan in self.model.plans:
            if not plan.is_kv_source:
                continue
            group = state.groups[plan.layer]
            group.entries.count = state.position // plan.ratio
            if isinstance(group.index_keys, PagedRows):
                group.index_keys.count = group.entries.count
            if plan.ratio > 1:
                tail, pending = self.arrays.tail_index[plan.layer], state.position % plan.ratio
                group.tail_kv = self.arrays.tail_kv[slot, tail, None][:pending]
                group.tail_gate = self.arrays.tail_gate[slot, tail, None][:pending]

    def _leave(self, slot: int, state: SequenceState) -> None:
        """After it: the compressor tails back into the slot."""
        for plan in self.model.plans:
            if plan.is_kv_source and plan.ratio > 1:
                group = state.groups[plan.layer]
                if group.tail_kv.shape[0]:
                    tail = self.arrays.tail_index[plan.layer]
                    self.arrays.tail_kv[slot, tail] = group.tail_kv[-1]
                    self.arrays.tail_gate[slot, tail] = group.tail_gate[-1]

    def _bind(self, state: SequenceState, block_ids: Sequence[int]) -> None:
        table = torch.tensor(list(block_ids), dtype=torch.long, device=self.model.device)
        for group in state.groups.values():
            for rows in (group.entries, group.index_keys):
                if isinstance(rows, PagedRows):
                    rows.blocks = table

    def place_probe_state(self, slot: int, position: int) -> None:
        """Put in ``slot`` a state standing at ``position`` whose contents are zeros: the window rings
        full, every source holding the entries (and index keys) of ``position`` tokens, a ratio-2
        tail where the position is odd.  For the GPU memory plan's profiling step, which only needs a
        forward at the end of a long prompt to allocate what a real one would."""
        state = self._fresh_state(slot, position)
        self.arrays.tail_kv[slot].zero_()
        self.arrays.tail_gate[slot].zero_()
        if self.model.hasher is not None:
            state.engram_ids = torch.zeros(min(position, self.model.hasher.history), dtype=torch.int64)
        self.slots[slot] = state

    # ------------------------------------------------------------------ StatefulModel

    def save_state(self, slot: int) -> list[torch.Tensor]:
        """``slot``'s state as tensors: [position and per source (entries, index keys), Engram ids,
        the window rings in layer order, per source (tail kv, tail gate)].  The entries themselves
        are in the sequence's blocks."""
        state = self.slots[slot]
        if state is None:
            raise ValueError(f"state slot {slot} holds no sequence")
        self._enter(slot, state)
        header = [state.position]
        tails = []
        for _, group in sorted(state.groups.items()):
            header += [group.entries.count, group.index_keys.count]
            tails += [group.tail_kv.clone(), group.tail_gate.clone()]
        return [torch.tensor(header, dtype=torch.long), state.engram_ids.clone(),
                *(ring.clone() for ring in state.windows), *tails]

    def load_state(self, slot: int, snapshot: list[torch.Tensor]) -> None:
        layers, sources = self.cfg.num_hidden_layers, sorted(self.cfg.kv_source_layer_ids)
        if len(snapshot) != 2 + layers + 2 * len(sources) or snapshot[0].numel() != 1 + 2 * len(sources):
            raise ValueError("state snapshot does not match this model's state layout")
        header = snapshot[0].tolist()
        ratios = {plan.layer: plan.ratio for plan in self.model.plans}
        for i, source in enumerate(sources):
            if header[1 + 2 * i] != header[0] // ratios[source]:
                raise ValueError("state snapshot does not match this model's state layout")
        rings = snapshot[2: 2 + layers]
        if any(ring.shape != (self.cfg.sliding_window, self.cfg.head_dim) for ring in rings):
            raise ValueError("state snapshot does not match this model's state layout")
        state = self._fresh_state(slot, header[0])
        state.engram_ids = snapshot[1].clone()
        for window, ring in zip(state.windows, rings):
            window.copy_(ring)
        for i, source in enumerate(sources):
            tail_kv, tail_gate = snapshot[2 + layers + 2 * i], snapshot[3 + layers + 2 * i]
            if tail_kv.shape[0]:
                tail = self.arrays.tail_index[source]
                self.arrays.tail_kv[slot, tail] = tail_kv[-1].to(self.model.device)
                self.arrays.tail_gate[slot, tail] = tail_gate[-1].to(self.model.device)
        self.slots[slot] = state

    # ------------------------------------------------------------------ BlockCopyModel

    def export_blocks(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """Each block as one uint8 host tensor: every pool's rows of the block, in :meth:`DeepseekV41Pool.pools` order."""
        if self.pool is None:
            raise RuntimeError("allocate_cache() must run first")
        pools = self.pool.pools()
        if not block_ids or not pools:
            return [torch.empty(0, dtype=torch.uint8) for _ in block_ids]
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.model.device)
        rows = torch.cat([pool.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8)
                          for pool in pools], dim=1).cpu()
        return list(rows.unbind(0))

    def import_blocks(self, block_ids: Sequence[int], payloads: Sequence[Any]) -> None:
        if self.pool is None:
            raise RuntimeError("allocate_cache() must run first")
        raw = payload_rows(block_ids, payloads, self.pool.payload_bytes())
        pools = self.pool.pools()
        if not raw or not pools:
            return
        rows = torch.stack(raw).to(self.model.device)
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.model.device)
        offset = 0
        for pool in pools:
            size = pool[0].numel() * pool.element_size()
            values = rows[:, offset:offset + size].contiguous().view(pool.dtype).view(len(block_ids), *pool.shape[1:])
            pool.index_copy_(0, index, values)
            offset += size


def chat_plugins() -> dict[str, str]:
    """The chat plugins a V4.1 model asks for by default (``chat_encoder = auto`` etc.): the V4.1
    chat format (spaced DSML tags, ``<｜System｜>``, numeric reasoning effort)."""
    return {"default_chat_encoder": "deepseek_v41", "default_reasoning_parser": "deepseek_v41",
            "default_tool_parser": "dsml_v41"}
