"""DeepSeek-V4.1 through the engine on the CPU in float32, against the oracle's goldens.

The fixtures' weights (tests/fixtures/dsv41/{tiny_a,tiny_b}) are loaded by the
``deepseek_v41`` family (tiny_a: HF ``save_pretrained`` names and bare config;
tiny_b: official names, composite config); the goldens are the HF oracle's. Blocks
of 16 tokens so a prompt and its generation span several blocks and a small pool
forces preemption.
"""

from __future__ import annotations

import dataclasses

import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds4d.cache.blocks import BlockPool
from ds4d.cache.disk import DiskTier
from ds4d.cache.manager import PrefixCache
from ds4d.cache.ram import RamTier
from ds4d.contracts import BlockCopyModel, ForwardBatch, Model, SeqChunk, StatefulModel
from ds4d.engine.offline import OfflineEngine
from ds4d.models.deepseek_v4.offload import OffloadOptions
from ds4d.models.deepseek_v41.family import load_model
from ds4d.models.deepseek_v41.paths import ForwardPaths
from tests.unit.test_engine import req, run

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
BLOCK = 16
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def checkpoint_dir(name: str, into: Path) -> Path:
    """The fixture's checkpoint files without the goldens file beside them (a directory of links)."""
    into.mkdir(parents=True, exist_ok=True)
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (into / file).symlink_to(FIXTURES / name / file)
    return into


@pytest.fixture(scope="module", params=[("tiny_a", "off"), ("tiny_b", "off"), ("tiny_a", "padded"), ("tiny_b", "padded"),
                                        ("tiny_b", "padded", "offload")],
                ids=lambda param: "-".join(param))
def case(request, tmp_path_factory):
    """A fixture served with its decode steps on the per-sequence path (off) or the fixed-shape step
    (padded: what a CUDA graph captures, run eagerly); ``offload``: every routed expert in host RAM,
    copied in when chosen (tests/unit/test_dsv41_offload.py)."""
    name, decode_graphs, *offload = request.param
    path = checkpoint_dir(name, tmp_path_factory.mktemp(name))
    options = OffloadOptions(vram_bytes=1, placement="static", stage_experts=2, pin_threads=0) if offload else None
    model = load_model(path, block_tokens=BLOCK, paths=ForwardPaths(decode_graphs=decode_graphs), offload=options)
    return model, load_file(str(FIXTURES / name / "goldens.safetensors"))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def engine(model, *, num_blocks=24, max_seqs=2, prefill_chunk=512, step_tokens=512, prefix=True, ram_blocks=0,
           disk_dir=None, every_tokens=0):
    pool = BlockPool(num_blocks, BLOCK, prefix_caching=prefix)
    tiers = [RamTier(None, {"budget_bytes": ram_blocks * model.info.cache_bytes_per_block})] if ram_blocks else []
    if disk_dir is not None:
        tiers.append(DiskTier(None, {"directory": str(disk_dir), "budget_bytes": 1 << 30, "compat_hash": b"v41"}))
    cache = PrefixCache(pool, tiers=tiers, model=model, block_bytes=model.info.cache_bytes_per_block,
                        checkpoint_every_tokens=every_tokens)
    core = OfflineEngine(model, max_num_seqs=max_seqs, step_tokens=step_tokens, prefill_chunk=prefill_chunk,
                         cache=cache, namespace=b"v41")
    return core, core.outputs


def serve(core, outputs, rid, prompt, n):
    outputs.clear()
    tokens, _, _ = run(core, outputs, [req(rid, prompt, n)])
    final = [o for o in outputs if o.request_id == rid][-1]
    return tokens[rid], final.cached_tokens


def other_prompt(golden) -> list[int]:
    ids = golden["prompt_ids"].tolist()
    return ids[5:] + ids[:9]


def test_the_family_builds_a_stateful_block_copy_model(case):
    model, _ = case
    assert isinstance(model, Model) and isinstance(model, StatefulModel) and isinstance(model, BlockCopyModel)
    assert model.info.family == "deepseek_v41" and model.info.block_size_tokens == BLOCK
    model.allocate_cache(4, 1)
    assert model.pool.payload_bytes() == model.info.cache_bytes_per_block > 0


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 128, None])
def test_prompt_logits_in_any_chunking_match_the_oracle(case, chunk):
    model, golden = case
    ids = golden["prompt_ids"].tolist()
    model.allocate_cache(8, 1)
    blocks = tuple(range(-(-len(ids) // BLOCK)))
    step = chunk or len(ids)
    rows = [model.forward(ForwardBatch((SeqChunk(0, tuple(ids[i:i + step]), i, blocks, len(ids[i:i + step])),)))
            for i in range(0, len(ids), step)]
    assert relative_error(torch.cat(rows), golden["prompt_logits"]) < 1e-4


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 128])
def test_greedy_through_the_engine_equals_the_oracle_in_any_chunking(case, chunk):
    model, golden = case
    core, outputs = engine(model, prefill_chunk=chunk, step_tokens=max(chunk, 8))
    tokens, _ = serve(core, outputs, "a", golden["prompt_ids"].tolist(), golden["greedy_ids"].numel())
    assert tokens == golden["greedy_ids"].tolist()


def test_triangular_prefill_gives_the_tokens_and_logprobs_of_every_row(case):
    model, golden = case
    ids = golden["prompt_ids"].tolist()
    results = {}
    for triangular in (True, False):
        model.triangular_prefill = triangular
        model.allocate_cache(8, 1)
        blocks = tuple(range(8))
        last = model.forward(ForwardBatch((SeqChunk(0, tuple(ids), 0, blocks, 1),)))
        following = model.forward(ForwardBatch((SeqChunk(0, (int(last.argmax()),), len(ids), blocks, 1),)))
        results[triangular] = last, following
    model.triangular_prefill = True
    for got, want in zip(results[True], results[False]):
        assert got.shape == want.shape == (1, model.cfg.vocab_size)
        assert relative_error(got, want) < 1e-5
    assert relative_error(results[True][0][0], golden["prompt_logits"][-1]) < 1e-4


def test_two_sequences_in_one_step_equal_each_alone(case):
    model, golden = case
    prompts = {"a": golden["prompt_ids"].tolist(), "b": other_prompt(golden)}
    solo = {rid: serve(*engine(model), rid, p, 12)[0] for rid, p in prompts.items()}
    core, outputs = engine(model, prefill_chunk=5, step_tokens=10)  # prefill chunks and decodes share steps
    tokens, _, _ = run(core, outputs, [req(rid, p, 12) for rid, p in prompts.items()])
    assert tokens == solo
    assert solo["a"] == golden["greedy_ids"].tolist()[:12]


@pytest.mark.parametrize("prefix", [False, True])
def test_preemption_then_recompute_equals_uninterrupted(case, prefix):
    model, golden = case
    prompts = {"a": golden["prompt_ids"].tolist(), "b": other_prompt(golden)}
    solo = {rid: serve(*engine(model), rid, p, 24)[0] for rid, p in prompts.items()}
    core, outputs = engine(model, num_blocks=6, prefix=prefix)  # 6 x 16 tokens: the two cannot both finish
    tokens, _, _ = run(core, outputs, [req(rid, p, 24) for rid, p in prompts.items()])
    assert core.scheduler.preemptions_total > 0
    assert tokens == solo


@pytest.mark.parametrize("ram_blocks", [0, 8])
def test_second_turn_reuses_a_state_checkpoint_exactly(case, ram_blocks):
    model, golden = case
    turn1 = golden["prompt_ids"].tolist()
    core, outputs = engine(model, num_blocks=8 if ram_blocks else 24, ram_blocks=ram_blocks)
    gen1, cached1 = serve(core, outputs, "t1", turn1, 8)
    assert cached1 == 0
    if ram_blocks:
        serve(core, outputs, "other", other_prompt(golden) * 2, 30)  # needs the pool: turn 1's blocks go to RAM
    turn2 = turn1 + gen1 + other_prompt(golden)[:11]
    gen2, cached2 = serve(core, outputs, "t2", turn2, 8)
    assert cached2 == len(turn1) + len(gen1) - 1
    if ram_blocks:
        assert core.scheduler.cache.stats()["copies"]["promoted_blocks"] >= 1
    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", turn2, 8)[0] == gen2


@pytest.mark.parametrize("at_message", [False, True])
def test_a_prompt_parting_mid_way_resumes_at_a_checkpoint_inside_the_first(case, at_message):
    """V4.1 saves its state anywhere: a prompt parting from a cached one resumes at the periodic
    checkpoint before the parting point, or at a message start there (inside a block), exactly."""
    model, golden = case
    ids = golden["prompt_ids"].tolist()
    part = len(ids) - 3
    first, second = ids + other_prompt(golden)[:10], ids[:part] + other_prompt(golden)[10:22]
    marks = {"message_starts": (part,)} if at_message else {}
    core, outputs = engine(model, every_tokens=0 if at_message else BLOCK)  # (periodic ones would thin it out)
    outputs.clear()
    run(core, outputs, [dataclasses.replace(req("a", first, 4), **marks)])
    gen, cached = serve(core, outputs, "b", second, 8)
    assert cached == (part if at_message else part // BLOCK * BLOCK) > 0
    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", second, 8)[0] == gen


def test_restart_resumes_from_disk_blocks_and_saved_checkpoints(case, tmp_path):
    model, golden = case
    turn1 = golden["prompt_ids"].tolist()
    core, outputs = engine(model, disk_dir=tmp_path)
    gen1, _ = serve(core, outputs, "t1", turn1, 8)
    core.scheduler.cache.flush()  # what a graceful shutdown does once the engine thread stopped
    assert core.scheduler.cache.checkpoints.index_file[0].exists()
    turn2 = turn1 + gen1 + other_prompt(golden)[:11]
    restarted, restarted_outputs = engine(model, disk_dir=tmp_path)  # a fresh pool: only the disk remembers
    gen2, cached2 = serve(restarted, restarted_outputs, "t2", turn2, 8)
    assert cached2 == len(turn1) + len(gen1) - 1
    cold, cold_outputs = engine(model, prefix=False)
    assert serve(cold, cold_outputs, "cold", turn2, 8)[0] == gen2


def test_block_copy_and_state_round_trip(case):
    model, golden = case
    ids = golden["prompt_ids"].tolist()
    model.allocate_cache(8, 2)
    blocks = tuple(range(4))
    model.forward(ForwardBatch((SeqChunk(0, tuple(ids), 0, blocks, 0),)))
    payloads = model.export_blocks(blocks)
    assert [p.numel() for p in payloads] == [model.info.cache_bytes_per_block] * 4
    model.import_blocks([4, 5, 6, 7], payloads)
    model.load_state(1, model.save_state(0))
    nxt = int(golden["greedy_ids"][0])
    a = model.forward(ForwardBatch((SeqChunk(0, (nxt,), len(ids), blocks, 1),
                                    SeqChunk(1, (nxt,), len(ids), (4, 5, 6, 7), 1))))
    assert torch.equal(a[0], a[1])
    with pytest.raises(ValueError, match="position"):
        model.forward(ForwardBatch((SeqChunk(0, (nxt,), 3, blocks, 1),)))
    with pytest.raises(ValueError, match="layout"):
        model.load_state(0, model.save_state(1)[:-1])
    with pytest.raises(ValueError, match="payload"):
        model.import_blocks([0], [b"short"])


def test_engram_tables_in_ram_or_mapped_give_the_same_logits(tmp_path):
    from ds4d.models.deepseek_v41.make_tiny import write_tiny

    path = write_tiny(tmp_path / "tiny", seed=3)
    logits = {}
    for storage in ("ram", "mmap"):
        model = load_model(path, engram_storage=storage, block_tokens=BLOCK)
        assert model.info.extra["engram_storage"] == storage
        tables = [layer.engram.table for layer in model.model.weights.layers if layer.engram is not None]
        assert tables and all(t.dtype == torch.float8_e4m3fn for t in tables)
        model.allocate_cache(4, 1)
        ids = tuple(range(3, 40))
        logits[storage] = model.forward(ForwardBatch((SeqChunk(0, ids, 0, (0, 1, 2), len(ids)),)))
    assert torch.equal(logits["ram"], logits["mmap"])
    assert load_model(path, engram_storage="auto", available_bytes=1 << 40).info.extra["engram_storage"] == "ram"
    assert load_model(path, engram_storage="auto", available_bytes=1 << 20,
                      mem_watermark_bytes=1 << 20).info.extra["engram_storage"] == "mmap"


def test_unserved_knobs_are_refused():
    from ds4d.models.deepseek_v41.family import refuse_unserved
    from ds4d.registry import PluginError

    base = types.SimpleNamespace(device="cpu", dtype="float32", expert_vram_gib=0, gpus="", weight_format="auto",
                                 compile_decode=False)
    refuse_unserved(base)
    for served in ({"device": "cuda:0"}, {"device": "cuda"}, {"dtype": "bfloat16"}, {"dtype": "float16"},
                   {"dtype": "auto"}, {"device": "cuda", "compile_decode": True}, {"expert_vram_gib": 8}):
        refuse_unserved(types.SimpleNamespace(**{**vars(base), **served}))
    for change in ({"device": "mps"}, {"dtype": "float64"}, {"gpus": "0,1"},
                   {"weight_format": "native"}, {"compile_decode": True}):  # compile_decode: on the CPU
        with pytest.raises(PluginError, match="DeepSeek-V4.1"):
            refuse_unserved(types.SimpleNamespace(**{**vars(base), **change}))


def test_bfloat16_serving_keeps_the_engram_tables_in_host_memory_as_stored(tmp_path):
    """A bf16 model: weights and pools in bf16, the Engram tables FP8 on the host; its prompt logits
    near the float32 model's (the bf16 bound of test_dsv41_bf16.py is for the oracle fixtures; here
    only the argmax of well-separated rows and a loose bound are checked, against a gross error)."""
    from ds4d.models.deepseek_v41.make_tiny import write_tiny

    path = write_tiny(tmp_path / "tiny", seed=3)
    ids = tuple(range(3, 40))
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, engram_storage="ram", block_tokens=BLOCK, dtype=dtype)
        weights = model.model.weights
        assert weights.embed.dtype == dtype and model.info.dtype == str(dtype).removeprefix("torch.")
        tables = [layer.engram.table for layer in weights.layers if layer.engram is not None]
        assert tables and all(t.dtype == torch.float8_e4m3fn and t.device.type == "cpu" for t in tables)
        model.allocate_cache(4, 1)
        out[dtype] = model.forward(ForwardBatch((SeqChunk(0, ids, 0, (0, 1, 2), len(ids)),))).float()
    want, got = out[torch.float32], out[torch.bfloat16]
    assert torch.isfinite(got).all()
    per_row = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert float(per_row.median()) < 0.5, per_row
