"""DeepSeek-V4.1 on a CUDA GPU against the oracle's goldens (tests/fixtures/dsv41).

The model has no GPU-specific paths yet: this checks that its torch forward runs on the device and
what precision costs there.

* float32 (TF32 off): prompt and decode logits within 1e-4 of the oracle's, relative to the largest
  logit (as on the CPU), and the greedy tokens identical.
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


def run(directory: Path, dtype: torch.dtype, golden: dict) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits, then decode logits along the oracle's greedy tokens (teacher-forced), and the
    model's own greedy picks at each step."""
    model = DeepseekV41Model.from_pretrained(directory, dtype=dtype, device="cuda")
    state = model.new_state()
    rows = [model.prefill(state, golden["prompt_ids"].tolist()).float().cpu()]
    for token in golden["greedy_ids"].tolist():
        rows.append(model.decode(state, token).float().cpu()[None])
    logits = torch.cat(rows)
    return logits, logits.argmax(-1).tolist()


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_float32_on_the_device_matches_the_oracle(name):
    golden = load_file(str(FIXTURES / name / "goldens.safetensors"))
    logits, _ = run(FIXTURES / name, torch.float32, golden)
    want = torch.cat([golden["prompt_logits"], golden["decode_logits"]])
    assert logits.shape == want.shape
    assert float((logits - want).abs().max() / want.abs().max()) < 1e-4
    picks = logits[golden["prompt_ids"].numel() - 1 :].argmax(-1)[:-1]
    assert picks.tolist() == golden["greedy_ids"].tolist()


@pytest.mark.parametrize("name", ["tiny_a", "tiny_b"])
def test_bfloat16_on_the_device_within_its_bound(name):
    golden = load_file(str(FIXTURES / name / "goldens.safetensors"))
    want = torch.cat([golden["prompt_logits"], golden["decode_logits"]])
    logits, _ = run(FIXTURES / name, torch.bfloat16, golden)
    assert logits.shape == want.shape and torch.isfinite(logits).all()
    error = per_position(logits, want)
    tensors = {k: v.bfloat16().float() if v.is_floating_point() else v
               for k, v in read_safetensors(FIXTURES / name).items()}
    cfg = DeepseekV41Config.from_file(FIXTURES / name)
    rounded = DeepseekV41Model.from_tensors(cfg, tensors, Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json")),
                                            device="cuda")
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
