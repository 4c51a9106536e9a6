"""DeepSeek-V4.1 with its routed experts split between a "device" bank and host RAM.

The offload machinery is device-agnostic, so here the "device" is the CPU and the
host copies are separate CPU tensors: the placement, the zero-token skip, the staging
banks and the host-thread experts run as on a GPU.  On the oracle fixtures (float32):

* the offloaded feed-forward gives the all-on-device one on the same rows (the
  experts' products laid out per row rather than per expert: float32 summation order);
* whole runs give the same logits bit for bit wherever the experts sit (all cold, half
  hot, all hot, cold ones on host threads), on a ``make-tiny`` model, whose experts are
  64 wide: the CPU's vectorised SwiGLU then rounds every row alike however many rows a
  piece has (the fixtures' 16-wide experts leave a loop tail, computed by scalar code
  that rounds otherwise, whose length depends on the piece: one ulp of difference);
* the oracle's prompt logits (1e-4) and greedy tokens through the engine;
* a cold expert no token chose is never copied, and the counters say what was;
* FP4 banks kept as stored (Triton's interpreter) take the zero-copy decode step and
  give the stored model's products.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ds4d.contracts import ForwardBatch, SeqChunk
from ds4d.models.deepseek_v4.offload import OffloadOptions
from ds4d.models.deepseek_v41.family import CheckpointTensors, load_model
from ds4d.models.deepseek_v41.checkpoint import OfficialCheckpoint
from ds4d.models.deepseek_v41.config import DeepseekV41Config
from ds4d.models.deepseek_v41.make_tiny import write_tiny
from ds4d.models.deepseek_v41.model import DeepseekV41Model
from ds4d.models.deepseek_v41.moe import moe_forward, offloaded_forward
from ds4d.models.deepseek_v41.paths import ForwardPaths
from ds4d.models.deepseek_v41.tokenizer import load_tokenizer
from tests.unit.test_dsv41_serving import BLOCK, checkpoint_dir, engine, serve

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"
pytestmark = pytest.mark.usefixtures("one_torch_thread")

STAGE = 2


def expert_bytes(cfg: DeepseekV41Config) -> int:
    """One expert decoded to float32 (w1, w3 ``[I, D]``, w2 ``[D, I]``)."""
    return 3 * cfg.moe_intermediate_size * cfg.hidden_size * 4


def options(cfg: DeepseekV41Config, hot_experts: int, **changes) -> OffloadOptions:
    """A device budget holding ``hot_experts`` experts besides the two staging banks."""
    vram = (hot_experts + 2 * STAGE) * expert_bytes(cfg)
    return OffloadOptions(vram_bytes=vram, stage_experts=STAGE, pin_threads=0, **changes)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return checkpoint_dir("tiny_b", tmp_path_factory.mktemp("tiny_b"))


@pytest.fixture(scope="module")
def golden():
    return load_file(str(FIXTURES / "tiny_b" / "goldens.safetensors"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny") / "v41", seed=5)


def offloaded(path: Path, hot_experts: int, **changes):
    cfg = DeepseekV41Config.from_file(path)
    return load_model(path, block_tokens=BLOCK, paths=ForwardPaths(), offload=options(cfg, hot_experts, **changes))


def prompt_logits(model, ids: list[int], chunk: int) -> torch.Tensor:
    model.allocate_cache(8, 1)
    blocks = tuple(range(-(-len(ids) // BLOCK)))
    rows = [model.forward(ForwardBatch((SeqChunk(0, tuple(ids[i:i + chunk]), i, blocks, len(ids[i:i + chunk])),)))
            for i in range(0, len(ids), chunk)]
    return torch.cat(rows)


def test_the_layers_keep_no_experts_and_the_offload_holds_them(fixture_dir):
    model = offloaded(fixture_dir, hot_experts=10)
    offload = model.model.expert_offload
    assert all(layer.ffn.banks is None for layer in model.model.weights.layers)
    cfg = model.cfg
    assert offload.layers == cfg.num_hidden_layers and offload.experts == cfg.n_routed_experts
    assert sum(len(hot) for hot in offload.hot_experts()) == 10
    assert offload.host_experts() >= cfg.num_hidden_layers * cfg.n_routed_experts - 10
    assert offload.form.pair_weighted and offload.kind == "float"
    stats = model.expert_stats()
    assert stats["gpu_experts"] == 10 and stats["ram_experts"] == cfg.num_hidden_layers * cfg.n_routed_experts - 10
    # the experts are counted once, in the model's parameters
    plain = load_model(fixture_dir, block_tokens=BLOCK)
    assert model.info.parameter_bytes == plain.info.parameter_bytes
    assert plain.expert_stats() == {}


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_offloaded_feed_forward_gives_the_on_device_one(fixture_dir, rows):
    plain = load_model(fixture_dir, block_tokens=BLOCK).model
    model = offloaded(fixture_dir, hot_experts=12).model
    cfg = plain.cfg
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    for layer, (p, o) in enumerate(zip(plain.weights.layers, model.weights.layers)):
        want = moe_forward(x, p.ffn, cfg)
        for decode in (False, True):
            got = offloaded_forward(x, o.ffn, cfg, model.expert_offload, layer, decode=decode)
            assert got.dtype == want.dtype and relative_error(got, want) < 1e-6


PLACEMENTS = {"all cold": dict(hot_experts=0), "half hot": dict(hot_experts=16),
              "all hot": dict(hot_experts=32), "cold on host threads": dict(hot_experts=5, decode_cold="cpu")}


@pytest.fixture(scope="module")
def runs(tiny):
    """Per placement: a prompt's logits in chunks of 5, then 12 greedy tokens through the engine."""
    cfg = DeepseekV41Config.from_file(tiny)
    assert cfg.num_hidden_layers * cfg.n_routed_experts == 32
    ids = torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    out = {}
    for name, placement in PLACEMENTS.items():
        model = offloaded(tiny, **placement)
        logits = prompt_logits(model, ids, 5)
        tokens, _ = serve(*engine(model), "a", ids, 12)
        out[name] = logits, tokens, model.expert_stats()
    return out


def test_every_placement_gives_the_same_logits_bit_for_bit(runs):
    want, tokens, _ = runs["all hot"]
    for name, (logits, got_tokens, _) in runs.items():
        assert torch.equal(logits, want), name
        assert got_tokens == tokens, name


def test_the_offloaded_model_gives_the_oracles_logits_and_tokens(fixture_dir, golden):
    model = offloaded(fixture_dir, hot_experts=21)
    ids = golden["prompt_ids"].tolist()
    assert relative_error(prompt_logits(model, ids, 5), golden["prompt_logits"]) < 1e-4
    tokens, _ = serve(*engine(model), "a", ids, golden["greedy_ids"].numel())
    assert tokens == golden["greedy_ids"].tolist()


def test_cold_experts_nobody_chose_are_never_copied(runs, tiny):
    cfg = DeepseekV41Config.from_file(tiny)
    stats = runs["all cold"][2]
    calls = sum(layer["calls"] for layer in stats["layers"])
    assert stats["gpu_experts"] == 0 and calls > 0
    copied = sum(layer["copied_experts"] for layer in stats["layers"])
    # a one-token step routes k of the experts: the others are skipped
    assert cfg.num_experts_per_tok < cfg.n_routed_experts
    assert stats["skipped_transfers"] > 0 and copied + stats["skipped_transfers"] == calls * cfg.n_routed_experts
    assert stats["bytes_copied"] == copied * expert_bytes(cfg)
    assert stats["bytes_skipped"] == stats["skipped_transfers"] * expert_bytes(cfg)
    host = runs["cold on host threads"][2]
    assert sum(layer["cpu_experts"] for layer in host["layers"]) > 0


def _fp4_tiny(tmp_path: Path):
    """A tiny V4.1 checkpoint's config, and a maker of models over it with the routed experts kept as FP4 codes
    and scales (the MXFP4 kernels, in Triton's interpreter here), offloaded as the options given say."""
    pytest.importorskip("triton")
    from ds4d.cuda import quant_matmul

    if not quant_matmul.available():
        pytest.skip("the MXFP4 kernels cannot run here")
    path = write_tiny(tmp_path / "v41", seed=5)
    cfg = DeepseekV41Config.from_file(path)
    tokenizer, _ = load_tokenizer(path)
    checkpoint = OfficialCheckpoint(path, groups=("text",))

    def model(offload: OffloadOptions | None = None) -> DeepseekV41Model:
        return DeepseekV41Model.from_tensors(cfg, CheckpointTensors(checkpoint, "ram", stored=("fp4",)), tokenizer,
                                             stored_weights=True, offload=offload)

    return cfg, model


def test_fp4_banks_kept_as_stored_take_the_zero_copy_decode(tmp_path):
    """Routed experts as FP4 codes and scales (the MXFP4 kernels through Triton's interpreter), a third
    of them hot: decode steps read every expert where it sits (no routing read back) and give the
    model with the banks on the device, from the same states, within float32 summation order."""
    cfg, fp4_model = _fp4_tiny(tmp_path)
    stored = fp4_model()
    experts = cfg.num_hidden_layers * cfg.n_routed_experts
    model = fp4_model(OffloadOptions(vram_bytes=1 << 20, stage_experts=STAGE, pin_threads=0))
    offload = model.expert_offload
    assert offload.native and offload.zero_copy and offload.capturable(1)
    offload.set_placement([list(range(cfg.n_routed_experts))[layer % 3::3] for layer in range(cfg.num_hidden_layers)])
    assert 0 < sum(map(len, offload.hot_experts())) < experts
    state, twin = stored.new_state(), model.new_state()
    ids = torch.randint(3, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1)).tolist()
    stored.prefill(state, ids[:6])
    model.prefill(twin, ids[:6])
    for token in ids[6:]:
        twin = state.clone()
        want, got = stored.decode(state, token), model.decode(twin, token)
        assert relative_error(got, want) < 1e-5
    reads = offload.expert_stats()["host_read_bytes"]
    assert reads > 0  # cold experts were read from host memory in place


def test_the_fixed_decode_step_with_offloaded_experts(fixture_dir):
    """The fixed-shape decode step (eager, as padded buckets) with every routed expert cold, against
    the per-sequence reference path with every expert on the device, from the same states each step."""
    from tests.unit.test_dsv41_fixed_decode import check_fixed_decode

    cfg = DeepseekV41Config.from_file(fixture_dir)
    model = DeepseekV41Model.from_pretrained(fixture_dir, offload=options(cfg, 0))
    reference = DeepseekV41Model.from_pretrained(fixture_dir, paths=ForwardPaths())
    fixed = check_fixed_decode(model, "padded", tolerance=1e-5, reference=reference)
    assert fixed.model.expert_offload is model.expert_offload
    assert model.expert_offload.expert_stats()["bytes_copied"] > 0


def test_cold_experts_fetched_ahead_give_the_logits_of_gathering_them(tmp_path):
    """``fetch_ahead`` on V4.1 (FP4 banks as stored, Triton's interpreter, a third of the experts hot): each
    decode layer's cold experts are fetched as its router predicts them from the feed-forward input of the
    layer before; the logits equal those of the same placement gathering every cold expert at its layer,
    bit for bit, and some of the cold experts read were ones fetched ahead."""
    cfg, fp4_model = _fp4_tiny(tmp_path)
    models = [fp4_model(OffloadOptions(vram_bytes=1 << 20, stage_experts=STAGE, pin_threads=0, fetch_ahead=ahead))
              for ahead in (0, 8)]
    for model in models:
        model.expert_offload.set_placement([list(range(cfg.n_routed_experts))[layer % 3::3]
                                            for layer in range(cfg.num_hidden_layers)])
    gathered, fetched = models
    assert fetched.expert_offload.zero_copy_experts.ahead_rows == 8
    state, twin = gathered.new_state(), fetched.new_state()
    ids = torch.randint(3, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    gathered.prefill(state, ids[:6])
    fetched.prefill(twin, ids[:6])
    for token in ids[6:]:
        assert torch.equal(fetched.decode(twin, token), gathered.decode(state, token))
    stats = fetched.expert_offload.expert_stats()
    assert stats["host_read_bytes"] == gathered.expert_offload.expert_stats()["host_read_bytes"] > 0
    assert 0 < stats["fetched_ahead_pairs"] <= stats["host_read_bytes"] // fetched.expert_offload.host_expert_bytes
    assert not fetched.expert_offload.zero_copy_experts._pending
