"""The V4 model through the engine's contract: chunking, batching and decode invariance.

A small local driver plays the engine's block manager: each sequence gets a
state slot and the block ids covering positions ``0 .. end - 1`` (``ceil(end /
128)`` blocks, handed out from a shuffled free list so they are neither
contiguous nor ordered).  Results are compared with a whole-sequence pass of
the same model; on CPU float32 they agree to rounding (different matmul shapes
sum in different orders), and greedy choices agree exactly.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds4d.contracts import ForwardBatch, Model, PluginContext, SeqChunk
from ds4d.models.deepseek_v4 import DeepseekV4Family, write_tiny_checkpoint

TOLERANCE = 2e-4  # absolute, on logits of unit scale


pytestmark = pytest.mark.usefixtures("one_torch_thread")



class Driver:
    """Hands out state slots and block ids the way the engine's block manager does."""

    def __init__(self, model: Model, num_blocks: int = 64, max_seqs: int = 4, seed: int = 0) -> None:
        self.model = model
        model.allocate_cache(num_blocks, max_seqs)
        self.block_size = model.info.block_size_tokens
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.free_slots = list(range(max_seqs))
        self.seqs: dict[str, dict] = {}

    def start(self, name: str) -> None:
        self.seqs[name] = {"slot": self.free_slots.pop(), "blocks": [], "length": 0}

    def finish(self, name: str) -> None:
        seq = self.seqs.pop(name)
        self.free_slots.append(seq["slot"])
        self.free_blocks.extend(seq["blocks"])

    def step(self, work: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """``work``: (sequence, new tokens, logits wanted) -> logits per entry."""
        chunks = []
        for name, tokens, want in work:
            seq = self.seqs[name]
            end = seq["length"] + len(tokens)
            while len(seq["blocks"]) < -(-end // self.block_size):
                seq["blocks"].append(self.free_blocks.pop())
            chunks.append(SeqChunk(seq["slot"], tuple(tokens), seq["length"], tuple(seq["blocks"]), want))
            seq["length"] = end
        logits = self.model.forward(ForwardBatch(tuple(chunks)))
        assert logits.dtype == torch.float32
        return list(logits.split([want for _, _, want in work]))

    def prefill(self, name: str, tokens: list[int], chunk: int) -> torch.Tensor:
        out = []
        for begin in range(0, len(tokens), chunk):
            piece = tokens[begin : begin + chunk]
            out.append(self.step([(name, piece, len(piece))])[0])
        return torch.cat(out)


def _ctx() -> PluginContext:
    return PluginContext(config=SimpleNamespace(dtype="float32", device="cpu"), log=logging.getLogger("test"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), seed=5, layers=[0, 4, 128, 4])


@pytest.fixture(scope="module")
def model(checkpoint):
    return DeepseekV4Family(_ctx(), {}).load(checkpoint)


def _tokens(model, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "cache", "token", "expert", "window", "stream"]
    ids: list[int] = []
    while len(ids) < length:
        ids += model.tokenizer.encode(" ".join(rng.choice(words) for _ in range(20)) + ".\n")
    return ids[:length]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < TOLERANCE
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


# ---------------------------------------------------------------------- family / info


def test_family_recognises_and_describes(model, checkpoint, tmp_path):
    family = DeepseekV4Family(_ctx(), {})
    assert family.name == "deepseek_v4" and family.can_load(checkpoint)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert not family.can_load(tmp_path) and not family.can_load(tmp_path / "absent")
    info = model.info
    assert isinstance(model, Model)
    assert info.family == "deepseek_v4" and info.vocab_size == 129280 and info.block_size_tokens == 128
    assert (info.default_chat_encoder, info.default_reasoning_parser, info.default_tool_parser) == (
        "deepseek_v4",
        "deepseek_v4",
        "dsml",
    )
    # per block: CSA layers 32 entries x (64 + 32 indexer dims), the HCA layer one 64-dim entry
    assert info.cache_bytes_per_block == 4 * (2 * 32 * (64 + 32) + 1 * 64)
    assert info.state_bytes_per_seq > 4 * 4 * 128 * 64  # window rings of all four layers, plus tails
    assert model.tokenizer.decode(model.tokenizer.encode("hello world")) == "hello world"
    # routed experts stay MXFP4-packed in memory (decoded per use)
    bank = model.weights.layers[1].ffn.experts
    assert bank.kind == "mxfp4" and bank.weights["w1"].dtype == torch.uint8
    assert bank.weight("w1", 3).shape == (64, 64)


# ---------------------------------------------------------------------- invariance


@pytest.fixture(scope="module")
def long_prompt(model):
    return _tokens(model, 300, seed=1)


@pytest.fixture(scope="module")
def whole(model, long_prompt):
    return model.logits_for(long_prompt)


@pytest.mark.parametrize("chunk", [1, 7, 128, 300])
def test_any_chunk_size_gives_the_same_logits(model, long_prompt, whole, chunk):
    driver = Driver(model, seed=chunk)
    driver.start("a")
    _assert_close(driver.prefill("a", long_prompt, chunk), whole)


def test_batched_prompts_equal_solo_runs(model):
    prompts = {
        name: _tokens(model, length, seed) for name, length, seed in (("a", 150, 11), ("b", 37, 12), ("c", 260, 13))
    }
    solo = {name: model.logits_for(ids) for name, ids in prompts.items()}

    driver = Driver(model, seed=3)
    for name in prompts:
        driver.start(name)
    got: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
    cursor = dict.fromkeys(prompts, 0)
    sizes = {"a": 64, "b": 37, "c": 100}
    while any(cursor[n] < len(prompts[n]) for n in prompts):
        work = []
        for name, ids in prompts.items():
            piece = ids[cursor[name] : cursor[name] + sizes[name]]
            if piece:
                work.append((name, piece, len(piece)))
                cursor[name] += len(piece)
        for (name, _, _), logits in zip(work, driver.step(work)):
            got[name].append(logits)
    for name in prompts:
        _assert_close(torch.cat(got[name]), solo[name])

    # decode all three together, then compare each with its own recompute
    generated = {name: [int(solo[name][-1].argmax())] for name in prompts}
    decoded: dict[str, list[torch.Tensor]] = {name: [] for name in prompts}
    for _ in range(6):
        work = [(name, [generated[name][-1]], 1) for name in prompts]
        for (name, _, _), logits in zip(work, driver.step(work)):
            decoded[name].append(logits[0])
            generated[name].append(int(logits[0].argmax()))
    for name, ids in prompts.items():
        full = model.logits_for(ids + generated[name][:-1])
        _assert_close(torch.stack(decoded[name]), full[len(ids) :])


def test_decode_after_long_prompt_equals_recompute(model, long_prompt, whole):
    driver = Driver(model, seed=9)
    driver.start("a")
    logits = driver.step([("a", long_prompt, 1)])[0]
    _assert_close(logits, whole[-1:])
    tokens, decoded = [], []
    for _ in range(12):
        tokens.append(int(logits[-1].argmax()))
        logits = driver.step([("a", [tokens[-1]], 1)])[0]
        decoded.append(logits[0])
    recompute = model.logits_for(long_prompt + tokens)
    _assert_close(torch.stack(decoded), recompute[len(long_prompt) :])


def test_prompt_longer_than_two_blocks_plus_window(model):
    length = 2 * 128 + model.cfg.sliding_window + 45
    ids = _tokens(model, length, seed=21)
    full = model.logits_for(ids)
    assert torch.isfinite(full).all()
    driver = Driver(model, seed=4)
    driver.start("a")
    _assert_close(driver.prefill("a", ids, 97), full)
    # causal: a prefix sees exactly what it saw inside the longer sequence
    _assert_close(model.logits_for(ids[:300]), full[:300])
    # and the tail really uses the compressed history: dropping the first block changes it
    assert (model.logits_for(ids[128:])[-1] - full[-1]).abs().max() > 1e-3


def test_slot_and_block_reuse_start_fresh(model, long_prompt, whole):
    driver = Driver(model, num_blocks=6, max_seqs=1, seed=8)
    driver.start("first")
    driver.prefill("first", _tokens(model, 200, seed=30), 50)
    driver.finish("first")
    driver.start("second")
    _assert_close(driver.prefill("second", long_prompt, 128), whole)


def test_logits_tokens_selects_trailing_rows(model, long_prompt, whole):
    driver = Driver(model, seed=2)
    driver.start("a")
    driver.start("b")
    none, last3 = driver.step([("a", long_prompt[:100], 0), ("b", long_prompt[:100], 3)])
    assert none.shape == (0, model.info.vocab_size)
    _assert_close(last3, whole[97:100])


def test_last_feed_forward_runs_on_the_wanted_rows_only(model, long_prompt, whole, monkeypatch):
    """Two prompts in one step, 3 and 0 rows of logits wanted: every layer's feed-forward but the last
    sees all 200 rows, the last only the 3; the logits are those of the whole pass."""
    import ds4d.models.deepseek_v4.model as model_module

    rows = []
    real = model_module.moe_forward
    monkeypatch.setattr(model_module, "moe_forward", lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
    driver = Driver(model, seed=2)
    driver.start("a")
    driver.start("b")
    last3, none = driver.step([("a", long_prompt[:100], 3), ("b", long_prompt[:100], 0)])
    assert rows == [200] * (model.cfg.num_hidden_layers - 1) + [3]
    assert none.shape == (0, model.info.vocab_size)
    _assert_close(last3, whole[97:100])
    rows.clear()
    driver.step([("a", long_prompt[100:110], 0)])  # no row wanted: the last feed-forward does not run
    assert rows == [10] * (model.cfg.num_hidden_layers - 1)


def test_bad_batches_are_refused(model):
    model.allocate_cache(4, 2)
    with pytest.raises(ValueError, match="slot"):
        model.forward(ForwardBatch((SeqChunk(0, (1, 2), 0, (0,)), SeqChunk(0, (3,), 0, (1,)))))
    with pytest.raises(ValueError, match="blocks"):
        model.forward(ForwardBatch((SeqChunk(1, tuple(range(200)), 0, (0,)),)))


def test_saved_state_continues_a_shared_prefix(model):
    prefix, first_tail, second_tail = _tokens(model, 256, 40), _tokens(model, 40, 41), _tokens(model, 30, 42)
    driver = Driver(model, seed=6)
    driver.start("a")
    driver.prefill("a", prefix, 128)
    snapshot = model.save_state(driver.seqs["a"]["slot"])
    driver.step([("a", first_tail, 1)])

    driver.start("b")
    b = driver.seqs["b"]
    model.load_state(b["slot"], snapshot)
    b["blocks"], b["length"] = list(driver.seqs["a"]["blocks"][:2]), len(prefix)  # the two full blocks
    _assert_close(
        driver.step([("b", second_tail, len(second_tail))])[0], model.logits_for(prefix + second_tail)[len(prefix) :]
    )
