"""The DeepSeek-V4.1 forward pass of one sequence, chunk by chunk, with an explicit state.

Build a model from ``{official tensor name: float tensor}`` with
:meth:`DeepseekV41Model.from_tensors` (or from a directory holding
``config.json``, safetensors files and ``tokenizer.json`` with
:meth:`DeepseekV41Model.from_pretrained`), take a fresh
:class:`~ds4d.models.deepseek_v41.state.SequenceState` from
:meth:`~DeepseekV41Model.new_state`, then :meth:`~DeepseekV41Model.forward`
any number of tokens at a time: a prefill chunk of any length or one decode
token go through the same code, and a prompt split into chunks gives the
logits of the whole prompt at once (up to float rounding).
:meth:`~DeepseekV41Model.decode_many` takes one token for each of several
states at once; how each piece runs is the model's
:class:`~ds4d.models.deepseek_v41.paths.ForwardPaths`, fixed when it is built.

One step, per layer: the Engram lookup joins the residual copies (at its
layers), the attention input is collapsed from the copies with the previous
site's ``pre`` (``hyper.py``), the attention (``attention.py``) and the
feed-forward (``moe.py``) each spread their output back over the copies.

The official ``model.py`` publishes a KV source's index keys only on steps in
which its group completes an entry: on a decode step inside a ratio-2 pair,
that source's indexer and its reindex layers score against whatever the
previous layer left in the shared slot (another group's keys).  ds4d follows
the Hugging Face model (and the two-line fix of the official code), which is
the model's intended behaviour: every step scores against the group's running
index keys, complete entries only.  The two differ only when the top-k really
selects (more visible entries than ``index_topk``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ds4d.models.deepseek_v4.ops import Rope, plain_inv_freq, rms_norm, yarn_inv_freq
from ds4d.models.deepseek_v41.attention import (
    StepRows,
    StepShared,
    attention_core,
    attention_forward,
    output_projection,
    project,
)
from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.engram import EngramHasher, engram_forward, gather_rows
from ds4d.models.deepseek_v41.hyper import collapse, expand, site_weights
from ds4d.models.deepseek_v41.moe import moe_forward, offloaded_forward, predicted_experts
from ds4d.models.deepseek_v41.offload import ExpertOffload, ExpertSink, OffloadOptions, expert_offload
from ds4d.models.deepseek_v41.paths import ForwardPaths
from ds4d.models.deepseek_v41.state import SequenceState
from ds4d.models.deepseek_v41.weights import ModelWeights, build_weights, read_safetensors


def _inv_freqs(cfg: DeepseekV41Config) -> tuple[torch.Tensor, torch.Tensor]:
    main = plain_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta)
    if cfg.yarn is not None:
        compress = yarn_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.yarn)
    else:
        compress = plain_inv_freq(cfg.qk_rope_head_dim, cfg.compress_rope_theta)
    return main, compress


class DeepseekV41Model:
    """A V4.1 text model: weights, the per-layer plan and the Engram hasher; no per-sequence state."""

    def __init__(self, cfg: DeepseekV41Config, weights: ModelWeights, hasher: EngramHasher | None,
                 *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 paths: ForwardPaths | None = None, expert_offload: ExpertOffload | None = None) -> None:
        if cfg.engram_layer_ids and hasher is None:
            raise ValueError("this config has Engram layers: the model needs the tokenizer's EngramHasher")
        if expert_offload is None and any(layer.ffn.banks is None for layer in weights.layers):
            raise ValueError("these weights hold no routed experts: the model needs their expert offload")
        self.cfg = cfg
        self.weights = weights
        self.expert_offload = expert_offload
        """Where the routed experts are when they are split over device and host RAM (``offload.py``)."""
        self.hasher = hasher
        self.plans = cfg.plan()
        self.device = torch.device(device)
        self.dtype = dtype
        self.paths = ForwardPaths.for_device(self.device) if paths is None else paths
        """How each piece of the forward runs (fixed for the model's life)."""
        main, compress = _inv_freqs(cfg)
        self.rope_main = Rope(main, self.device)
        self.rope_compress = Rope(compress, self.device)

    # ------------------------------------------------------------ building

    @classmethod
    def from_tensors(cls, cfg: DeepseekV41Config, tensors: Mapping[str, torch.Tensor], tokenizer=None, *,
                     hasher: EngramHasher | None = None, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", paths: ForwardPaths | None = None,
                     stored_weights: bool = False, offload: OffloadOptions | None = None) -> DeepseekV41Model:
        """From official (or HF ``save_pretrained``) names; ``tokenizer`` (a ``tokenizers.Tokenizer``)
        builds the Engram hasher when ``hasher`` is not given; ``stored_weights``: routed experts handed
        over as FP4 codes and scales stay so (``weights.build_weights``); ``offload``: the routed experts
        are split over the device and host RAM as they are read (``offload.py``)."""
        if hasher is None and cfg.engram_layer_ids and tokenizer is not None:
            hasher = EngramHasher.from_tokenizer(cfg, tokenizer)
        experts = sink = None
        if offload is not None:
            experts = expert_offload(cfg, offload, device=device, dtype=dtype, stored=stored_weights)
            sink = ExpertSink(experts)
        weights = build_weights(cfg, tensors, dtype=dtype, device=device, stored_weights=stored_weights,
                                expert_sink=sink)
        if sink is not None:
            sink.finish()
        return cls(cfg, weights, hasher, device=device, dtype=dtype, paths=paths, expert_offload=experts)

    @classmethod
    def from_pretrained(cls, path: str | Path, tokenizer=None, **kwargs) -> DeepseekV41Model:
        """``config.json`` and the safetensors files of a directory, ``tokenizer.json`` there by default."""
        path = Path(path)
        cfg = DeepseekV41Config.from_file(path)
        if tokenizer is None and cfg.engram_layer_ids:
            from tokenizers import Tokenizer

            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        return cls.from_tensors(cfg, read_safetensors(path), tokenizer, **kwargs)

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.cfg, self.device, self.dtype)

    # ------------------------------------------------------------ running

    def forward(self, state: SequenceState, token_ids: Sequence[int] | torch.Tensor, *,
                last_only: bool = False) -> torch.Tensor:
        """Logits ``[S, vocab]`` (float32) of the ``S`` tokens following ``state``; advances ``state``.

        ``last_only``: the logits of the last token only (``[1, vocab]``), computed on the triangle of
        rows they and the state depend on (:func:`row_plan`); the state comes out the same."""
        streams, pre_mix, rows, engram = self._start(state, token_ids)
        count = streams.shape[0]
        plan = row_plan(self.cfg, count) if last_only else [(count, count)] * self.cfg.num_hidden_layers
        sequence = [(state, StepShared())]
        for layer, (inputs, outputs) in enumerate(plan):
            if inputs < streams.shape[0]:
                streams, pre_mix = streams[-inputs:], pre_mix[-inputs:]
            gathered = engram[layer][-inputs:] if engram and layer in engram else None
            streams, pre_mix = self.layer_forward(layer, streams, pre_mix, gathered, sequence,
                                                  rows.tail(inputs), outputs, decode=count == 1)
        self._advance(state, token_ids)
        return self.logits(streams, pre_mix)

    def decode_many(self, states: Sequence[SequenceState], token_ids: Sequence[int]) -> torch.Tensor:
        """Logits ``[B, vocab]`` after one more token for each of ``B`` sequences; advances each state.

        The rows go through every layer together; only the attention core runs per sequence.  Each
        row's result is the one :meth:`decode` gives it, up to the rounding of a matmul over more rows."""
        if len(states) != len(token_ids) or not states:
            raise ValueError("decode_many takes one token per state, for at least one state")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("decode_many takes each state once")
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        host = tuple(s.position for s in states)
        positions = torch.tensor(host, dtype=torch.long, device=self.device)
        rows = StepRows.make(positions, host, self.rope_main, self.rope_compress)
        streams, pre_mix = self._streams(ids)
        engram = None
        if self.hasher is not None:
            row_ids = torch.cat([self.hasher.row_ids(s.engram_ids, ids[i:i + 1]) for i, s in enumerate(states)])
            engram = self._gather_engram(row_ids)
        sequences = [(state, StepShared()) for state in states]
        for layer in range(self.cfg.num_hidden_layers):
            gathered = engram.get(layer) if engram else None
            streams, pre_mix = self.layer_forward(layer, streams, pre_mix, gathered, sequences, rows, decode=True)
        for i, state in enumerate(states):
            self._advance(state, ids[i:i + 1])
        return self.logits(streams, pre_mix)

    def prefill(self, state: SequenceState, token_ids: Sequence[int], chunk_size: int | None = None, *,
                last_only: bool = False) -> torch.Tensor:
        """:meth:`forward` over ``token_ids`` in chunks of ``chunk_size`` (all at once: None); with
        ``last_only`` every chunk runs on its triangle and the prompt's last logits ``[1, vocab]`` come back."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long)
        step = chunk_size or max(1, ids.shape[0])
        logits = [self.forward(state, ids[i: i + step], last_only=last_only) for i in range(0, ids.shape[0], step)]
        return logits[-1] if last_only else torch.cat(logits)

    def decode(self, state: SequenceState, token_id: int) -> torch.Tensor:
        """Logits ``[vocab]`` after one more token."""
        return self.forward(state, [token_id])[0]

    def greedy(self, prompt: Sequence[int], new_tokens: int, chunk_size: int | None = None) -> list[int]:
        """``new_tokens`` argmax tokens after ``prompt``, from a fresh state."""
        state = self.new_state()
        logits = self.prefill(state, prompt, chunk_size)[-1]
        out: list[int] = []
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            if len(out) < new_tokens:
                logits = self.decode(state, out[-1])
        return out

    # ------------------------------------------------------------ pieces

    def _start(self, state: SequenceState, token_ids):
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("a step needs at least one token")
        host = range(state.position, state.position + ids.numel())
        positions = torch.arange(host.start, host.stop, device=self.device)
        rows = StepRows.make(positions, host, self.rope_main, self.rope_compress)
        streams, pre_mix = self._streams(ids)
        engram = None
        if self.hasher is not None:
            engram = self._gather_engram(self.hasher.row_ids(state.engram_ids, ids))
        return streams, pre_mix, rows, engram

    def _streams(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual copies of the tokens ``ids`` and the one-hot ``pre`` mix before layer 0."""
        hidden = F.embedding(ids.to(self.device), self.weights.embed)
        streams = hidden.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        pre_mix = torch.zeros(ids.numel(), self.cfg.hc_mult, dtype=torch.float32, device=self.device)
        pre_mix[:, 0] = 1.0
        return streams, pre_mix

    def _gather_engram(self, row_ids: torch.Tensor) -> dict[int, torch.Tensor]:
        """Every Engram layer's rows for the row ids ``[S, layers, columns]``, read (and sent over) before
        layer 0 runs."""
        return {layer: gather_rows(w.engram, row_ids[:, plan.engram_slot], self.device)
                for layer, (plan, w) in enumerate(zip(self.plans, self.weights.layers)) if w.engram is not None}

    def _advance(self, state: SequenceState, token_ids) -> None:
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        state.position += ids.numel()
        if self.hasher is not None and self.hasher.history:
            seen = torch.cat([state.engram_ids, self.hasher.compress(ids)])
            state.engram_ids = seen[-self.hasher.history:].clone()

    def logits(self, streams: torch.Tensor, pre_mix: torch.Tensor) -> torch.Tensor:
        hidden = rms_norm(collapse(streams, pre_mix), self.weights.norm, self.cfg.rms_norm_eps)
        return F.linear(hidden.float(), self.weights.head)

    def layer_forward(self, layer: int, streams: torch.Tensor, pre_mix: torch.Tensor,
                      engram: torch.Tensor | None, sequences: Sequence[tuple[SequenceState, StepShared]],
                      rows: StepRows, outputs: int | None = None,
                      decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the rows ``rows``: (new copies of the last ``outputs`` rows ``[outputs, m, D]``,
        their ``pre`` mix for the next site).  Every row's window KV is made.

        ``sequences``: one (state, step hand-over) whose rows are the last of its step, or one per row
        (a decode step of several sequences, all rows outputs)."""
        outputs = streams.shape[0] if outputs is None else outputs
        if len(sequences) == 1:
            state, shared = sequences[0]
            plan, w = self.plans[layer], self.weights.layers[layer].attn

            def attend(x: torch.Tensor) -> torch.Tensor:
                return attention_forward(x, plan, w, self.cfg, state, shared, rows, outputs,
                                        self.paths.window_kernel)
        else:
            def attend(x: torch.Tensor) -> torch.Tensor:
                return self._attention_rows(x, layer, sequences, rows)
        return self.layer_around(layer, streams, pre_mix, engram, attend, outputs, decode)

    def layer_around(self, layer: int, streams: torch.Tensor, pre_mix: torch.Tensor, engram: torch.Tensor | None,
                     attend: Callable[[torch.Tensor], torch.Tensor],
                     outputs: int | None = None, decode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`layer_forward` with the attention given: ``attend`` takes the normed attention input of
        every row and returns the attention output of the last ``outputs`` rows ``[outputs, hidden]``.
        ``decode``: the rows are one token of each sequence (offloaded experts may take the decode paths)."""
        cfg, w, paths = self.cfg, self.weights.layers[layer], self.paths
        eps, iters, hc_eps = cfg.rms_norm_eps, cfg.hc_sinkhorn_iters, cfg.hc_eps
        outputs = streams.shape[0] if outputs is None else outputs
        offload = self.expert_offload
        ahead = decode and offload is not None  # cold experts fetched a layer early (``ExpertOffload.fetch_ahead``)
        if w.engram is not None:
            streams = engram_forward(streams, engram, w.engram, eps)
        x = rms_norm(collapse(streams, pre_mix), w.attn_norm, eps)
        if ahead and layer == 0:
            offload.fetch_ahead(0, x, partial(predicted_experts, x, w.ffn, cfg))
        streams = streams[streams.shape[0] - outputs:]
        attn_pre, post, comb = site_weights(streams, w.hc_attn, iters, hc_eps, eps, paths.fused_hyper)
        streams = expand(attend(x), streams, post, comb)
        ffn_pre, post, comb = site_weights(streams, w.hc_ffn, iters, hc_eps, eps, paths.fused_hyper)
        x = rms_norm(collapse(streams, attn_pre), w.ffn_norm, eps)
        if ahead and layer + 1 < len(self.weights.layers):
            offload.fetch_ahead(layer + 1, x, partial(predicted_experts, x, self.weights.layers[layer + 1].ffn, cfg))
        route_kernel = decode and paths.route_kernel
        if offload is not None:
            ffn = offloaded_forward(x, w.ffn, cfg, offload, layer, decode, route_kernel)
        else:
            ffn = moe_forward(x, w.ffn, cfg, paths.expert_rows, paths.grouped_experts, route_kernel)
        return expand(ffn, streams, post, comb), ffn_pre

    def _attention_rows(self, x: torch.Tensor, layer: int, sequences: Sequence[tuple[SequenceState, StepShared]],
                        rows: StepRows) -> torch.Tensor:
        """The attention of one row per sequence: projections over all rows, the core per sequence."""
        cfg, plan, w = self.cfg, self.plans[layer], self.weights.layers[layer].attn
        if len(sequences) != x.shape[0]:
            raise ValueError("a step of several sequences takes one row per sequence")
        projected = project(x, plan, w, cfg, rows, x.shape[0])
        out = [attention_core(x[i:i + 1], projected.rows(slice(i, i + 1)), plan, w, cfg, state, shared,
                              rows.part(slice(i, i + 1)))
               for i, (state, shared) in enumerate(sequences)]
        return output_projection(torch.cat(out), plan, w, cfg, rows)


def row_plan(cfg: DeepseekV41Config, count: int) -> list[tuple[int, int]]:
    """(input rows, output rows) per layer for a step of ``count`` rows whose last logits are wanted.

    Every layer up to the last KV source takes all rows (that source compresses every position).  After
    it a layer's output rows need their inputs up to ``sliding_window - 1`` rows back (the window),
    and its ring keeps its inputs' last ``sliding_window - 1`` window KV rows: from the single row of
    the logits at the top, each layer further down takes ``sliding_window - 1`` more rows (at most
    ``count``).  Every other row's result is not used by anything."""
    last_source = max(cfg.kv_source_layer_ids, default=-1)
    plan, outputs = [], 1
    for layer in reversed(range(cfg.num_hidden_layers)):
        inputs = count if layer <= last_source else min(count, outputs + cfg.sliding_window - 1)
        plan.append((inputs, outputs))
        outputs = inputs
    return plan[::-1]
