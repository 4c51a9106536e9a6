"""llama.cpp as the peer of the CPU benchmark, through llama-cpp-python's C API.

The context is created with one KV sequence per prompt so batch 8 runs as
llama.cpp's own multi-sequence batching (one ``llama_decode`` per step carrying
every sequence's token), not as eight separate runs.  Prefill feeds each prompt
in ``n_batch`` pieces; decode is greedy (argmax on the returned logits), like the
ds4d side.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np


class PeerUnavailable(RuntimeError):
    pass


class LlamaCppPeer:
    def __init__(self, path: Path, *, threads: int, n_ctx: int, n_seq: int, n_batch: int = 512) -> None:
        try:
            import llama_cpp as lc
        except ImportError as exc:
            raise PeerUnavailable("llama-cpp-python is not installed (pip install '.[bench]')") from exc
        self.lc = lc
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(path).encode(), mparams)
        if not self.model:
            raise PeerUnavailable(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise PeerUnavailable("llama.cpp could not create a context")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.n_seq = n_seq
        self.batch = lc.llama_batch_init(n_batch, 0, 1)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence id, wants logits)."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, index)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    def run(self, prompts: list[list[int]], decode_tokens: int) -> tuple[float, float]:
        """(prefill tok/s, decode tok/s) for the prompts run together."""
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        next_tok = []
        t0 = time.perf_counter()
        for seq, prompt in enumerate(prompts):
            for start in range(0, len(prompt), self.n_batch):
                piece = prompt[start:start + self.n_batch]
                last = start + len(piece) == len(prompt)
                self._decode([(t, start + i, seq, last and i == len(piece) - 1) for i, t in enumerate(piece)])
            next_tok.append(self._argmax(len(piece) - 1))
        prefill_s = time.perf_counter() - t0
        positions = [len(p) for p in prompts]
        t0 = time.perf_counter()
        for _ in range(decode_tokens):
            self._decode([(next_tok[s], positions[s], s, True) for s in range(len(prompts))])
            next_tok = [self._argmax(s) for s in range(len(prompts))]
            positions = [p + 1 for p in positions]
        decode_s = time.perf_counter() - t0
        total_prompt = sum(len(p) for p in prompts)
        return total_prompt / prefill_s, decode_tokens * len(prompts) / decode_s

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)
