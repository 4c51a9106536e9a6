"""A DeepSeek-V4 prompt step run layer by layer in blocks of rows (``ForwardPaths.prefill_block``) gives the
logits of the whole step at once, bit for bit on the CPU in float32, and with routed experts offloaded
copies each cold expert a step uses once per layer, not once per block."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from ds4d.config import ConfigError, load_config
from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.engine.offline import OfflineEngine
from ds4d.engine.request import EngineRequest, SamplingParams
from ds4d.models.deepseek_v4 import load_model, write_tiny_checkpoint
from ds4d.models.deepseek_v4.knobs import OFFLOAD_PREFILL_BLOCK, prefill_block
from ds4d.models.deepseek_v4.model import step_rows
from ds4d.models.deepseek_v4.moe import RoutingTally
from ds4d.models.deepseek_v4.offload import ExpertOffload, OffloadOptions
from ds4d.models.deepseek_v4.paths import ForwardPaths

GROUPED = ForwardPaths(fast_path=True)
LAYERS = [0, 4, 128, 4]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("layer_major"), seed=11, layers=LAYERS)


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(5)
    return [rng.randrange(1000, 50000) for _ in range(230)], [rng.randrange(1000, 50000) for _ in range(170)]


def _steps(model) -> list[torch.Tensor]:
    """A long first chunk, a step holding a chunk of each of two sequences (the second chunk starting
    mid-block), then decode steps: every step's logits."""
    first, second = _prompts()
    model.allocate_cache(16, 2)
    out = [model.forward(ForwardBatch((SeqChunk(0, tuple(first[:150]), 0, (3, 5, 6), 9),)))]
    out.append(model.forward(ForwardBatch((SeqChunk(0, tuple(first[150:230]), 150, (3, 5, 6, 7), 3),
                                           SeqChunk(1, tuple(second[:170]), 0, (9, 10, 11), 170)))))
    for step in range(6):
        out.append(model.forward(ForwardBatch((SeqChunk(0, (first[step],), 230 + step, (3, 5, 6, 7), 1),
                                               SeqChunk(1, (second[step],), 170 + step, (9, 10, 11), 1)))))
    return out


def _solo(model, pieces: int) -> list[torch.Tensor]:
    """The first prompt in steps of ``pieces`` tokens (the last logits only), then four decode steps."""
    first, _ = _prompts()
    model.allocate_cache(8, 1)
    blocks = (0, 1, 2)
    for begin in range(0, len(first), pieces):
        piece = first[begin : begin + pieces]
        logits = model.forward(ForwardBatch((SeqChunk(0, tuple(piece), begin, blocks, int(begin + pieces >= 230)),)))
    out = [logits]
    for step in range(4):
        out.append(model.forward(ForwardBatch((SeqChunk(0, (first[step],), 230 + step, blocks, 1),))))
    return out


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {index}: max |diff| {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("paths", [GROUPED, ForwardPaths()], ids=["grouped", "reference"])
@pytest.mark.parametrize("block", [2, 37, 128])  # not 1: a lone last token with logits is a decode step
def test_blocks_compute_what_a_step_per_block_does(checkpoint, paths, block):
    """One step of the whole prompt in blocks = one engine step per block, bit for bit (the same
    operations on the same rows, in another order), and the decode steps after it too."""
    model = load_model(checkpoint, paths=paths)
    want = _solo(model, block)
    _assert_same(_solo(model.with_paths(paths.replace(prefill_block=block)), 230), want)


@pytest.mark.parametrize("block", [1, 37, 128])
def test_blocks_of_a_mixed_step_match_the_whole_step(checkpoint, block):
    """Two sequences' chunks cut by blocks: within the chunking tolerance of the whole step
    (tests/unit/test_dsv4_model.py), the same greedy tokens."""
    model = load_model(checkpoint, paths=GROUPED)
    want = _steps(model)
    got = _steps(model.with_paths(GROUPED.replace(prefill_block=block)))
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() < 2e-4 and torch.equal(a.argmax(-1), b.argmax(-1))


def test_every_row_through_the_last_layer_when_routing_is_counted(checkpoint):
    model = load_model(checkpoint, paths=GROUPED)
    whole, blocked = RoutingTally(len(LAYERS), 8), RoutingTally(len(LAYERS), 8)
    want = _solo(model.with_paths(GROUPED.replace(prefill_block=50), routing_tally=whole), 50)
    got = _solo(model.with_paths(GROUPED.replace(prefill_block=50), routing_tally=blocked), 230)
    _assert_same(got, want)
    assert torch.equal(blocked.counts, whole.counts) and whole.counts[-1].sum() == (230 + 4) * 2


def test_a_step_whose_logits_want_no_row(checkpoint):
    model = load_model(checkpoint, paths=GROUPED.replace(prefill_block=40))
    first, _ = _prompts()
    model.allocate_cache(8, 1)
    logits = model.forward(ForwardBatch((SeqChunk(0, tuple(first[:130]), 0, (0, 1, 2), 0),)))
    assert logits.shape == (0, model.cfg.vocab_size)
    after = model.forward(ForwardBatch((SeqChunk(0, tuple(first[130:140]), 130, (0, 1, 2), 1),)))
    peer = load_model(checkpoint, paths=GROUPED)
    peer.allocate_cache(8, 1)
    for begin in range(0, 130, 40):
        peer.forward(ForwardBatch((SeqChunk(0, tuple(first[begin:min(begin + 40, 130)]), begin, (0, 1, 2), 0),)))
    assert torch.equal(after, peer.forward(ForwardBatch((SeqChunk(0, tuple(first[130:140]), 130, (0, 1, 2), 1),))))


def test_step_rows_cut_each_chunk_where_the_block_ends():
    positions = torch.arange(20)
    step = SimpleNamespace(chunks=[SimpleNamespace(begin=0, end=12, start_pos=100, slot=0, block_ids="a"),
                                   SimpleNamespace(begin=12, end=20, start_pos=0, slot=1, block_ids="b")],
                           positions=positions, rope_main=(positions, -positions), rope_compress=(positions, positions))
    rows = step_rows(step, 8, 16)
    assert [(c.begin, c.end, c.start_pos, c.slot) for c in rows.chunks] == [(0, 4, 108, 0), (4, 8, 0, 1)]
    assert rows.positions.tolist() == list(range(8, 16)) and rows.rope_main[1].tolist() == [-p for p in range(8, 16)]


def test_engine_tokens_equal_with_blocks(checkpoint):
    first, second = _prompts()

    def run(model) -> dict[str, list[int]]:
        engine = OfflineEngine(model, max_num_seqs=2, prefill_chunk=256, step_tokens=400, context_tokens=300)
        for name, prompt in (("a", first), ("b", second)):
            engine.submit(EngineRequest(name, tuple(prompt), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
        while engine.has_work:
            engine.step()
        tokens: dict[str, list[int]] = {}
        for output in engine.outputs:
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        return tokens

    model = load_model(checkpoint, paths=GROUPED)
    want = run(model)
    assert run(model.with_paths(GROUPED.replace(prefill_block=64))) == want and len(want["a"]) == 6


def _offloaded(checkpoint, block: int, hot: list[list[int]] | None = None):
    model = load_model(checkpoint, paths=GROUPED.replace(prefill_block=block))
    offload = ExpertOffload(model.weights, model.cfg, device="cpu", dtype=model.dtype,
                            options=OffloadOptions(vram_bytes=0, stage_experts=2, decode_cold="copy"))
    if hot is not None:
        offload.set_placement(hot)
    model.expert_offload = offload
    return model, offload


def test_offloaded_blocks_copy_each_cold_expert_once_per_layer(checkpoint):
    first, _ = _prompts()
    whole = load_model(checkpoint, paths=GROUPED.replace(prefill_block=16)).logits_for(first)
    model, offload = _offloaded(checkpoint, block=16)
    assert torch.equal(model.logits_for(first), whole)
    blocks = -(-len(first) // 16)
    stats = offload.expert_stats()
    for row in stats["layers"]:
        assert row["calls"] == blocks
        # 230 tokens route to all 8 experts of every layer: each copied once, not once per block
        assert row["copied_experts"] == 8 and row["bytes_copied"] == 8 * offload.host_expert_bytes
    pass_bank = offload.memory_plan()["expert staging (one layer, layer-by-layer prefill)"]["vram_bytes"]
    assert pass_bank > 0 and offload.staged.pass_layer is None

    # the same prompt with the whole step in each layer's one call copies the same; per 16-token step, 15x more
    model, offload = _offloaded(checkpoint, block=0)
    model.allocate_cache(8, 1)
    for begin in range(0, len(first), 16):
        model.forward(ForwardBatch((SeqChunk(0, tuple(first[begin:begin + 16]), begin, tuple(range(4)), 1),)))
    per_step = offload.expert_stats()["layers"]
    assert all(row["copied_experts"] > 3 * 8 for row in per_step)


def test_offloaded_blocks_with_hot_experts_and_a_full_pass_bank(checkpoint):
    want = _steps(load_model(checkpoint, paths=GROUPED.replace(prefill_block=29)))
    half = [[e for e in range(8) if (e + layer) % 2] for layer in range(len(LAYERS))]
    model, offload = _offloaded(checkpoint, block=29, hot=half)
    _assert_same(_steps(model), want)
    assert all(0 < row["hit_rate"] < 1 for row in offload.expert_stats()["layers"])
    assert offload.staged.pass_bank is not None
    # fewer hot experts than when the pass bank was made: its 4 slots cannot hold a layer's 7 cold ones,
    # which then go through the staging banks block by block (same logits)
    offload.set_placement([[layer % 8] for layer in range(len(LAYERS))])
    before = offload.expert_stats()["layers"]
    _assert_same(_steps(model), want)
    after = offload.expert_stats()["layers"]
    assert all(a["copied_experts"] - b["copied_experts"] > 7 for a, b in zip(after, before))


def test_prefill_block_knob():
    assert prefill_block(SimpleNamespace(prefill_block=0), offloaded=True) == OFFLOAD_PREFILL_BLOCK
    assert prefill_block(SimpleNamespace(prefill_block=0), offloaded=False) == 0
    assert prefill_block(SimpleNamespace(prefill_block=512), offloaded=False) == 512
    with pytest.raises(ConfigError, match="prefill_block"):
        load_config({"prefill_block": -1}, environ={})
    with pytest.raises(ValueError, match="prefill_block"):
        ForwardPaths(prefill_block=-2)


def test_the_family_sets_the_block_from_the_knob(checkpoint, caplog):
    """``ds4d serve``'s loader: auto gives blocks of 4096 only with experts offloaded (and says how to use
    them when ``prefill_chunk`` is no larger), an explicit value always; the model then runs them."""
    import logging

    from ds4d.contracts import PluginContext
    from ds4d.models.deepseek_v4.family import DeepseekV4Family

    def loaded(**knobs):
        base = dict(dtype="float32", device="cpu", gpus="", weight_format="auto", load_format="auto",
                    compile_decode=False, prefill_chunk=4096, prefill_block=0, expert_vram_gib=0,
                    expert_placement="static", expert_cpu_threads=1, expert_decode_cold="copy", mem_watermark_gib=0,
                    expert_calibration="")
        config = SimpleNamespace(**{**base, **knobs})
        return DeepseekV4Family(PluginContext(config=config, log=logging.getLogger("test.layer_major")), {}).load(
            checkpoint)

    assert loaded().paths.prefill_block == 0
    with caplog.at_level(logging.INFO, logger="test.layer_major"):
        offloaded = loaded(expert_vram_gib=1e-6)
    assert offloaded.expert_offload is not None and offloaded.paths.prefill_block == OFFLOAD_PREFILL_BLOCK
    assert any("prefill_block" in r.getMessage() for r in caplog.records)
    blocked = loaded(prefill_block=48)
    assert blocked.paths.prefill_block == 48 and blocked.info.extra["forward_paths"]["prefill_block"] == 48
    _assert_same(_solo(blocked, 230), _solo(loaded(), 48))
