"""Scheduler mechanics: budgets, chunking, block accounting, preemption.

The policy plugin only orders waiting requests and picks preemption victims;
everything that guarantees progress lives here:

* Running sequences are served before new ones are admitted, decodes first,
  then prefill chunks, oldest first.  Each gets ``min(uncomputed,
  prefill_chunk, remaining budget)`` tokens, so a long prompt with a tiny
  budget still advances every step it is scheduled.
* When blocks run out the policy's victim is preempted (its blocks released,
  its progress dropped, recomputed later; a chunk it already has this step is
  dropped and its tokens go back to the budget).  The policy chooses among the
  running sequences other than the oldest: the oldest is never a victim while a
  younger one exists, whatever the policy would pick, so it always finishes
  and no preempt/restart loop can starve everyone.
* A request that could never fit is refused before it is queued, not here:
  the kernel caps the context at what the pool holds, and the server refuses
  a prompt at that cap (``ServingState.output_budget``) before any stream.
* A waiting request whose cached prefix is being read from disk in the
  background (:meth:`PrefixCache.prefetch`) is skipped until the reads are
  done; the running requests and the requests behind it go on meanwhile.
* A waiting request of a model with per-sequence state whose furthest state
  checkpoint lies past what the pool has room to promote while other requests
  run waits (admission stops there, as when its first chunk does not fit)
  rather than resuming earlier and recomputing blocks it would need anyway.
* A model with per-sequence state checkpoints at the end of each prompt and of
  each request, and inside a prompt where ``checkpoint_plan`` says (before a
  volatile tail, after the system prompt and tools, at message starts, every
  ``PrefixCache.checkpoint_every_tokens``): the chunk that would cross such a
  position ends there, so the state at that position exists.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from ds4d.cache.blocks import BlockPool, block_keys
from ds4d.cache.manager import PrefixCache, Reuse
from ds4d.contracts import SchedulerPolicy
from ds4d.engine.checkpoint_plan import checkpoint_positions
from ds4d.engine.request import SeqStatus, Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    """The sequence (engine-thread object; the plan is consumed within the step)."""
    start_pos: int
    """First position fed this step (== seq.num_computed_tokens at plan time)."""
    num_tokens: int
    sample: bool
    """This chunk reaches the end of the known tokens: sample the next one."""
    logits_tokens: int
    """Trailing positions that need logits (prompt logprobs need them all)."""


@dataclass(frozen=True)
class StepPlan:
    """The scheduler's single hand-off to the runner for one engine step."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...] = ()
    """Request ids preempted while planning (they return to the waiting queue)."""

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        policy: SchedulerPolicy,
        *,
        max_num_seqs: int,
        step_tokens: int,
        prefill_chunk: int,
        namespace: bytes,
        prefix_reuse: bool = True,
        clock: Callable[[], float] | None = None,
        cache: PrefixCache | None = None,
    ) -> None:
        self.pool = pool
        self.cache = cache or PrefixCache(pool)
        """Prefix lookup across tiers, promotion/demotion, state checkpoints, accounting."""
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.step_tokens = step_tokens
        self.prefill_chunk = prefill_chunk
        self.namespace = namespace
        self.prefix_reuse = prefix_reuse and self.cache.reusable
        self.reuse_off_reason = "" if self.prefix_reuse else (
            "prefix caching is disabled (config prefix_caching = false)" if not pool.prefix_caching or
            not prefix_reuse else "prefix reuse is off: the model has per-sequence state but cannot copy KV blocks")
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.preemptions_total = 0
        self._waiting_keys: dict[str, list[bytes]] = {}
        """Block keys of waiting sequences already looked up (their tokens do not change while waiting)."""

    # ------------------------------------------------------------------ queue

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence, *, checkpoint: bool = False) -> None:
        """Finish or abort: release everything the sequence holds.

        With ``checkpoint`` (a request that ended normally), a model with per-sequence
        state first saves a checkpoint at the end of what was computed, so the next
        turn of the conversation resumes there."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if checkpoint:
            self._checkpoint(seq)
        self._release(seq)
        self._forget_lookup(seq)
        seq.status = SeqStatus.FINISHED

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning

    def plan(self) -> StepPlan:
        budget = self.step_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        order = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.arrival_time))
        for seq in order:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            n = self._chunk_tokens(seq, budget)
            before = len(preempted)
            grown = self._grow(seq, seq.num_computed_tokens + n, preempted)
            if len(preempted) > before:  # a victim may already have its chunk of this step
                kept = [c for c in chunks if c.seq.status is SeqStatus.RUNNING]
                budget += sum(c.num_tokens for c in chunks) - sum(c.num_tokens for c in kept)
                chunks = kept
            if not grown:
                continue
            chunks.append(self._chunk(seq, n))
            budget -= n

        if not preempted:
            for seq in self.policy.order_waiting(self.waiting):
                if budget == 0 or len(self.running) >= self.max_num_seqs:
                    break
                if not self._prefix_ready(seq):
                    continue  # its cached prefix is still being read from disk
                if self.running and not self._room_to_resume(seq):
                    break  # the pool cannot take the cached prefix yet: the running requests will free blocks
                reuse = self._admit(seq)
                n = self._chunk_tokens(seq, budget)
                if not self._grow(seq, seq.num_computed_tokens + n, None):
                    self._release(seq)
                    self.running.remove(seq)
                    self.waiting.insert(0, seq)
                    seq.status = SeqStatus.WAITING
                    break
                if reuse is not None:  # count a lookup once, when its admission sticks
                    self.cache.commit(reuse)
                    if reuse.num_tokens:
                        self.pool.hits += 1
                    elif reuse.lookups:
                        self.pool.misses += 1
                chunks.append(self._chunk(seq, n))
                budget -= n
        self.cache.after_plan()
        return StepPlan(tuple(chunks), tuple(preempted))

    def _chunk_tokens(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to compute this step: ``min(uncomputed, prefill_chunk, budget)``, cut
        short to end at the next position a stateful model checkpoints at."""
        n = min(seq.num_uncomputed_tokens, self.prefill_chunk, budget)
        start, marks = seq.num_computed_tokens, seq.checkpoint_marks
        i = bisect.bisect_right(marks, start)
        if i < len(marks) and marks[i] < start + n:
            n = marks[i] - start
        return n

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        sample = start + n == seq.num_tokens
        wants_prompt = seq.request.params.prompt_logprobs is not None and start < seq.num_prompt_tokens
        logits_tokens = n if wants_prompt else (1 if sample else 0)
        return ScheduledChunk(seq, start, n, sample, logits_tokens)

    def _keys(self, seq: Sequence) -> list[bytes]:
        keys = self._waiting_keys.get(seq.request_id)
        if keys is None:
            keys = block_keys(seq.all_token_ids, self.pool.block_size, self._namespace(seq))
            self._waiting_keys[seq.request_id] = keys
        return keys

    def _prefix_ready(self, seq: Sequence) -> bool:
        """Start background reads of the sequence's prefix blocks; True once none is in flight."""
        if not self.prefix_reuse or seq.request.params.prompt_logprobs is not None:
            return True
        return self.cache.prefetch(seq.request_id, seq.all_token_ids, self._keys(seq), self._namespace(seq))

    def _room_to_resume(self, seq: Sequence) -> bool:
        """The pool has room now to promote the blocks up to the furthest state checkpoint this
        prompt could resume at (always, for a model without per-sequence state)."""
        if not (self.prefix_reuse and self.cache.stateful) or seq.request.params.prompt_logprobs is not None:
            return True
        return self.cache.room_to_resume(seq.all_token_ids, self._keys(seq), self._namespace(seq))

    def _forget_lookup(self, seq: Sequence) -> None:
        self._waiting_keys.pop(seq.request_id, None)
        self.cache.release_reads(seq.request_id)

    def _admit(self, seq: Sequence) -> Reuse | None:
        """Move from waiting to running: state slot plus any prefix-cache hit (returned)."""
        tokens = seq.all_token_ids
        seq.state_slot = self._free_slots.pop()
        reuse = None
        note = ""
        if not self.prefix_reuse:
            note = self.reuse_off_reason
        elif seq.request.params.prompt_logprobs is not None:
            note = "prompt_logprobs asked for: every prompt token is computed"
        if note:
            self.cache.note_miss(note)
        else:
            namespace = self._namespace(seq)
            reuse = self.cache.acquire(tokens, self._keys(seq), namespace, seq.request.cache_salt, seq.state_slot)
        self._forget_lookup(seq)
        seq.block_ids = list(reuse.block_ids) if reuse else []
        seq.num_computed_tokens = reuse.num_tokens if reuse else 0
        if self.prefix_reuse and self.cache.stateful:
            seq.checkpoint_marks = checkpoint_positions(seq.request, every_tokens=self.cache.checkpoint_every_tokens,
                                                        block_size=self.pool.block_size,
                                                        resumed_at=seq.num_computed_tokens)
        if not seq.output_ids:
            seq.cached_tokens = seq.num_computed_tokens
            seq.cached_by_tier = dict(reuse.by_tier) if reuse else {}
            seq.cache_note = reuse.why_not_more if reuse else note
        seq.status = SeqStatus.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return reuse

    def _namespace(self, seq: Sequence) -> bytes:
        return self.namespace + seq.request.cache_salt.encode()

    def _checkpoint(self, seq: Sequence) -> None:
        """Save the sequence's state at its computed end (stateful models with prefix reuse)."""
        if not (self.prefix_reuse and self.cache.stateful) or seq.state_slot is None or not seq.num_computed_tokens:
            return
        tokens = seq.tokens_between(0, seq.num_computed_tokens)
        keys = self.full_block_keys(seq, len(tokens) // self.pool.block_size)
        self.cache.save_checkpoint(tokens, keys, self._namespace(seq), seq.block_ids, seq.state_slot)

    def full_block_keys(self, seq: Sequence, blocks: int) -> list[bytes]:
        """Keys of the sequence's first ``blocks`` full blocks.  The chain is hashed once and extended
        as blocks fill (a sequence's tokens are only ever appended), not rehashed from the start: at
        a 500K-token context that would be some 80 ms every time a block fills."""
        chain, bs = seq.block_key_chain, self.pool.block_size
        if len(chain) < blocks:
            more = seq.tokens_between(len(chain) * bs, blocks * bs)
            chain.extend(block_keys(more, bs, self._namespace(seq), chain[-1] if chain else b""))
        return chain[:blocks]

    def _grow(self, seq: Sequence, end: int, preempted: list[str] | None) -> bool:
        """Make seq's block table cover ``end`` tokens, preempting others if allowed."""
        need = -(-end // self.pool.block_size) - len(seq.block_ids)
        while need > 0:
            got = self.pool.allocate(need)
            if got is not None:
                seq.block_ids.extend(got)
                return True
            if preempted is None:
                return False
            victim = self._victim()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is seq:
                return False
        return True

    def _victim(self) -> Sequence:
        """The policy's pick among the running sequences but the oldest (the oldest itself when
        it runs alone)."""
        oldest = min(self.running, key=lambda s: s.arrival_time)
        candidates = [s for s in self.running if s is not oldest]
        if not candidates:
            return oldest
        victim = self.policy.choose_victim(candidates)
        if not any(victim is s for s in candidates):
            raise RuntimeError(f"scheduler policy {self.policy.name!r} chose a victim it was not offered")
        return victim

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.preemptions += 1
        seq.status = SeqStatus.WAITING
        self.preemptions_total += 1
        self.waiting.insert(0, seq)

    def _release(self, seq: Sequence) -> None:
        if seq.block_ids:
            self._register_full_blocks(seq)
            self.pool.release(seq.block_ids)
            seq.block_ids = []
        if seq.state_slot is not None:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = None

    # ------------------------------------------------------------------ after a step

    def _register_full_blocks(self, seq: Sequence) -> None:
        if not self.prefix_reuse:
            return
        bs = self.pool.block_size
        keys = self.full_block_keys(seq, seq.num_computed_tokens // bs)
        for i, key in enumerate(keys):
            if not self.pool.settled(seq.block_ids[i], key):
                self.pool.register(seq.block_ids[i], key, seq.tokens_between(i * bs, (i + 1) * bs))

    def committed(self, chunk: ScheduledChunk) -> None:
        """The chunk's KV is now in the pool: advance and index newly full blocks."""
        seq = chunk.seq
        before = seq.num_computed_tokens // self.pool.block_size
        seq.num_computed_tokens = chunk.start_pos + chunk.num_tokens
        if seq.num_computed_tokens // self.pool.block_size > before:
            self._register_full_blocks(seq)
        end = seq.num_computed_tokens
        if end == seq.num_prompt_tokens and not seq.output_ids:
            self._checkpoint(seq)  # end of the prompt: a request boundary
        elif seq.checkpoint_marks and end < seq.num_prompt_tokens and _marked(seq.checkpoint_marks, end):
            self._checkpoint(seq)  # where a later prompt is likely to part from this one


def _marked(marks: tuple[int, ...], position: int) -> bool:
    i = bisect.bisect_left(marks, position)
    return i < len(marks) and marks[i] == position
