"""DeepSeek-V4.1 on a CUDA GPU against the oracle's goldens (tests/fixtures/dsv41).

Each check runs on the reference path (plain torch) and on the paths the device picks
(``ForwardPaths.for_device``: V4's Triton hyper-connection and expert kernels, the batched decode).

* float32 (TF32 off): prompt and decode logits within 1e-4 of the oracle's, relative to the largest
  logit (as on the CPU), and the greedy tokens identical.
* several sequences decoded together from the same states as the reference path decodes them one
  by one: logits within 1e-4 in float32, the same picks.
* bfloat16 weights and activations: the bound of tests/unit/test_dsv41_bf16.py (whose docstring says
  why it is not a small number on these random tiny fixtures): per position, the max |logit diff|
  over max |logit| against the oracle, median and max, at most twice those of the float32 model on
  the bf16-rounded weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tokenizers import Tokenizer

from ds4d.models.deepseek_v41 import DeepseekV41Config, DeepseekV41Model
from ds4d.models.deepseek_v41.paths import ForwardPaths
from ds4d.models.deepseek_v41.weights import read_safetensors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dsv41"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def per_position(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (got - want).abs().amax(-1) / want.abs().amax(-1)


PATHS = {"reference": ForwardPaths(), "device": ForwardPaths.for_device("cuda"),
         "route-kernel": ForwardPaths.for_device("cuda").replace(route_kernel=True)}
"""``route-kernel``: the device's paths with a decode step's routing in one launch (``route_triton``, off by
default)."""


def run(directory: Path, dtype: torch.dtype, golden: dict, paths: str = "device") -> tuple[torch.Tensor, list[int]]:
    """Prompt logits, then decode logits along the oracle's greedy tokens (teacher-forced), and the
    model's own greedy picks at each step."""
    model = DeepseekV41Model.from_pretrained(directory, dtype=dtype, device="cuda", paths=PATHS[paths])
    state = model.new_state()
    rows = [model.prefill(state, golden["prompt_ids"].tolist()).float().cpu()]
    for token in golden["greedy_ids"].tolist():
        rows.append(model.decode(state, token).float().cpu()[None])
    logits = torch.cat(rows)
    return logits, logits.argmax(-1).tolist()


@pytest.mark.parametrize("paths", sorted(PATHS))
@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_float32_on_the_device_matches_the_oracle(name, paths):
    golden = load_file(str(FIXTURES / name / "goldens.safetensors"))
    logits, _ = run(FIXTURES / name, torch.float32, golden, paths)
    want = torch.cat([golden["prompt_logits"], golden["decode_logits"]])
    assert logits.shape == want.shape
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-4
    picks = logits[golden["prompt_ids"].numel() - 1 :].argmax(-1)[:-1]
    assert picks.tolist() == golden["greedy_ids"].tolist()


@pytest.mark.parametrize("paths", sorted(PATHS))
@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_bfloat16_on_the_device_within_its_bound(name, paths):
    golden = load_file(str(FIXTURES / name / "goldens.safetensors"))
    want = torch.cat([golden["prompt_logits"], golden["decode_logits"]])
    logits, _ = run(FIXTURES / name, torch.bfloat16, golden, paths)
    assert logits.shape == want.shape and torch.isfinite(logits).all()
    error = per_position(logits, want)
    tensors = {k: v.bfloat16().float() if v.is_floating_point() else v
               for k, v in read_safetensors(FIXTURES / name).items()}
    cfg = DeepseekV41Config.from_file(FIXTURES / name)
    rounded = DeepseekV41Model.from_tensors(cfg, tensors, Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json")),
                                            device="cuda", paths=ForwardPaths())
    state = rounded.new_state()
    rows = [rounded.prefill(state, golden["prompt_ids"].tolist()).float().cpu()]
    rows += [rounded.decode(state, token).float().cpu()[None] for token in golden["greedy_ids"].tolist()]
    floor = per_position(torch.cat(rows), want)
    assert error.median() < 2 * floor.median(), (float(error.median()), float(floor.median()))
    assert error.max() < 2 * floor.max(), (float(error.max()), float(floor.max()))


def test_served_on_the_device_the_engram_tables_stay_page_locked_on_the_host(tmp_path):
    """The family's model on CUDA: weights and pools there, the Engram tables in host memory,
    page-locked (``ram``); the served prompt logits equal the oracle's in float32."""
    from ds4d.contracts import ForwardBatch, SeqChunk
    from ds4d.models.deepseek_v41.family import load_model

    golden = load_file(str(FIXTURES / "tiny_a" / "goldens.safetensors"))
    for file in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / file).symlink_to(FIXTURES / "tiny_a" / file)
    model = load_model(tmp_path, engram_storage="ram", block_tokens=16, device="cuda", dtype=torch.float32)
    weights = model.model.weights
    assert weights.embed.is_cuda
    tables = [layer.engram.table for layer in weights.layers if layer.engram is not None]
    assert tables and all(t.device.type == "cpu" and t.is_pinned() for t in tables)
    ids = golden["prompt_ids"].tolist()
    model.allocate_cache(-(-len(ids) // 16) + 1, 1)
    blocks = tuple(range(-(-len(ids) // 16)))
    logits = model.forward(ForwardBatch((SeqChunk(0, tuple(ids), 0, blocks, len(ids)),))).float().cpu()
    want = golden["prompt_logits"]
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk,last_only", [(None, False), (7, False), (None, True)])
def test_the_window_kernel_on_the_device_equals_the_dense_attention(dtype, tolerance, chunk, last_only, monkeypatch):
    """Each prefill attention core of the tiny models through the compiled kernel and through the
    dense mask from the same state (bf16: the kernel rounds the probabilities before normalising them,
    the dense path after)."""
    from tests.unit.test_dsv41_paths import check_window_kernel

    for name in ("tiny_a", "tiny_b"):
        reference = DeepseekV41Model.from_pretrained(FIXTURES / name, dtype=dtype, device="cuda", paths=ForwardPaths())
        check_window_kernel(reference, monkeypatch, chunk, last_only, tolerance)


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_sequences_decoded_together_equal_each_decoded_alone(name):
    reference = DeepseekV41Model.from_pretrained(FIXTURES / name, device="cuda", paths=ForwardPaths())
    batched = DeepseekV41Model(reference.cfg, reference.weights, reference.hasher, device="cuda",
                               paths=PATHS["device"])
    assert batched.paths.batched_decode and batched.paths.fused_hyper and batched.paths.expert_rows
    gen = torch.Generator().manual_seed(4)
    lengths = (3, 2 * reference.cfg.sliding_window + 1, 20, 7)
    prompts = [torch.randint(3, reference.cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    states = [reference.new_state() for _ in prompts]
    nxt = [int(reference.prefill(state, ids)[-1].argmax()) for state, ids in zip(states, prompts)]
    for _ in range(4):
        copies = [state.clone() for state in states]
        want = torch.stack([reference.decode(state, token) for state, token in zip(states, nxt)]).cpu()
        got = batched.decode_many(copies, nxt).cpu()
        assert float((got - want).abs().max() / want.abs().max()) < 1e-4
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        nxt = want.argmax(-1).tolist()


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
@pytest.mark.parametrize("route_kernel", [False, True])
@pytest.mark.parametrize("decode_graphs, compile_decode", [("padded", False), ("cuda", False), ("cuda", True)])
def test_the_fixed_shape_decode_step_equals_the_per_sequence_forward(name, decode_graphs, compile_decode,
                                                                     route_kernel):
    """tests/unit/test_dsv41_fixed_decode.py's check on the device: the fixed-shape step eagerly,
    replayed from its CUDA graphs, and compiled inside them, against the reference path, from the same
    states each step; its routing in torch's operators and in one launch (``route_kernel``)."""
    from tests.unit.test_dsv41_fixed_decode import check_fixed_decode

    fixed = check_fixed_decode(name, decode_graphs, device="cuda", tolerance=1e-4, compile_decode=compile_decode,
                               route_kernel=route_kernel)
    assert fixed.model.paths.route_kernel == route_kernel
    assert fixed.graph_failure is None and len(fixed.graphs) == 1  # one bucket: 4 rows, 16 blocks


@pytest.mark.parametrize("rows", [5, 200])
def test_expert_kernels_on_the_device_equal_the_reference_loop(rows):
    """bf16 on the device: the expert-row GEMVs (a few rows) and the grouped matmuls (many rows) against
    the one-expert-at-a-time loop on the same weights, within bf16's rounding of each projection."""
    from ds4d.models.deepseek_v41.moe import moe_forward

    model = DeepseekV41Model.from_pretrained(FIXTURES / "tiny_b", dtype=torch.bfloat16, device="cuda")
    cfg = model.cfg
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16().cuda()
    for layer in model.weights.layers:
        want = moe_forward(x, layer.ffn, cfg).float()
        got = moe_forward(x, layer.ffn, cfg, expert_rows=True, grouped=True).float()
        assert float((got - want).abs().max() / want.abs().max()) < 2e-2


@pytest.fixture(scope="module")
def official_tiny(tmp_path_factory) -> Path:
    """A ``ds4d make-tiny`` checkpoint in the official format: FP8 linears, FP4 routed experts."""
    from ds4d.models.deepseek_v41.make_tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("official") / "v41", seed=7)


def stored_and_dense(path: Path, dtype: torch.dtype) -> tuple[DeepseekV41Model, DeepseekV41Model]:
    from ds4d.models.deepseek_v41.checkpoint import OfficialCheckpoint
    from ds4d.models.deepseek_v41.family import CheckpointTensors
    from ds4d.models.deepseek_v41.tokenizer import load_tokenizer

    cfg = DeepseekV41Config.from_file(path)
    tokenizer, _ = load_tokenizer(path)
    checkpoint = OfficialCheckpoint(path, groups=("text",))
    return tuple(DeepseekV41Model.from_tensors(cfg, CheckpointTensors(checkpoint, "ram",
                                                                      stored=("fp8", "fp4") if stored else ()),
                                               tokenizer, stored_weights=stored, dtype=dtype, device="cuda")
                 for stored in (True, False))


@pytest.mark.parametrize("rows", [5, 200])
def test_stored_weights_in_the_feed_forward_on_the_device_equal_the_decoded_ones(official_tiny, rows):
    """bf16: the MXFP4 GEMV (a few rows) and the MXFP4 grouped tiles (many rows) over FP4 banks as
    stored, and the shared expert's FP8 linears as stored, against the one-expert-at-a-time loop over
    the decoded weights."""
    from ds4d.models.deepseek_v41.moe import moe_forward

    stored, dense = stored_and_dense(official_tiny, torch.bfloat16)
    cfg = stored.cfg
    assert stored.weights.layers[0].ffn.banks.stored and stored.weights.layers[0].ffn.banks.w1.packed.is_cuda
    x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).bfloat16().cuda()
    for s, d in zip(stored.weights.layers, dense.weights.layers):
        want = moe_forward(x, d.ffn, cfg).float()
        got = moe_forward(x, s.ffn, cfg, expert_rows=True, grouped=True).float()
        assert float((got - want).abs().max() / want.abs().max()) < 2e-2


@pytest.mark.parametrize("decode_graphs", ["padded", "cuda"])
def test_the_fixed_decode_step_with_stored_weights(official_tiny, decode_graphs):
    """float32 activations over FP8 linears and FP4 banks as stored: the fixed-shape step (eager, and
    from its CUDA graphs; FP8 tiles, MXFP4 GEMV) against the per-sequence reference path (FP8 GEMV,
    experts decoded one at a time), from the same states each step."""
    from tests.unit.test_dsv41_fixed_decode import check_fixed_decode

    stored, _ = stored_and_dense(official_tiny, torch.float32)
    fixed = check_fixed_decode(stored, decode_graphs, device="cuda", tolerance=1e-4)
    assert fixed.model.weights.layers[0].ffn.banks.stored and fixed.graph_failure is None


def test_the_family_keeps_the_weights_as_stored_on_cuda(official_tiny):
    """``weight_format`` auto on CUDA in bf16 keeps the FP8 linears and the routed experts' FP4 (a
    quarter of bf16's bytes); ``dense`` decodes them; both serve a prompt."""
    from ds4d.contracts import ForwardBatch, SeqChunk
    from ds4d.models.deepseek_v41.family import load_model

    served = {fmt: load_model(official_tiny, device="cuda", dtype=torch.bfloat16, weight_format=fmt, block_tokens=16)
              for fmt in ("auto", "dense")}
    assert served["auto"].info.extra["stored_weights"] and not served["dense"].info.extra["stored_weights"]
    banks = {fmt: s.model.weights.layers[0].ffn.banks for fmt, s in served.items()}
    assert banks["auto"].stored and banks["auto"].stored_bytes() * 3 < banks["dense"].stored_bytes()
    from ds4d.models.deepseek_v4.stored import Fp8Weight

    assert isinstance(served["auto"].model.weights.layers[0].attn.wq_b, Fp8Weight)
    assert served["auto"].info.extra["stored_weights"] == ["fp8", "fp4"]
    assert served["auto"].info.parameter_bytes < served["dense"].info.parameter_bytes
    ids = tuple(range(5, 45))
    for s in served.values():
        s.allocate_cache(4, 1)
        logits = s.forward(ForwardBatch((SeqChunk(0, ids, 0, (0, 1, 2), 1),)))
        assert logits.shape[-1] == s.cfg.vocab_size and bool(torch.isfinite(logits).all())


def test_float16_keeps_the_weights_as_stored_too(official_tiny):
    """float16 activations (GPUs without bf16): the family keeps FP8 linears (where the device has e4m3)
    and FP4 experts as stored, and the MXFP4/FP8 products agree with the decoded weights' in float16."""
    from ds4d.contracts import ForwardBatch, SeqChunk
    from ds4d.models.deepseek_v41.family import load_model
    from ds4d.models.deepseek_v41.moe import moe_forward

    served = load_model(official_tiny, device="cuda", dtype=torch.float16, block_tokens=16)
    assert served.info.extra["stored_weights"] == ["fp8", "fp4"]
    stored, dense = stored_and_dense(official_tiny, torch.float16)
    cfg = stored.cfg
    for rows in (5, 200):
        x = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows)).half().cuda()
        for s, d in zip(stored.weights.layers, dense.weights.layers):
            want = moe_forward(x, d.ffn, cfg).float()
            got = moe_forward(x, s.ffn, cfg, expert_rows=True, grouped=True).float()
            assert float((got - want).abs().max() / want.abs().max()) < 2e-2
    served.allocate_cache(4, 1)
    logits = served.forward(ForwardBatch((SeqChunk(0, tuple(range(5, 45)), 0, (0, 1, 2), 1),)))
    assert bool(torch.isfinite(logits).all())


def offloaded_stored(path: Path, dtype: torch.dtype, hot_share: int = 3, fetch_ahead: int = 0) -> DeepseekV41Model:
    """The checkpoint with FP8 linears and FP4 experts as stored, the experts offloaded: one in
    ``hot_share`` of each layer's on the device, the rest in page-locked host RAM (``fetch_ahead``:
    ``OffloadOptions.fetch_ahead``)."""
    from ds4d.models.deepseek_v4.offload import OffloadOptions
    from ds4d.models.deepseek_v41.checkpoint import OfficialCheckpoint
    from ds4d.models.deepseek_v41.family import CheckpointTensors
    from ds4d.models.deepseek_v41.tokenizer import load_tokenizer

    cfg = DeepseekV41Config.from_file(path)
    tokenizer, _ = load_tokenizer(path)
    model = DeepseekV41Model.from_tensors(
        cfg, CheckpointTensors(OfficialCheckpoint(path, groups=("text",)), "ram", stored=("fp8", "fp4")), tokenizer,
        stored_weights=True, dtype=dtype, device="cuda",
        offload=OffloadOptions(vram_bytes=64 << 20, stage_experts=2, fetch_ahead=fetch_ahead))
    experts = cfg.n_routed_experts
    model.expert_offload.set_placement([list(range(experts))[layer % hot_share::hot_share]
                                        for layer in range(cfg.num_hidden_layers)])
    return model


@pytest.mark.parametrize(("decode_graphs", "ahead"), [("padded", 0), ("cuda", 0), ("cuda", 16)])
def test_the_fixed_decode_step_with_offloaded_experts(official_tiny, decode_graphs, ahead):
    """float32 activations, weights as stored, two thirds of the routed experts in page-locked host RAM:
    the fixed-shape step reads each expert where it sits (zero-copy: device bank or host memory, no
    routing read back), eagerly and from its CUDA graphs, against the model with every expert on the
    device on the per-sequence reference path, from the same states each step.  ``ahead``: predicted cold
    experts fetched a layer ahead on a side stream (``fetch_ahead``)."""
    from tests.unit.test_dsv41_fixed_decode import check_fixed_decode

    stored, _ = stored_and_dense(official_tiny, torch.float32)
    model = offloaded_stored(official_tiny, torch.float32, fetch_ahead=ahead)
    offload = model.expert_offload
    assert offload.native and offload.zero_copy and offload.pinned.enabled
    fixed = check_fixed_decode(model, decode_graphs, device="cuda", tolerance=1e-4, reference=stored)
    assert fixed.graph_failure is None and fixed.model.expert_offload is offload
    if decode_graphs == "cuda":
        assert len(fixed.graphs) == 1
    assert offload.expert_stats()["host_read_bytes"] > 0
    assert (offload.expert_stats()["fetched_ahead_pairs"] > 0) == bool(ahead)


def test_the_family_offloads_experts_in_bf16_and_prefill_copies_only_the_chosen(official_tiny):
    """bf16 with the weights as stored: a prompt through the offloaded model (its prefill copies the cold
    experts its rows chose, never the others) gives the logits of the model with every expert on the
    device, up to the order of the bf16 products."""
    from ds4d.contracts import ForwardBatch, SeqChunk
    from ds4d.models.deepseek_v41.serving import DeepseekV41Serving

    stored, _ = stored_and_dense(official_tiny, torch.bfloat16)
    model = offloaded_stored(official_tiny, torch.bfloat16)
    ids = tuple(range(5, 69))
    logits = []
    for m in (stored, model):
        serving = DeepseekV41Serving(m, tokenizer=None, block_tokens=16)
        serving.allocate_cache(8, 1)
        logits.append(serving.forward(ForwardBatch((SeqChunk(0, ids, 0, tuple(range(4)), len(ids)),))).float().cpu())
    assert float((logits[1] - logits[0]).abs().max() / logits[0].abs().max()) < 2e-2
    stats = model.expert_offload.expert_stats()
    assert stats["bytes_copied"] > 0 and stats["gpu_experts"] > 0
    for row, hot in zip(stats["layers"], model.expert_offload.hot_experts()):  # every cold expert: copied or skipped
        assert row["calls"] > 0
        assert row["copied_experts"] + row["skipped_transfers"] == row["calls"] * (model.cfg.n_routed_experts - len(hot))
